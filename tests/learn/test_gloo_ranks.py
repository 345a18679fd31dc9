"""The distributed tests' process helper: a rank that fails or hangs ends the run at once, every
rank is killed and reaped, and the failure says what each rank was doing."""

from __future__ import annotations

import os
import time

import pytest
from gloo_ranks import join_gloo, run_ranks

# No torch at the top: the ranks import this module, and the timing tests below must not wait
# for torch's import on a loaded machine.


def _all_reduce(rank: int, init_method: str) -> None:
    import torch
    import torch.distributed as dist

    join_gloo(init_method, rank, 2)
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    dist.destroy_process_group()


def _rank1_raises(rank: int, init_method: str, pid_dir: str) -> None:
    open(os.path.join(pid_dir, f"pid{rank}"), "w").write(str(os.getpid()))
    if rank == 1:
        while not os.path.exists(os.path.join(pid_dir, "pid0")):  # rank 0 is in its wait
            time.sleep(0.01)
        raise ValueError("rank 1 broke on purpose")
    time.sleep(600)  # rank 0 would wait for ever


def _rank0_sleeps_in_a_named_function(rank: int, init_method: str, pid_dir: str) -> None:
    open(os.path.join(pid_dir, f"pid{rank}"), "w").write(str(os.getpid()))
    if rank == 0:
        waiting_for_godot()


def waiting_for_godot() -> None:
    time.sleep(600)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def pids(tmp_path) -> list[int]:
    return [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]


def test_two_ranks_rendezvous_through_a_file_and_all_reduce(tmp_path):
    run_ranks(_all_reduce, (), 2, 120, tmp_path)
    assert "rank 1 done" in (tmp_path / "rank1.log").read_text()


def test_a_failing_rank_ends_the_run_at_once_with_its_traceback(tmp_path):
    t = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(_rank1_raises, (str(tmp_path),), 2, 300, tmp_path)
    assert time.monotonic() - t < 60  # not the deadline
    message = str(failure.value)
    assert "rank 1 exited with code 1" in message
    assert "ValueError: rank 1 broke on purpose" in message
    assert "_rank1_raises" in message.split("--- rank 0")[1]  # rank 0's stack: where it waited
    assert not any(alive(p) for p in pids(tmp_path))


def test_a_hanging_rank_is_reported_where_it_hangs_and_killed(tmp_path):
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(_rank0_sleeps_in_a_named_function, (str(tmp_path),), 2, 20, tmp_path)
    message = str(failure.value)
    assert "did not finish in 20 s" in message
    rank0 = message.split("--- rank 0")[1].split("--- rank 1")[0]
    assert "waiting_for_godot" in rank0
    assert "rank 1 done" in message.split("--- rank 1")[1]
    assert not any(alive(p) for p in pids(tmp_path))
