"""Run a worker on N spawned processes that form a gloo group over loopback (helpers for the
distributed tests; `worker(rank, port, *args)`), failing the test if they overrun a deadline."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, args: tuple, nprocs: int, deadline_s: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    ctx = mp.start_processes(worker, args=(free_port(), *args), nprocs=nprocs, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs}-process gloo run did not finish in {deadline_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
