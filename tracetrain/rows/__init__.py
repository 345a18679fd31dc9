"""Rows: a step's rollouts, as the store holds them, -> training rows (pure functions).

    batch.py      TrainingBatch: the rows as tensors
    roles.py      which roles train; a rollout's turns per role
    drift.py      why a trajectory's prefix broke, and what it cost
    plan.py       each row's turns, per role (plan_rollouts)
    aggregate.py  rollouts -> rows: plan, fill, positions and attention
    context.py    counts over a step's turns' context (exact or rendered, and why)
    demo.py       `tracetrain rows`: rows from the example traces
"""
