"""The local engine's decode step: temperature, the top-p nucleus, a seeded draw, the logprob kept.

For a batch row b with next-token logits l_b, temperature T_b and top_p P_b:

    T'_b = T_b (1 where T_b == 0)      z_b = l_b / T'_b      p_b = softmax(z_b)
    T_b == 0:   y_b = argmax z_b                                (top_p plays no part)
    P_b == 1:   y_b ~ p_b                                       (inverse CDF in vocabulary order)
    P_b < 1:    y_b ~ q_b,  q_b(v) = p_b(v) / S_b on the nucleus N_b, 0 elsewhere
                N_b = the most likely tokens v (sorted by p_b, ties in vocabulary order) whose
                      mass before v, sum of p_b over the tokens sorted ahead of v, is < P_b
                      (the most likely token always stays; in exact arithmetic the set
                      vLLM's apply_top_k_top_p keeps)
                S_b = sum of p_b over N_b  (>= P_b)
    recorded:   logp_b = log_softmax(z_b)[y_b] = log p_b(y_b)

The draw is an inverse CDF (float64) at u_b = uniform(seed_b, step): a seeded request gives the
same ids whatever else is in its batch (up to float ties), and a row with P_b == 1 takes exactly
the path it took before top_p existed, whichever top_p the other rows have.

The recorded logprob is the full temperature-scaled one, before top-p: the quantity the trainer
computes (tracetrain/learn/logprobs.py, log_softmax(logits / T)), so on-policy the PPO ratio is 1
token by token and a correction with equal logprobs is the identity (docs/invariants.md, 9). The
bias this implies when P < 1: the tokens come from q, the update differentiates log p. As
log p(y) = log q(y) + log S, the update's expected gradient E_q[A sum_t grad log p_t(y_t)] is the
truncated policy's own, grad E_q[A] (nuclei held fixed), plus E_q[A sum_t grad log S_t]; read as
an estimate for the full policy p, it leaves out the importance weight prod_t S_t. Tokens outside
a nucleus are never sampled and move only through p's normalisation. With P == 1, S == 1 and
nothing is biased.

vLLM records the other kind: `processed_logprobs` (what tracetrain starts it with) is the
log_softmax after its top-p mask, log q(y) = log p(y) - log S, so against the trainer's log p its
PPO ratio starts at S <= 1 (vllm/v1/sample/ops/topk_topp_sampler.py, vLLM 0.32; TRL issue 6789);
`raw_logprobs` is log_softmax(l), before temperature. No mode records log p(y) when T != 1 and
P < 1: a run whose ratio uses such an engine's logprobs refuses rollout.top_p < 1
(tracetrain/run/step.py, check_top_p).
"""

from __future__ import annotations

import torch

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def uniform(seed: int, step: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, step): 53 bits of splitmix64."""
    return (_splitmix64(_splitmix64(seed & _M64) ^ step) >> 11) * 2.0**-53


def _draw(cdf: torch.Tensor, mass: torch.Tensor, u: torch.Tensor, last: torch.Tensor | int) -> torch.Tensor:
    """Inverse CDF: the first column j of `cdf` [B, V] (float64, nondecreasing) with
    cdf[j] > u * mass, at most `last`."""
    j = torch.searchsorted(cdf, (u * mass)[:, None], right=True).squeeze(-1)
    return torch.minimum(j, torch.as_tensor(last, device=j.device))


def sample_tokens(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step for a batch: logits [B, V] fp32, temperature [B] (0 = greedy), top_p [B] in
    (0, 1], u [B] uniforms in [0, 1) (float64). Returns (token ids y [B], log p(y) [B]) with the
    formulas of the module docstring."""
    greedy = temperature == 0
    # (x / 1 == x exactly: a batch at temperature 1 skips the division)
    z = logits if bool((temperature == 1).all()) else logits / torch.where(
        greedy, torch.ones_like(temperature), temperature)[:, None]
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    cdf = p.double().cumsum(-1)
    y = _draw(cdf, cdf[:, -1], u, cdf.shape[-1] - 1)
    cut = (top_p < 1) & ~greedy
    if bool(cut.any()):
        rows = cut.nonzero().squeeze(1)
        sorted_p, order = p[rows].double().sort(dim=-1, descending=True, stable=True)
        scdf = sorted_p.cumsum(-1)
        kept = ((scdf - sorted_p) < top_p[rows, None].double()).sum(-1)  # |N|, a sorted prefix
        mass = scdf.gather(-1, (kept - 1)[:, None]).squeeze(-1)  # S
        j = _draw(scdf, mass, u[rows], kept - 1)
        y[rows] = order.gather(-1, j[:, None]).squeeze(-1)
    if bool(greedy.any()):  # (a batch without a greedy row skips the argmax)
        y = torch.where(greedy, z.argmax(-1), y)
    return y, logp.gather(-1, y[:, None]).squeeze(-1)
