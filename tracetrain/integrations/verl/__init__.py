"""tracetrain on verl (`pip install tracetrain[verl]`, verl 0.9.x): the same rows and the same loss.

    config.py     the verl config built from a tracetrain config and its `verl:` section
                  (no verl import at module level)
    loss.py       the verl policy loss `rollout-mean` (one name per tracetrain mode) and a full
                  verl loss function; how verl's loss scaling is used or neutralised.
                  Importing it registers the losses with verl.
    dataproto.py  TrainingBatch + advantages <-> DataProto, laid out so verl's mini-batches are ours
    trainer.py    `tracetrain train --backend verl`: verl's workers and rollout servers, the
                  tracetrain gateway and runner as the rollout source

This package imports nothing itself, so that the `verl:` config section works without verl.
"""
