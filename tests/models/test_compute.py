"""Where torch runs the model (models/compute.py): the thread count is per OS thread, so the trainer
and the local engine set it in the thread that runs the model; the local engines' decoding and (with
`trainer.collect: step`) the trainer's updates share one compute thread, and the event loop's
thread runs at one torch thread while a trainer runs, so the process keeps one OpenMP team."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from tracetrain.engines.base import SamplingParams
from tracetrain.engines.local import LocalEngine
from tracetrain.models.compute import compute_thread, on_compute, one_thread_here, run_with_threads
from tracetrain.models.tiny import build_model, build_tokenizer

# The OpenMP runtime torch runs on (the CPU wheel bundles it). Its thread count is a per-thread
# setting: `torch.get_num_threads()` reads a process-wide value and can say 1 in a thread whose
# ops run on 2, so the tests ask OpenMP itself, in the thread that runs the model.
_GOMP = ctypes.CDLL(str(next((Path(torch.__file__).parent / "lib").glob("libgomp*.so*"))))


def omp_threads() -> int:
    """OpenMP's thread count as the calling thread sees it (what its torch ops will use)."""
    return _GOMP.omp_get_max_threads()


@pytest.fixture
def main_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(before)


def test_count_set_in_one_thread_does_not_reach_another(main_threads):
    """The premise: a count set in the main thread is not what an existing worker uses."""
    seen = {}
    ready, go = threading.Event(), threading.Event()

    def worker():
        torch.set_num_threads(1)
        ready.set()
        go.wait(10)
        seen["n"] = omp_threads()

    t = threading.Thread(target=worker)
    t.start()
    ready.wait(10)
    torch.set_num_threads(2)  # in the main thread, after the worker set its own
    go.set()
    t.join(10)
    assert omp_threads() == 2
    assert seen["n"] == 1
    assert torch.get_num_threads() == 2  # the process-wide value says nothing about the worker


@pytest.mark.parametrize("n", [1, 2, 3])
def test_run_with_threads_sets_the_count_in_the_worker(main_threads, n):
    async def main():
        inside = await asyncio.to_thread(run_with_threads, n, omp_threads)
        after = await asyncio.to_thread(omp_threads)  # the same pooled worker, restored
        return inside, after

    inside, after = asyncio.run(main())
    assert inside == n
    assert after == 2  # restored to what the worker had before (the process count)


def test_run_with_threads_zero_leaves_the_count(main_threads):
    assert run_with_threads(0, omp_threads) == 2


@pytest.mark.parametrize("n", [1, 3])
def test_local_engine_decodes_on_the_compute_thread_with_its_own_count(main_threads, n):
    tok = build_tokenizer()
    engine = LocalEngine(build_model(tok, seed=0), tok, threads=n)
    seen = []
    decode = engine._decode

    def recorded(reqs, join=False):
        seen.append((threading.get_ident(), omp_threads()))
        return decode(reqs, join)

    engine._decode = recorded
    engine.generate_batch([[5, 6, 7]], SamplingParams(max_tokens=2))

    async def served():  # through `generate`: the gatherer's batch
        await engine.generate([5, 6], SamplingParams(max_tokens=2))
        await engine.aclose()

    asyncio.run(served())
    compute = compute_thread().submit(threading.get_ident).result()
    assert seen == [(compute, n), (compute, n)]
    assert compute != threading.get_ident()
    assert omp_threads() == 2  # the caller's count is untouched


def test_on_compute_runs_inline_from_the_compute_thread(main_threads):
    """A call made on the compute thread (an engine built during an update) does not wait on
    itself."""
    def nested():
        return on_compute(3, lambda: (threading.get_ident(), omp_threads()))

    ident, n = compute_thread().submit(nested).result(timeout=10)
    assert ident == compute_thread().submit(threading.get_ident).result()
    assert n == 3


def test_one_thread_here_sets_and_restores(main_threads):
    with one_thread_here() as before:
        inside = omp_threads()
    assert (before, inside, omp_threads()) == (2, 1, 2)


