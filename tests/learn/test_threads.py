"""torch's intra-op thread count is per OS thread: the trainer and the local engine set it in the
threads that run the model, not only in the event loop's thread."""

from __future__ import annotations

import asyncio
import ctypes
import threading
from pathlib import Path

import pytest
import torch

from tracetrain.engines.local import LocalEngine
from tracetrain.learn.threads import run_with_threads
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
def test_local_engine_decodes_with_its_own_thread_count(main_threads, n):
    tok = build_tokenizer()
    engine = LocalEngine(build_model(tok, seed=0), tok, threads=n)
    assert engine._worker().submit(omp_threads).result() == n
    assert omp_threads() == 2  # the caller's count is untouched


def test_trainer_runs_all_model_work_on_one_update_thread(main_threads, tmp_path):
    """Warm start and updates share one OS thread, with the thread count each asks for."""
    from test_train_e2e import EXAMPLE, small_config

    from tracetrain.agents.tasks import load_task
    from tracetrain.run.trainer import Trainer

    trainer = Trainer(small_config(tmp_path, 1), load_task("task.py", EXAMPLE))

    def where():
        return threading.get_ident(), omp_threads()

    async def calls():
        return [await trainer.on_update_thread(n, where) for n in (1, 3, 1)]

    seen = asyncio.run(calls())
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert [n for _, n in seen] == [1, 3, 1]
    trainer.update_executor.shutdown()
