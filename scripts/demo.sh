#!/usr/bin/env bash
# Install and run the main job, in runs/guess (runs/guess-2, -3, ... when that one holds a run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
dir=runs/guess
for k in $(seq 2 1000); do
  [ -e "$dir/metrics.jsonl" ] || [ -e "$dir/checkpoint.pt" ] || [ -e "$dir/traces.db" ] || break
  dir=runs/guess-$k
done
echo "run directory: $dir"
.venv/bin/tracetrain train examples/guess/config.yaml "trainer.run_dir=$dir" "$@"
