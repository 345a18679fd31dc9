#!/usr/bin/env bash
# verifiers 0.4 (the `verifiers.v1` API) in its own venv: it pins openai<3, below the openai
# tracetrain's venv holds. An `env.verifiers` section with `python: .venv-verifiers/bin/python`
# runs the environment in a worker process there (tracetrain/envs/verifiers_worker.py), with this
# venv's bin/ first on PATH: verifiers' harnesses run their programs with `uv`, installed here too.
#
# The null and bash harnesses run verifiers' chat program, a PEP 723 script that verifiers writes
# to ~/.cache/verifiers/runtimes/scripts/<sha256 of its text>.py and syncs (`uv sync --script`,
# UV_OFFLINE=false) in each worker before its first episode: without a lock uv resolves the
# script's packages against PyPI at every such sync. This script writes the program there with a
# lock beside it (`uv lock --script`) and syncs its environment into uv's cache, so that sync
# needs no network; it checks so with `--offline`. Run it again after `uv cache clean` or another
# verifiers version (another program text: another path).
#   bash scripts/install-verifiers.sh          # -> .venv-verifiers/bin/python, the chat program
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VERIFIERS_VENV:-.venv-verifiers}
PY=${PYTHON:-python3}
WANT=${VERIFIERS_VERSION:-0.4.0}

installed() {
    [ -x "$VENV/bin/python" ] && [ -x "$VENV/bin/uv" ] && "$VENV/bin/python" -c "import importlib.metadata as m, verifiers.v1; assert m.version('verifiers') == '$WANT'" 2>/dev/null
}

# The chat program at the path verifiers runs it from (runtimes/base.py, prepare_uv_script).
chat_program() {
    "$VENV/bin/python" - <<'EOF'
import hashlib
import os

from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

data = CHAT_PROGRAM_SOURCE.encode()
path = os.path.join(SubprocessRuntime.scripts_dir, hashlib.sha256(data).hexdigest() + ".py")
os.makedirs(SubprocessRuntime.scripts_dir, exist_ok=True)
with open(path + ".tmp", "wb") as f:
    f.write(data)
os.replace(path + ".tmp", path)
print(path)
EOF
}

# The harness's own commands, offline: they succeed only from the lock and uv's cache.
offline_ready() {
    PATH="$VENV/bin:$PATH" uv sync --script "$1" -q --no-config --offline 2>/dev/null \
        && PATH="$VENV/bin:$PATH" uv python find --script "$1" --no-config --offline >/dev/null 2>&1
}

if ! installed; then
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
    "$VENV/bin/python" -m pip install -q "verifiers==$WANT" uv 2>&1 | grep -v "is ignored" || true
fi
"$VENV/bin/python" -c "import importlib.metadata as m, verifiers.v1; print('verifiers', m.version('verifiers'), 'in $VENV')"
SCRIPT=$(chat_program)
if [ -f "$SCRIPT.lock" ] && offline_ready "$SCRIPT"; then
    echo "verifiers' chat program already locked and synced: $SCRIPT"
    exit 0
fi
PATH="$VENV/bin:$PATH" uv lock --script "$SCRIPT" -q --no-config
PATH="$VENV/bin:$PATH" uv sync --script "$SCRIPT" -q --no-config
offline_ready "$SCRIPT" || { echo "verifiers' chat program does not sync offline: $SCRIPT" >&2; exit 1; }
echo "verifiers' chat program locked and synced (no network needed to run it): $SCRIPT"
