#!/usr/bin/env bash
# AutoGen (autogen-agentchat + autogen-ext[openai]) in its own venv: autogen-core pins protobuf
# 5.29, below what tracetrain's venv holds for Ray and TensorBoard (>= 6.31), as a user's own
# AutoGen environment would. The AutoGen test runs its agent from here as a command agent.
#   bash scripts/install-autogen.sh          # -> .venv-autogen/bin/python
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AUTOGEN_VENV:-.venv-autogen}
PY=${PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import autogen_agentchat, autogen_ext.models.openai" 2>/dev/null; then
    echo "autogen already installed in $VENV"
    exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -m pip install -q "autogen-agentchat>=0.7" "autogen-ext[openai]>=0.7" 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import autogen_agentchat; print('autogen-agentchat', autogen_agentchat.__version__)"
