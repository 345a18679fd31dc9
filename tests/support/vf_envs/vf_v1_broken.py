"""A `verifiers.v1` taskset whose tasks break as their name says: `ok` is scored, `raise` raises in
its reward, `hang` blocks its worker's event loop (a blocking call in the reward: only killing
the worker ends it)."""

import time

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def scored(self, trace: vf.Trace) -> float:
        if self.data.name == "hang":
            time.sleep(600)
        if self.data.name == "raise":
            raise ValueError("the v1 reward broke")
        return 1.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        return [BrokenTask(vf.TaskData(prompt=f"Question {name}?", name=name), self.config.task)
                for name in ("ok", "raise", "hang")]


__all__ = ["BrokenTaskset"]
