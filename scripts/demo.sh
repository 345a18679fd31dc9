#!/usr/bin/env bash
# Install and run the main job.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
.venv/bin/tracetrain train examples/guess/config.yaml "$@"
