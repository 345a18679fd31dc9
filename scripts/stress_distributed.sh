#!/usr/bin/env bash
# The multi-process tests (gloo ranks, torchrun DDP, verl's 2-rank actor) N times in a row, each
# iteration a fresh pytest; with --loaded, the whole test suite runs beside them as load (what
# made them hang before). Not part of CI: it takes about N x 2 minutes.
#
#   bash scripts/stress_distributed.sh            # 30 iterations
#   bash scripts/stress_distributed.sh 10 --loaded
#
# Logs: $OUT (default runs/stress-<time>/): iterN.log per iteration, load.log for the suite.
# Exit status 0 only if every iteration passed (and the load suite, when asked for, passed).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-30}
LOADED=${2:-}
OUT=${OUT:-runs/stress-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
PY=.venv/bin/python
TESTS=(
    tests/learn/test_distributed.py
    tests/run/test_ddp_trainer.py
    "tests/integrations/test_verl_loss.py::test_two_data_parallel_ranks_give_the_single_process_gradient"
)
load_pid=""
if [ "$LOADED" = "--loaded" ]; then
    "$PY" -m pytest -q -p no:cacheprovider --basetemp "$OUT/load-tmp" > "$OUT/load.log" 2>&1 &
    load_pid=$!
    echo "load: the whole suite (pid $load_pid), log $OUT/load.log"
fi
failed=0
start=$(date +%s)
for i in $(seq 1 "$N"); do
    t=$(date +%s)
    if "$PY" -m pytest -q -p no:cacheprovider --basetemp "$OUT/iter-tmp" "${TESTS[@]}" \
        > "$OUT/iter$i.log" 2>&1; then
        status=passed
    else
        status=FAILED
        failed=$((failed + 1))
    fi
    load_state=""
    if [ -n "$load_pid" ]; then
        if kill -0 "$load_pid" 2>/dev/null; then load_state=" (suite running beside)"; else load_state=" (suite done)"; fi
    fi
    echo "iteration $i/$N: $status in $(( $(date +%s) - t )) s$load_state: $(tail -n 1 "$OUT/iter$i.log")"
done
echo "$((N - failed)) passed, $failed failed iterations in $(( $(date +%s) - start )) s"
if [ -n "$load_pid" ]; then
    if wait "$load_pid"; then echo "load suite: $(tail -n 1 "$OUT/load.log")"; else
        echo "load suite FAILED: $(tail -n 1 "$OUT/load.log")"; failed=$((failed + 1)); fi
fi
[ "$failed" -eq 0 ]