@pytest.mark.parametrize("collect", ["step", "overlap"])
def test_trainer_runs_its_model_work_where_the_engine_decodes(main_threads, tmp_path, collect):
    """collect step: warm start, updates and the engine's decoding share the compute thread (with
    the count each asks for); overlap, which decodes while the update runs: an update thread."""
    from test_train_e2e import EXAMPLE, small_config

    from tracetrain.agents.tasks import load_task
    from tracetrain.run.trainer import Trainer

    extra = {"trainer.collect": collect} | ({"trainer.max_staleness": 1} if collect == "overlap" else {})
    trainer = Trainer(small_config(tmp_path, 1, **extra), load_task("task.py", EXAMPLE))

    def where():
        return threading.get_ident(), omp_threads()

    async def calls():
        return [await trainer.update_thread.run(n, where) for n in (1, 3, 1)]

    seen = asyncio.run(calls())
    compute = compute_thread().submit(threading.get_ident).result()
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert (seen[0][0] == compute) == (collect == "step")
    assert [n for _, n in seen] == [1, 3, 1]
    trainer.update_thread.close()


# In a fresh process: the OS threads the run adds that are not Python's are OpenMP's workers
# (tokenizers' own pool is off), one per thread of each team beyond its first. The tiny model's
# ops are too small to run in parallel, so each place the run computes also runs one op that does:
# the engine's decode, the update, and the rows the event loop's thread builds.
_TEAMS = textwrap.dedent("""
    import asyncio, json, os, sys, threading
    import torch
    sys.path.insert(0, {tests!r})
    from test_train_e2e import EXAMPLE, small_config
    from tracetrain.agents.tasks import load_task
    from tracetrain.engines.local import LocalEngine
    from tracetrain import cli
    from tracetrain.learn import sft
    from tracetrain.models import load
    from tracetrain.run import learner as lr
    from tracetrain.run import trainer as tr
    from tracetrain.run.evaluate import evaluate

    seen = []

    def parallel(fn):
        def run(*a, **kw):
            torch.ones(1 << 21).exp_()  # (2M elements: split over the thread's team)
            seen.append(workers())
            return fn(*a, **kw)
        return run

    LocalEngine._decode = parallel(LocalEngine._decode)
    lr.ppo_update, lr.build_rows = parallel(lr.ppo_update), parallel(lr.build_rows)
    load.load_policy, sft.fine_tune = parallel(load.load_policy), parallel(sft.fine_tune)

    def workers():
        python = {{t.native_id for t in threading.enumerate()}}
        return len([t for t in os.listdir("/proc/self/task") if int(t) not in python])

    torch.set_num_threads(2)
    base = workers()
    run = {run_dir!r}
    cfg = small_config(run, 1, **{{"engine.threads": 2, "trainer.eval_every": 0,
                                   "task": str(EXAMPLE / "task.py")}})
    task = load_task("task.py", EXAMPLE)
    tr.train(cfg)
    trained = len(seen)
    asyncio.run(evaluate(cfg, task, None, policy=run + "/policy", k=1, n_tasks=2))
    evaluated = len(seen)
    assert cli.main(["sft", run + "/config.json", "--from", run, "--min-reward", "0",
                     "--epochs", "1", "--out", run + "-sft"]) == 0
    print(json.dumps({{"base": base, "most": max(seen), "calls": [trained, evaluated, len(seen)]}}))
""")


@pytest.mark.slow
def test_train_eval_and_sft_keep_one_openmp_team(tmp_path):
    """A run with collect step, 2 threads: while the engine decodes, the update runs and the event
    loop's thread builds rows, the process has one OpenMP worker (two teams would make libgomp
    wake its workers through the kernel at every parallel region); and so it has while
    `tracetrain eval` loads a policy and decodes, and `tracetrain sft` loads and fine-tunes."""
    code = _TEAMS.format(tests=str(Path(__file__).resolve().parents[1]), run_dir=str(tmp_path / "run"))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    trained, evaluated, sft = seen["calls"]
    # train: loaded, decoded, updated, built rows; eval: loaded, decoded; sft: loaded, fine-tuned
    assert trained >= 4 and evaluated - trained >= 2 and sft - evaluated >= 2, seen
    assert seen["most"] - seen["base"] == 1, seen  # (threads some imports start: in base)
