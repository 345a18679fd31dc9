#!/usr/bin/env bash
# Install, lint, and run the whole test suite (slow tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,verl bash scripts/install.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
