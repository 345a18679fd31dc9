#!/usr/bin/env bash
# Install, lint, and run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,verl bash scripts/install.sh
bash scripts/install-vllm.sh  # the real vLLM server the vllm engine's tests start (.venv-vllm)
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
