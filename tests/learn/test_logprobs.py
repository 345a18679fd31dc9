"""response_logprobs: the logprob of each response token under the model, for left-padded rows,
whether or not the model can skip the logits of the prompt positions (logits_to_keep)."""

from __future__ import annotations

import pytest
import torch

from tracetrain.learn.logprobs import response_logprobs, takes_logits_to_keep
from tracetrain.models.tiny import build_model, build_tokenizer


class AllLogits(torch.nn.Module):
    """A causal LM whose forward has no logits_to_keep: it always returns every position's logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


class Spy(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.kwargs = inner, []

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        self.kwargs.append(logits_to_keep)
        return self.inner(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, logits_to_keep=logits_to_keep)


@pytest.fixture(scope="module")
def model():
    return build_model(build_tokenizer(), seed=0).eval()


def left_padded(rows: list[list[int]], pad: int = 0):
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def unpadded_logprobs(model, row: list[int], R: int, temperature: float) -> torch.Tensor:
    """Independent: one forward over the row alone, log_softmax of every logit."""
    with torch.no_grad():
        logits = model(torch.tensor([row])).logits[0].float() / temperature
    lp = torch.log_softmax(logits[-R - 1 : -1], -1)
    return lp.gather(-1, torch.tensor(row[-R:])[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("R", [1, 5])
def test_with_and_without_logits_to_keep_equal_the_unpadded_forward(model, temperature, R):
    g = torch.Generator().manual_seed(R)
    rows = [torch.randint(5, 300, (n,), generator=g).tolist() for n in (R + 3, R + 9, R + 1)]
    ids, mask, pos = left_padded(rows)
    spy = Spy(model)
    for m in (spy, AllLogits(model)):
        with torch.no_grad():
            lp, _ = response_logprobs(m, ids, mask, pos, R, temperature=temperature)
        assert lp.shape == (3, R)
        for i, row in enumerate(rows):
            torch.testing.assert_close(lp[i], unpadded_logprobs(model, row, R, temperature),
                                       atol=1e-5, rtol=0)
    assert spy.kwargs == [R + 1]  # the keep path really asked for the last R + 1 positions only


def test_takes_logits_to_keep_reads_the_forward_signature(model):
    assert takes_logits_to_keep(type(model))
    assert takes_logits_to_keep(Spy)
    assert not takes_logits_to_keep(AllLogits)
