#!/usr/bin/env bash
# verifiers 0.4 (the `verifiers.v1` API) in its own venv: it pins openai<3, below the openai
# tracetrain's venv holds. An `env.verifiers` section with `python: .venv-verifiers/bin/python`
# runs the environment in a worker process there (tracetrain/envs/verifiers_worker.py), with this
# venv's bin/ first on PATH: verifiers' harnesses run their programs with `uv`, installed here too.
#   bash scripts/install-verifiers.sh          # -> .venv-verifiers/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERIFIERS_VENV:-.venv-verifiers}
PY=${PYTHON:-python3}
WANT=${VERIFIERS_VERSION:-0.4.0}
if [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/uv" ] && "$VENV/bin/python" -c "import importlib.metadata as m, verifiers.v1; assert m.version('verifiers') == '$WANT'" 2>/dev/null; then
    echo "verifiers $WANT already installed in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q "verifiers==$WANT" uv 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import importlib.metadata as m, verifiers.v1; print('verifiers', m.version('verifiers'))"
