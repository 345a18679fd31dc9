#!/usr/bin/env bash
# Create .venv (if missing) and install tracetrain with the extras in $EXTRAS (default: dev, the
# test tools; the test command adds verl, which brings Ray).
# torch==2.13.0 goes first: a bare `torch` requirement would pull a multi-GB CUDA build here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q "torch==2.13.0" -e ".[${EXTRAS:-dev}]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, tracetrain; print('tracetrain', tracetrain.__version__, 'torch', torch.__version__)"
