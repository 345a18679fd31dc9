"""The objective: rows -> advantages, token weights, the loss (pure functions, plain torch).

    advantage.py   one reward per rollout -> one advantage per rollout, by group (estimators by name)
    credit.py      the advantage each turn's tokens carry (per rollout or per turn)
    weights.py     token weights from the aggregation mode: every rollout weighs the same
    loss.py        PPO surrogate, KL, entropy over weighted tokens
    loss_cpu.py    the loss's CPU fast paths, each checked against the plain one
    minibatch.py   rows -> mini-batches of whole rollouts, micro-batches by tokens
    correction.py  engine vs trainer logprobs -> importance weights, masks, rejected rollouts
"""
