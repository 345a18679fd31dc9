"""Per-token log-probabilities (and entropy) of the response columns of rows under a causal LM.

For row i and response column t (absolute position P + t), with logits z = model(...)[i, P+t-1] / T:
    logprob[i, t] = z[y] - logsumexp(z)          y = input_ids[i, P + t]
    entropy[i, t] = logsumexp(z) - sum_v softmax(z)_v * z_v
T is the sampling temperature, so these are the same quantities the local engine records.

precision "bf16-mixed" runs the model under torch.autocast(bfloat16): matmuls in bf16 (AMX /
tensor cores), weights, gradients and everything from the logits on in fp32. Whether that is
faster depends on the CPU (it is on some with AVX-512 BF16 and slower on others): "auto" is
resolved to whichever of the two `faster_precision` measures faster on the model itself.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time

import torch

PRECISIONS = ("fp32", "bf16-mixed")


def autocast(precision: str, device: torch.device | str = "cpu"):
    """The context of a training forward pass under `precision` (see the module docstring)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@functools.cache
def takes_logits_to_keep(model_class: type) -> bool:
    """Whether the model's forward computes logits for the last k positions only."""
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    precision: str = "fp32",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (logprobs [rows, S], entropy [rows, S] or None); S = response_length."""
    S = response_length
    # Only the last S + 1 positions' logits are needed (transformers' causal LMs skip the rest).
    keep = {"logits_to_keep": S + 1} if takes_logits_to_keep(type(getattr(model, "module", model))) else {}
    with autocast(precision, input_ids.device):
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    **keep)
    # The logit at position j predicts token j+1: the response columns are predicted by [-S-1, -1).
    return logprobs_from_logits(out.logits[:, -S - 1 : -1, :].float(), input_ids[:, -S:],
                                temperature, with_entropy)


def logprobs_from_logits(
    logits: torch.Tensor, target: torch.Tensor, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [..., V] (fp32), target [...] -> (logprob [...], entropy [...] or None), with
    z = logits / T (the formulas of the module docstring)."""
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    logprobs = logits.gather(-1, target.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if with_entropy:
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logprobs, entropy


def faster_precision(
    model: torch.nn.Module, *, tokens: int = 256, repeats: int = 2, margin: float = 0.1
) -> tuple[str, dict[str, float]]:
    """The precision of the faster training pass on this machine, measured: forward (as
    response_logprobs, a quarter of the row as response) and backward of `model` on one row of
    `tokens` random ids, one warm-up then `repeats` timed passes per precision, alternating so
    that the machine's drift hits both. "bf16-mixed" when its best time is at least `margin`
    below fp32's, else "fp32". Returns (choice, {precision: best seconds}). Weights, gradients,
    the RNG state and the train/eval mode are left as they were."""
    device = next(model.parameters()).device
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 256)
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0)).to(device)
    mask, positions = torch.ones_like(ids), torch.arange(tokens, device=device).unsqueeze(0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    best = {p: float("inf") for p in PRECISIONS}
    try:
        with torch.random.fork_rng(devices=[]):  # dropout must not move the run's random stream
            for k in range(1 + repeats):
                for precision in PRECISIONS if k % 2 == 0 else PRECISIONS[::-1]:
                    t = time.perf_counter()
                    logprobs, _ = response_logprobs(model, ids, mask, positions, tokens // 4,
                                                    precision=precision)
                    logprobs.mean().backward()
                    if k:  # the first pass of each builds kernels and caches
                        best[precision] = min(best[precision], time.perf_counter() - t)
                    for p in params:
                        p.grad = None
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
    choice = "bf16-mixed" if best["bf16-mixed"] <= (1 - margin) * best["fp32"] else "fp32"
    return choice, best
