"""TrainingBatch <-> verl DataProto (real verl 0.9.1): the round trip, verl's own padding helpers
reading our layout, and verl's own mini-batch split landing exactly on tracetrain's mini-batches."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from verl.protocol import BatchData
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
from verl_cpu import training_batch

from tracetrain.integrations.verl.dataproto import from_dataproto, to_dataproto, verl_layout
from tracetrain.integrations.verl.loss import TOKEN_WEIGHTS
from tracetrain.objective.minibatch import plan_step
from tracetrain.objective.weights import MODES

MODE_NAMES = sorted(MODES)


def norm(mode: str) -> float | None:
    return 7.0 if mode == "seq-mean-token-sum-norm" else None


def assert_same_batch(a, b) -> None:
    for key in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "response_mask",
        "rollout_logprobs",
        "turn_index",
        "rollout_index",
        "rewards",
        "model_version",
    ):
        x, y = getattr(a, key), getattr(b, key)
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), key
    for key in ("rollout_ids", "group_ids", "rollouts", "rollout_states"):
        assert getattr(a, key) == getattr(b, key), key


@settings(max_examples=25, deadline=None)
@given(
    rows_per_rollout=st.lists(st.integers(1, 3), min_size=1, max_size=7),
    seed=st.integers(0, 10_000),
    dp_size=st.integers(1, 3),
    rows_multiple=st.integers(1, 3),
    n_mini_batches=st.integers(1, 3),
    mode=st.sampled_from(MODE_NAMES),
)
def test_round_trip_keeps_rows_ids_masks_and_weights(
    rows_per_rollout, seed, dp_size, rows_multiple, n_mini_batches, mode
):
    batch, _, adv, ref = training_batch(rows_per_rollout, seed=seed)
    proto = to_dataproto(
        batch,
        adv,
        mode=mode,
        norm_length=norm(mode),
        n_mini_batches=n_mini_batches,
        dp_size=dp_size,
        rows_multiple=rows_multiple,
        ref_log_probs=ref,
    )
    n_mb = min(n_mini_batches, batch.n_rollouts)
    m = proto.meta_info["mini_batch_size"]
    assert len(proto) == n_mb * m and m % (dp_size * rows_multiple) == 0
    back, adv_back, weights = from_dataproto(proto)
    assert_same_batch(back, batch)
    assert torch.equal(adv_back, adv)
    # The weights are the mini-batches' own: each mean-mode mini-batch has mass 1.
    plan = plan_step(
        batch.response_mask,
        batch.rollout_index,
        n_mini_batches=n_mb,
        mode=mode,
        norm_length=norm(mode),
        row_tokens=batch.attention_mask.sum(1),
    )
    for mb in plan:
        expected = batch.response_mask[mb.rows].float() * mb.row_scales[:, None]
        assert torch.equal(weights[mb.rows], expected)
        if mode in ("rollout-mean", "token-mean", "seq-mean-token-mean") and expected.sum() > 0:
            assert float(weights[mb.rows].sum()) == pytest.approx(1.0, abs=1e-5)
    # Padding rows: nothing trained, no weight, one prompt token.
    pad = proto.batch["row_index"] < 0
    assert int(proto.batch["response_mask"][pad].sum()) == 0
    assert float(proto.batch[TOKEN_WEIGHTS][pad].abs().sum()) == 0.0
    assert torch.equal(
        proto.batch["attention_mask"][pad].sum(1), torch.ones(int(pad.sum()), dtype=torch.int64)
    )


def verl_mini_batches(proto, dp_size: int) -> list[list[int]]:
    """The TrainingBatch rows of each optimizer step as verl 0.9.1 forms them: the worker group's
    dispatch chunks the batch over the dp ranks, each rank's TrainingWorker iterates mini-batches
    of mini_batch_size / dp_size rows (tu.make_iterator, shuffle off); step k is all ranks' k-th."""
    td = left_right_2_no_padding(proto.to_tensordict())
    per_rank = proto.meta_info["mini_batch_size"] // dp_size
    steps: list[list[int]] = []
    for chunk in BatchData(td).chunk(dp_size):
        chunk = pickle.loads(pickle.dumps(chunk))  # what Ray hands the worker
        it = tu.make_iterator(
            chunk, mini_batch_size=per_rank, epochs=1, seed=0, dataloader_kwargs={"shuffle": False}
        )
        for k, mini in enumerate(it):
            if k == len(steps):
                steps.append([])
            steps[k] += [i for i in mini["row_index"].tolist() if i >= 0]
    return [sorted(s) for s in steps]


