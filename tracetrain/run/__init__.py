"""Run: the stages of a step put together, and the loop around them (embedded backend).

    step.py        one step, shared by every backend: tasks -> collect -> rows + advantages
    held.py        the engine held while its weights change (drain, sync, resume)
    continuous.py  continuous collection: groups launched ahead within the staleness bound
    trainer.py     the embedded trainer: steps, overlap, weight sync, checkpoints
    checkpoint.py  what a resumed run needs, saved atomically
    rundir.py      the run directory's files, metric sinks and the step line
    memory.py      the step's peak resident memory
    report.py      curves and a summary from a run's metrics
    evaluate.py    `tracetrain eval`: k tries per eval task, pass@k
"""
