#!/usr/bin/env bash
# The GPU paths run for real on a CUDA machine, in under 8 minutes: the embedded trainer with the
# local engine, then with a vLLM server (where a CUDA vLLM is found), then one verl step (where
# verl imports). Prints a table: part | status | figures | seconds. Without CUDA it says what it
# would run and exits 0. Options and environment: scripts/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python scripts/gpu_check.py "$@"
