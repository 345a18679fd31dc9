"""`TrainingBatch`: the rows that the aggregate stage hands to advantage, loss and trainer.

Letters of every shape in the package: rows (B in docs/objective.md), P prompt positions, S response
positions, V the vocabulary; R counts rollouts, never a width.

Layout of row i (P = prompt width, S = response width, both the batch maxima unless padded to limits):

    input_ids[i]      = [pad ... pad | prompt ids ]  [ response-region ids | pad ... pad ]
                        '---------- P (left pad) ---'  '---------- S (right pad) --------'
    attention_mask[i] = 1 on real tokens, 0 on padding
    position_ids[i]   = 0, 1, 2, ... over real tokens (0 on left padding)
    response_mask[i]  = over the S response columns: True on tokens the policy produced and we train,
                        False on observation tokens merged into the row and on padding.

The response region of a trajectory-level row is response_1, observation_2, response_2, ...; of a
transition-level row it is one turn's response. Rows of one rollout are adjacent, in turn order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TrainingBatch:
    input_ids: torch.Tensor  # [rows, P+S] int64
    attention_mask: torch.Tensor  # [rows, P+S] int64
    position_ids: torch.Tensor  # [rows, P+S] int64
    response_mask: torch.Tensor  # [rows, S] bool
    # [rows, S] float32, 0 where mask is False; None if any turn lacks them
    rollout_logprobs: torch.Tensor | None
    rollout_ids: list[str]  # [rows] the rollout each row belongs to
    group_ids: list[str]  # [rows] the group of that rollout
    turn_index: torch.Tensor  # [rows] int64, the first turn of the row within its rollout
    rollout_index: torch.Tensor  # [rows] int64, index of the row's rollout in `rollouts` (non-decreasing)
    rollouts: list[str]  # [n_rollouts] rollout ids in batch order
    rewards: torch.Tensor  # [n_rollouts] float32, NaN where the rollout has no reward
    rollout_states: list[str] = field(default_factory=list)  # [n_rollouts] RolloutState values
    model_version: torch.Tensor | None = None  # [rows] int64, oldest model_version in the row; -1 if unknown
    # [rows] each row's trained turns: (turn index in its rollout, first column in the response
    # block, response tokens there); None when unknown (a batch not built by aggregate)
    turn_spans: list[list[tuple[int, int, int]]] | None = None

    @property
    def n_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def n_rollouts(self) -> int:
        return len(self.rollouts)

    @property
    def prompt_length(self) -> int:
        """P: width of the left-padded prompt block."""
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_length(self) -> int:
        """S: width of the right-padded response block."""
        return self.response_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        """[rows, S] the response-region ids (a view)."""
        return self.input_ids[:, self.prompt_length :]

    def select_rows(self, index: torch.Tensor) -> TrainingBatch:
        """Rows `index` (int64, in order); rollouts keep batch order and are re-indexed from 0."""
        index = index.to(torch.long)
        old_ro = self.rollout_index[index]
        kept, new_ro = torch.unique_consecutive(old_ro, return_inverse=True)
        if kept.numel() != torch.unique(old_ro).numel():
            raise ValueError("select_rows: the rows of one rollout must stay adjacent")
        kept_list = kept.tolist()
        idx = index.tolist()
        return TrainingBatch(
            input_ids=self.input_ids[index],
            attention_mask=self.attention_mask[index],
            position_ids=self.position_ids[index],
            response_mask=self.response_mask[index],
            rollout_logprobs=None if self.rollout_logprobs is None else self.rollout_logprobs[index],
            rollout_ids=[self.rollout_ids[i] for i in idx],
            group_ids=[self.group_ids[i] for i in idx],
            turn_index=self.turn_index[index],
            rollout_index=new_ro,
            rollouts=[self.rollouts[k] for k in kept_list],
            rewards=self.rewards[kept],
            rollout_states=[self.rollout_states[k] for k in kept_list] if self.rollout_states else [],
            model_version=None if self.model_version is None else self.model_version[index],
            turn_spans=None if self.turn_spans is None else [self.turn_spans[i] for i in idx],
        )
