"""A two-agent `verifiers.v1` environment (verifiers 0.4): a `solver` answers the task, then a
`checker` reviews the answer; the task's reward scores the solver's trace. The module exports its
Taskset and its Env (`__all__`): the env of this taskset is the two-agent one. The checker models
the world, so it does not train (`setup`); in tracetrain each agent is a role (`roles.train`)."""

import verifiers.v1 as vf
from vf_v1_digits import DigitsData, DigitsTask


class DuoConfig(vf.TasksetConfig):
    num_tasks: int = 8


class DuoTaskset(vf.Taskset[DigitsTask, DuoConfig]):
    def load(self):
        return [DigitsTask(DigitsData(prompt=f"What is {i} plus {i + 2}?", answer=str(2 * i + 2)),
                           self.config.task) for i in range(self.config.num_tasks)]


class DuoEnvConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})
    checker: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"})


class DuoEnv(vf.Env[DuoEnvConfig]):
    async def setup(self, agents):
        agents.checker.trainable = False

    async def run(self, task, agents):
        answer = await agents.solver.run(task)
        review = vf.Task(vf.TaskData(prompt=f"Is '{answer.last_reply}' right? Say yes or no."))
        await agents.checker.run(review)

    async def finalize(self, task, episode):
        solver, checker = episode.by_agent["solver"][0], episode.by_agent["checker"][0]
        solver.record_metric("checker_yes", float("yes" in checker.last_reply.lower()))


__all__ = ["DuoTaskset", "DuoEnv"]
