"""Learn: rows, advantages and weights in, optimizer updates out (the trainer is algorithm-blind).

    logprobs.py     the policy's per-token logprobs (the quantity engines record)
    packing.py      a micro-batch's rows as one prefix-tree sequence: shared starts computed once
    update.py       the step's updates: mini-batches, micro-batches, the loss, the optimizer
    optim.py        AdamW and the learning-rate schedule
    distributed.py  data parallel ranks on a gloo / nccl group
    warmstart.py    a warm start on the first rows
    sft.py          `tracetrain sft`: the NLL of the policy's own tokens from chosen traces
"""
