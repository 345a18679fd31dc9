"""The guess task, with a step whose agents find the run's vLLM server dead: at step `kill_step`
(the step's tasks are drawn with seed == step when trainer.seed is 0) the first agent kills the
server (SIGKILL, found by its command line naming the run dir), then every agent plays on."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

from tracetrain.agents.tasks import load_task

GUESS = load_task("task.py", Path(__file__).resolve().parents[2] / "examples" / "guess")
warm_start_transcripts = GUESS.warm_start_transcripts
_killing: set[str] = set()
_killed: set[str] = set()


def tasks(n: int, *, seed: int, kill_step: int, run_dir: str, **kw: Any) -> list[dict]:
    return [{**t, "kill": seed == kill_step, "run_dir": run_dir} for t in GUESS.tasks(n, seed=seed, **kw)]


def server_pids(run_dir: str) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if d.isdigit() and "vllm.entrypoints.openai.api_server" in cmd and run_dir in cmd:
            pids.append(int(d))
    return pids


async def agent(task: dict, client: dict) -> float:
    run_dir = task["run_dir"]
    if task["kill"]:  # the first agent of the step kills, the others wait until it is dead
        if run_dir not in _killing:
            _killing.add(run_dir)
            for pid in server_pids(run_dir):
                os.killpg(pid, signal.SIGKILL)  # the server leads its own process group
            while server_pids(run_dir):
                await asyncio.sleep(0.05)
            _killed.add(run_dir)
        while run_dir not in _killed:
            await asyncio.sleep(0.05)
    return await GUESS.agent(task, client)
