"""Agents: the tasks a run plays and the processes that play them (the path's first stage).

    dataset.py     a JSONL / Parquet / CSV file or a datasets folder -> tasks, split, epoch order
    tasks.py       the task module and agent a config names; the run's `data` section
    runner.py      rollout specs -> agents played through the gateway -> results (state, reward)
    runner_ray.py  the same on Ray workers
    workers.py     the same in worker processes (rollout.agent_workers)

Nothing here imports torch or the gateway's server: a Ray worker imports only this folder.
"""
