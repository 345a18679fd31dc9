"""Tasks from a large file: how long a 1,000,000-row JSONL takes to open (index + the field check
of every row) and to deal a step's tasks, and what the process holds for it.

    .venv/bin/python bench/bench_dataset.py                 # 1,000,000 rows
    .venv/bin/python bench/bench_dataset.py --rows 5000000

The file (calculator-like rows: a question, an answer, a few numbers; ~80 bytes each) is written
to a temporary folder first. Memory: the resident set before opening and its peak after (VmHWM,
reset before opening: tracetrain.run.memory), against the file's size.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def main() -> None:
    from tracetrain.agents.dataset import TaskData, open_rows
    from tracetrain.run.memory import peak_rss_gb, reset_peak

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        path = Path(tmp) / "tasks.jsonl"
        with path.open("w") as f:
            for i in range(args.rows):
                a, b = rng.randint(2, 999), rng.randint(2, 999)
                f.write(json.dumps({"id": i, "question": f"What is {a} * {b}?", "answer": a * b,
                                    "max_turns": 3}) + "\n")
        size = path.stat().st_size
        reset_peak()
        before = peak_rss_gb()
        t = time.perf_counter()
        rows = open_rows(path)
        t_index = time.perf_counter() - t
        t = time.perf_counter()
        data = TaskData(rows, eval_fraction=0.01, seed=0, fields=["question", "answer"])
        t_check = time.perf_counter() - t
        t = time.perf_counter()
        for step in range(100):
            data.train_tasks(step, 64)
        t_steps = (time.perf_counter() - t) / 100
        peak = peak_rss_gb()
    print(f"{args.rows:,} rows, {size / 1e6:.0f} MB JSONL")
    print(f"open (index the lines): {t_index:.2f} s; split + epoch order + field check of every row: "
          f"{t_check:.2f} s; ready to train after {t_index + t_check:.2f} s")
    print(f"a step's 64 tasks: {t_steps * 1e3:.2f} ms")
    print(f"resident set: {before:.3f} GB before, peak {peak:.3f} GB after (+{(peak - before) * 1e3:.0f} MB "
          f"for a {size / 1e6:.0f} MB file)")


if __name__ == "__main__":
    main()
