"""Run: the stages of a step put together, and the loop around them (embedded backend).

    step.py        one step, shared by every backend: tasks -> collect -> rows + advantages
    trainer.py     the embedded trainer: the loop of a step on one screen (Trainer.steps)
    collectors.py  where a step's rollouts come from: step, overlap, continuous collection
    continuous.py  continuous collection's groups, launched ahead within the staleness bound
    learner.py     the rows and the update of one policy or several (policies.py)
    weights.py     how the new weights reach the engine; held.py: the engine held meanwhile
    state.py       where the run is (step, version, history, ...): what a checkpoint keeps
    checkpoint.py  what a resumed run needs, saved atomically
    services.py    the store, engines, workers and gateway of a run, started and stopped
    rundir.py      the run directory's files, metric sinks and the step line
    memory.py      the step's peak resident memory
    failures.py    fail fast: steps whose every rollout failed stop the run, with the first error
    report.py      curves and a summary from a run's metrics
    evaluate.py    `tracetrain eval`: k tries per eval task, pass@k
"""
