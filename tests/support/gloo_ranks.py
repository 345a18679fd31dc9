"""Run a worker on N spawned processes that form a gloo group (helpers for the distributed tests).

    run_ranks(worker, args, nprocs, deadline_s, workdir)   # worker(rank, init_method, *args)
    join_gloo(init_method, rank, world_size)               # inside the worker
    leave_gloo()                                           # inside, once its DDP wrappers are gone

The rendezvous cannot race: it is a `FileStore` in the test's own `workdir`, so no port is picked,
released and bound again later (gloo's own pair sockets bind port 0). Each rank writes its stdout,
stderr and, on request, the stacks of all its threads (faulthandler on SIGUSR1) to
`workdir/rank{r}.log`. When a rank fails or the run overruns its deadline, the live ranks dump
their stacks, every rank is killed and reaped, and the test fails with what each rank was doing.
"""

from __future__ import annotations

import faulthandler
import importlib
import multiprocessing as mp
import os
import signal
import sys
import time
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import pytest


def join_gloo(init_method: str, rank: int, world_size: int, timeout_s: float = 120.0) -> None:
    """Join the gloo group of `run_ranks` (a rank that waits longer than timeout_s raises)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def leave_gloo() -> None:
    """Leave the group: call it once the worker's DDP wrappers are out of scope (see
    tracetrain.learn.distributed.close: a wrapper freed after the group deadlocks on the GIL)."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _rank_main(worker: tuple[str, str], rank: int, init_method: str, log_path: str,
               args: tuple) -> None:
    log = open(log_path, "w", buffering=1)  # noqa: SIM115 (lives as long as the process)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    faulthandler.enable(file=log)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    module, name = worker
    print(f"rank {rank} (pid {os.getpid()}) imports {module}.{name}", flush=True)
    fn = getattr(importlib.import_module(module), name)  # after the handlers: a stack even here
    print(f"rank {rank} starts", flush=True)
    fn(rank, init_method, *args)
    print(f"rank {rank} done", flush=True)


def _tail(path: Path, chars: int = 4000) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text if len(text) <= chars else "..." + text[-chars:]


def run_ranks(worker, args: tuple, nprocs: int, deadline_s: float, workdir: Path) -> None:
    """Run `worker(rank, init_method, *args)` on nprocs spawned processes; fail the test (with each
    rank's log) if any rank fails or they are not all done within deadline_s."""
    workdir = Path(workdir)
    rendezvous = workdir / "gloo-rendezvous"
    if rendezvous.exists():
        rendezvous.unlink()
    init_method = f"file://{rendezvous}"
    ctx = mp.get_context("spawn")
    logs = [workdir / f"rank{r}.log" for r in range(nprocs)]
    procs = [
        ctx.Process(target=_rank_main,
                    args=((worker.__module__, worker.__name__), r, init_method, str(logs[r]), args),
                    name=f"gloo-rank{r}")
        for r in range(nprocs)
    ]
    deadline = time.monotonic() + deadline_s
    problem = None
    try:
        for p in procs:
            p.start()
        while problem is None:
            running = [p for p in procs if p.exitcode is None]
            failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                problem = "rank " + ", ".join(
                    f"{r} exited with code {procs[r].exitcode}" for r in failed)
            elif not running:
                return
            elif time.monotonic() > deadline:
                problem = f"the {nprocs}-process gloo run did not finish in {deadline_s} s"
            else:
                wait([p.sentinel for p in running], timeout=min(1.0, deadline - time.monotonic()))
        for p in procs:  # what the ranks still running are doing
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                p.kill()
            if p.pid is not None:
                p.join(30)
    states = "\n\n".join(
        f"--- rank {r} (exit code {p.exitcode}) {logs[r]}:\n{_tail(logs[r])}"
        for r, p in enumerate(procs))
    pytest.fail(f"{problem}\n{states}", pytrace=False)
