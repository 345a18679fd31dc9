"""Emulate host CPU steal inside the VM, to run a benchmark beside it. Two stand-ins:

  cpu mode (default): on each CPU, a SCHED_FIFO task (root) takes the CPU for `burst_ms` every
  ~`period_ms` (random gaps), freezing what ran there.
  freeze mode (--freeze-pid PID): the process PID and its descendants are stopped (SIGSTOP) for
  `burst_ms` every ~`period_ms`, then continued (SIGCONT).
  vcpu mode (--freeze-pid PID --vcpu): per CPU, every ~`period_ms` one thread of that process tree
  that is running at that moment (state R) is stopped alone (ptrace: seize, interrupt, detach)
  for `burst_ms`; the other threads run on, as when the host takes the vCPU a thread runs on --
  a thread holding a lock (the GIL) stops holding it.

    python3 bench/emulate_steal.py --seconds 170 &      # both CPUs, 4 ms of every ~25 ms (~16%)
    .venv/bin/python bench/bench_train_step.py --repeats 12

    .venv/bin/python bench/bench_train_step.py --repeats 12 & \
        python3 bench/emulate_steal.py --freeze-pid $! --seconds 600

Neither is a hypervisor's steal. In cpu mode the guest scheduler sees the task and may move a
frozen thread to the other CPU, which it cannot do when the host takes the vCPU away. Freeze mode
is what the frozen program sees of it: its threads stop at any instruction and the clock runs on,
so a timer (a batching window, a timeout) expires while the work it waits for is stopped half
done; it freezes every thread at once, where a host takes one vCPU at a time (vcpu mode does that).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import random
import signal
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


def descendants(root: int) -> list[int]:
    """root and every process below it (from /proc's parent ids)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def freeze(root: int, burst_s: float, period_s: float, seconds: float) -> None:
    rng = random.Random(0)
    start = time.monotonic()
    end, frozen = start + seconds, 0.0
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.5, 1.5) * (period_s - burst_s))
        pids = descendants(root)
        t = time.monotonic()
        try:
            for p in pids:
                os.kill(p, signal.SIGSTOP)
            time.sleep(burst_s)
        except ProcessLookupError:
            pass
        finally:
            for p in pids:
                try:
                    os.kill(p, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        frozen += time.monotonic() - t
        try:
            os.kill(root, 0)
        except ProcessLookupError:
            break
    span = time.monotonic() - start
    print(f"pid {root}: frozen {frozen / span:.1%} of {span:.0f} s", flush=True)


PTRACE_DETACH, PTRACE_SEIZE, PTRACE_INTERRUPT, WALL = 17, 0x4206, 0x4207, 0x40000000


def running_threads(root: int) -> list[int]:
    """Thread ids in state R (running or runnable) of root's process tree."""
    out = []
    for pid in descendants(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "R":
                        out.append(int(tid))
            except (OSError, IndexError):
                pass
    return out


def freeze_threads(cpu: int, root: int, burst_s: float, period_s: float, seconds: float) -> None:
    """One stand-in vCPU: every ~period_s stop one running thread of root's tree for burst_s."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
    rng = random.Random(cpu)
    start = time.monotonic()
    end, frozen, n = start + seconds, 0.0, 0
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.5, 1.5) * (period_s - burst_s))
        try:
            os.kill(root, 0)
        except ProcessLookupError:
            break
        tids = running_threads(root)
        if not tids:
            continue
        tid = rng.choice(tids)
        t = time.monotonic()
        if libc.ptrace(PTRACE_SEIZE, tid, None, None) != 0:
            continue  # gone, or the other stand-in vCPU holds it
        try:
            if libc.ptrace(PTRACE_INTERRUPT, tid, None, None) == 0:
                os.waitpid(tid, WALL)
                time.sleep(burst_s)
                frozen += time.monotonic() - t
                n += 1
        except ChildProcessError:
            pass
        finally:
            libc.ptrace(PTRACE_DETACH, tid, None, None)
    span = time.monotonic() - start
    print(f"vcpu {cpu}: {n} threads stopped, {frozen / span:.1%} of {span:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--burst-ms", type=float, default=4.0)
    p.add_argument("--period-ms", type=float, default=25.0)
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--cpus", type=int, nargs="*", default=sorted(os.sched_getaffinity(0)))
    p.add_argument("--freeze-pid", type=int, default=None,
                   help="freeze mode: stop this process and its descendants in bursts")
    p.add_argument("--vcpu", action="store_true",
                   help="with --freeze-pid: stop one running thread at a time per CPU (ptrace)")
    a = p.parse_args()
    if a.freeze_pid is not None and a.vcpu:
        procs = [mp.Process(target=freeze_threads, args=(c, a.freeze_pid, a.burst_ms / 1e3,
                                                         a.period_ms / 1e3, a.seconds))
                 for c in a.cpus]
        for pr in procs:
            pr.start()
        for pr in procs:
            pr.join()
        return
    if a.freeze_pid is not None:
        freeze(a.freeze_pid, a.burst_ms / 1e3, a.period_ms / 1e3, a.seconds)
        return
    procs = [mp.Process(target=take, args=(c, a.burst_ms / 1e3, a.period_ms / 1e3, a.seconds))
             for c in a.cpus]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()


if __name__ == "__main__":
    main()
