"""Emulate host CPU steal inside the VM, to run a benchmark beside it: on each CPU, a SCHED_FIFO
task (root) takes the CPU for `burst_ms` every ~`period_ms` (random gaps), freezing what ran there.

    python3 bench/emulate_steal.py --seconds 170 &      # both CPUs, 4 ms of every ~25 ms (~16%)
    .venv/bin/python bench/bench_train_step.py --repeats 12

Not the same as a hypervisor's steal: the guest scheduler sees this task and may move a frozen
thread to the other CPU, which it cannot do when the host takes the vCPU away.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import time


def take(cpu: int, burst_s: float, period_s: float, seconds: float) -> None:
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    rng = random.Random(cpu)
    end, busy = time.monotonic() + seconds, 0.0
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.5, 1.5) * (period_s - burst_s))
        t = time.monotonic()
        while time.monotonic() - t < burst_s:
            pass
        busy += time.monotonic() - t
    print(f"cpu {cpu}: took {busy / seconds:.1%} of the CPU", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst-ms", type=float, default=4.0)
    p.add_argument("--period-ms", type=float, default=25.0)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cpus", type=int, nargs="*", default=sorted(os.sched_getaffinity(0)))
    a = p.parse_args()
    procs = [mp.Process(target=take, args=(c, a.burst_ms / 1e3, a.period_ms / 1e3, a.seconds))
             for c in a.cpus]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()


if __name__ == "__main__":
    main()
