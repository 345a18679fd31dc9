"""Run one benchmark script on an earlier commit and on the working tree, alternating, in one run.

    .venv/bin/python bench/side_by_side.py REV [--rounds 2] -- bench/bench_aggregate.py --repeat 5

The earlier commit is checked out into a temporary git worktree; each round runs the script
(with the arguments after `--`) first on one tree, then on the other (the order alternates per
round, since the shared machine's speed drifts), with that tree's package first on PYTHONPATH and
the tree as working directory, and prints each run's output under a header naming its tree. Each
tree runs its own copy of the script (the working tree's where the earlier commit has none), so a
script that follows a renamed import still runs on both; compare only scripts whose measurement
did not change between the two.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the earlier commit (anything git rev-parse takes)")
    ap.add_argument("--rounds", type=int, default=2)
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("give the benchmark script after --")
    cut = argv.index("--")
    args, script = ap.parse_args(argv[:cut]), argv[cut + 1:]
    rev = subprocess.run(["git", "rev-parse", "--short", args.rev], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / f"tracetrain-{rev}"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(old), rev], cwd=ROOT,
                       check=True)
        try:
            trees = {f"{rev} (before)": old, "working tree": ROOT}
            for k in range(args.rounds):
                order = list(trees.items()) if k % 2 == 0 else list(trees.items())[::-1]
                for name, tree in order:
                    print(f"===== round {k + 1}: {name} =====", flush=True)
                    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                        [str(tree), str(tree / "tests"), os.environ.get("PYTHONPATH", "")])}
                    own = tree / script[0]
                    cmd = [sys.executable, str(own if own.exists() else ROOT / script[0]), *script[1:]]
                    subprocess.run(cmd, cwd=tree, env=env, check=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT)


if __name__ == "__main__":
    main()
