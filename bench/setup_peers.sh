#!/usr/bin/env bash
# A separate environment with the peers we measure against (Agent Lightning, verl, TRL), for bench/.
# Agent Lightning 1.0.2 declares Python >= 3.12; on 3.11 it is installed without its dependency
# resolution next to verl and tensordict, which its modules need and which run here.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEERS_VENV:-bench/.venv-peers}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip install -q"
$PIP "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" "verl>=0.9,<0.10" "tensordict<=0.10.0" "transformers<5.11" 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" --no-deps --ignore-requires-python "agentlightning==1.0.2" 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" "trl" "openai" "fastapi" "uvicorn" "httpx" "aiohttp" "agentops" "opentelemetry-sdk" "opentelemetry-exporter-otlp" "flask" "gunicorn" "psutil" "setproctitle" "graphviz" "httpx-retries" "structlog" "litellm[proxy]" 2>&1 | grep -v "is ignored" || true
$PIP "torch==2.13.0" -e . 2>&1 | grep -v "is ignored" || true
"$VENV/bin/python" -c "import agentlightning, verl, tensordict; print('peers ok: agentlightning', agentlightning.__version__ if hasattr(agentlightning,'__version__') else '?', 'verl', verl.__version__)"