@settings(max_examples=15, deadline=None)
@given(
    rows_per_rollout=st.lists(st.integers(1, 4), min_size=2, max_size=8),
    seed=st.integers(0, 10_000),
    dp_size=st.integers(1, 3),
    n_mini_batches=st.integers(1, 3),
)
def test_verls_mini_batches_are_tracetrains(rows_per_rollout, seed, dp_size, n_mini_batches):
    batch, _, adv, _ = training_batch(rows_per_rollout, seed=seed)
    n_mb = min(n_mini_batches, batch.n_rollouts)
    proto = to_dataproto(batch, adv, n_mini_batches=n_mini_batches, dp_size=dp_size)
    plan = plan_step(
        batch.response_mask,
        batch.rollout_index,
        n_mini_batches=n_mb,
        row_tokens=batch.attention_mask.sum(1),
    )
    steps = verl_mini_batches(proto, dp_size)
    assert steps == [mb.rows.tolist() for mb in plan]
    # Whole rollouts: no rollout has rows in two optimizer steps.
    owner = {}
    for k, rows in enumerate(steps):
        for i in rows:
            assert owner.setdefault(batch.rollout_ids[i], k) == k


def test_verl_reads_our_layout():
    """verl's own left_right_2_no_padding / no_padding_2_padding (what its loss uses to cut the
    response out of the model output) give back exactly our response columns."""
    batch, _, adv, _ = training_batch([2, 1, 3], seed=4)
    proto = to_dataproto(batch, adv, dp_size=2, rows_multiple=2)
    td = left_right_2_no_padding(proto.to_tensordict())
    # Feed the (shifted) input ids through the path a per-token model output takes.
    ids = td["input_ids"]
    shifted = torch.nested.nested_tensor_from_jagged(torch.roll(ids.values(), -1), ids.offsets())
    cut = no_padding_2_padding(shifted, td)
    real = proto.batch["attention_mask"][:, batch.prompt_length :].bool()
    responses = proto.batch["responses"]
    assert torch.equal(cut[real], responses[real])
    assert torch.equal(td["loss_mask"], proto.batch["response_mask"])
    for key in (
        "input_ids",
        "attention_mask",
        "position_ids",
        "prompts",
        "responses",
        "response_mask",
        "old_log_probs",
        "rollout_log_probs",
        "advantages",
        TOKEN_WEIGHTS,
    ):
        assert key in proto.batch.keys(), key
    assert list(proto.non_tensor_batch["uid"][proto.batch["row_index"] >= 0]) == [
        batch.group_ids[i] for i in proto.batch["row_index"][proto.batch["row_index"] >= 0].tolist()
    ]


def test_layout_balances_ranks_and_pads_to_the_micro_batch_size():
    """Rows go to the rank with the fewest tokens so far, largest first; slots are padded (-1)
    to a multiple of rows_multiple; rank d's part holds its share of every mini-batch in order."""
    costs = torch.tensor([10, 1, 1, 1, 9, 2])
    layout = verl_layout(
        [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])], costs, dp_size=2, rows_multiple=2
    )
    assert layout.mini_batch_size == 4 and layout.n_mini_batches == 2
    # rank 0: mini-batch 0 = [0, pad], mini-batch 1 = [4, pad]; rank 1: [1, 2], [3, 5]
    assert layout.order.tolist() == [0, -1, 4, -1, 1, 2, 3, 5]
    three = verl_layout([torch.tensor([0, 1, 2])], costs, dp_size=1, rows_multiple=4)
    assert three.order.tolist() == [0, 1, 2, -1]


def test_bad_input_is_named():
    batch, _, adv, _ = training_batch([1, 2], seed=1)
    with pytest.raises(ValueError, match="advantages must have shape"):
        to_dataproto(batch, adv[:1])
    no_lp = training_batch([1, 2], seed=1)[0]
    no_lp.rollout_logprobs = None
    with pytest.raises(ValueError, match="old_log_probs"):
        to_dataproto(no_lp, adv)
    no_prompt = training_batch([1, 2], seed=1)[0]
    no_prompt.attention_mask[1, : no_prompt.prompt_length] = 0
    with pytest.raises(ValueError, match="row 1 has no prompt token"):
        to_dataproto(no_prompt, adv)
    with pytest.raises(ValueError, match="dp_size"):
        verl_layout([torch.tensor([0])], torch.tensor([1]), dp_size=0)
    proto = to_dataproto(batch, adv)
    proto.batch["row_index"][0] = proto.batch["row_index"][1]
    with pytest.raises(ValueError, match="row_index"):
        from_dataproto(proto)
