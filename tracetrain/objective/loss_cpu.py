"""CPU speed-ups for loss.py: the same numbers as its plain torch, computed faster on CPU.

loss.py states the math once, in plain torch, and calls the twins here where they pay. Each twin is
tested against its plain version (tests/objective/test_loss_cpu.py: equal counts; allclose losses, metrics
and gradients over random shapes, masks, rollout cuts and block sizes).

| here               | plain version in loss.py           | runs where                             |
|--------------------|------------------------------------|----------------------------------------|
| `row_token_counts` | `mask.sum(1)`                      | CPU, mask >= COUNTS_MIN elements       |
| `policy_loss_sums` | `loss.policy_loss_sums` (autograd) | CPU, >= LOSS_MIN tokens (*)            |

(*) or whenever policy_loss gets chunk_tokens.

On a GPU the plain versions run: there each op is one kernel over the whole tensor, which is
already fast, and blocks would only add launches. On CPU the plain versions lose because:

- torch's bool row-sum widens every byte to int64: up to 40x slower than summing the bytes as words.
- The loss is ~30 elementwise ops per token. On [rows, S] tensors each op streams megabytes through
  memory into a fresh tensor (autograd keeps many of them for backward); here the rows go through
  in blocks of BLOCK tokens whose temporaries live in one reused workspace that stays in cache, and
  forward also computes d L / d logprob, so backward is one multiply (none when L is the loss)
  (figures against the plain version in docs/bench-loss.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCK = 1 << 17  # tokens per block; each op on it spans torch's threads (of 2^15..2^19, fastest)
COUNTS_MIN = 1 << 12  # mask elements from which row_token_counts pays on CPU
LOSS_MIN = 1 << 12  # tokens from which policy_loss_sums pays on CPU


def counts_pay(mask: torch.Tensor) -> bool:
    return mask.device.type == "cpu" and mask.numel() >= COUNTS_MIN


def loss_pays(logprobs: torch.Tensor) -> bool:
    return logprobs.device.type == "cpu" and logprobs.numel() >= LOSS_MIN


# ---------------------------------------------------------------------------------------------
# Row token counts
# ---------------------------------------------------------------------------------------------


def row_token_counts(mask: torch.Tensor) -> torch.Tensor:
    """T_i = sum_t m[i,t] as int64 [rows] for a bool CPU mask; equals `mask.sum(1)`.

    A bool is one byte holding 0 or 1, so we sum the mask as int64 words instead: each word carries
    8 byte lanes, and a lane that adds up at most 255 words cannot carry into its neighbour. Summing
    blocks of 128 words, then the 8 bytes of each block sum, gives the exact count.
    """
    rows, width = mask.shape
    n_words = width // 8
    counts = torch.zeros(rows, dtype=torch.int64)
    if n_words and rows:
        head = mask[:, : 8 * n_words]
        if not (
            head.is_contiguous()
            and head.stride(0) == 8 * n_words
            and head.storage_offset() % 8 == 0
        ):
            head = torch.empty(rows, 8 * n_words, dtype=torch.bool).copy_(head)
        words = head.view(torch.int64)  # [rows, n_words]
        full = n_words // 128
        lanes = []
        if full:
            lanes.append(words[:, : 128 * full].view(rows, full, 128).sum(-1))  # lanes <= 128
        if n_words % 128:
            lanes.append(words[:, 128 * full :].sum(-1, keepdim=True))  # lanes <= 127
        lane_sums = torch.cat(lanes, dim=1).contiguous()  # [rows, blocks] int64, 8 lanes each
        counts += lane_sums.view(torch.uint8).view(rows, 8 * lane_sums.shape[1]).sum(-1)
    if width % 8:
        counts += mask[:, 8 * n_words :].sum(-1)
    return counts


# ---------------------------------------------------------------------------------------------
# KL estimators with their derivative (value into `out`; returns kl_coef * d value / d logprob)
# ---------------------------------------------------------------------------------------------

KlGrad = Callable[..., "torch.Tensor | float"]
KL_GRADS: dict[str, KlGrad] = {}


def _register_kl(name: str) -> Callable[[KlGrad], KlGrad]:
    def deco(fn: KlGrad) -> KlGrad:
        KL_GRADS[name] = fn
        return fn

    return deco


@_register_kl("k1")
def _k1(lp, ref, coef, out, t1, t2):
    """k1 = lp - ref; d/dlp = 1."""
    torch.sub(lp, ref, out=out)
    return coef


@_register_kl("k2")
def _k2(lp, ref, coef, out, t1, t2):
    """k2 = (lp - ref)^2 / 2; d/dlp = lp - ref."""
    d = torch.sub(lp, ref, out=t1)
    torch.mul(d, d, out=out).mul_(0.5)
    return d.mul_(coef)


@_register_kl("k3")
def _k3(lp, ref, coef, out, t1, t2):
    """k3 = min(exp(x) - x - 1, 10), x = clamp(ref - lp, -20, 20); d/dlp = 1 - exp(x) where k3 < 10."""
    x = torch.sub(ref, lp, out=out).clamp_(-20.0, 20.0)
    e = torch.exp(x, out=t1)
    value = torch.sub(e, x, out=out).sub_(1.0)
    keep = torch.le(value, 10.0, out=t2).mul_(coef)
    value.clamp_(max=10.0)
    return torch.addcmul(keep, keep, e, value=-1.0, out=t1)  # (aliases e: elementwise, so fine)


# ---------------------------------------------------------------------------------------------
# Policy loss: one blocked pass computes the sums and d L / d logprob; backward is one multiply
# ---------------------------------------------------------------------------------------------

# What policy_loss_sums returns: loss.SUMS.
_SUMS = ("pg", "mass", "clip", "dual_clip", "approx_kl", "kl_ref", "entropy")
# Per-token rows of a block's workspace; each block multiplies the others by the last, w, and adds
# every row's sum to the totals (see _Blocked.forward: "Summation").
_Q = ("pg", "clip", "dual", "approx_kl", "kl", "entropy", "w")
# exp(clamp(x, -20, 20)) as float32, and the float32 just inside: the ratio's clamp gives no
# gradient beyond +-20 (as autograd on the plain version); per-row bounds inside these see to it.
_R_HI = float(torch.tensor(20.0).exp())
_R_LO = float(torch.tensor(-20.0).exp())
_IN_HI = float(torch.nextafter(torch.tensor(_R_HI), torch.tensor(0.0)))
_IN_LO = float(torch.nextafter(torch.tensor(_R_LO), torch.tensor(1.0)))


class _Workspace:
    """The buffers of one block: Q (its rows named by _Q; a row no term writes stays 0) and five
    temporaries, with views for a block of `rows` rows made once."""

    def __init__(self, rows: int, width: int, device: torch.device):
        self.q = torch.zeros(len(_Q), rows * width, device=device)
        self.t = torch.empty(5, rows * width, device=device)
        self._views: dict[int, tuple] = {}

    def views(self, rows: int, width: int) -> tuple[torch.Tensor, dict, list]:
        """(Q [len(_Q), n], its rows by name, the temporaries) for a block of `rows` rows."""
        if rows not in self._views:
            n = rows * width
            q = self.q[:, :n]
            named = {k: q[j].view(rows, width) for j, k in enumerate(_Q)}
            self._views[rows] = (q, named, [x[:n].view(rows, width) for x in self.t])
        return self._views[rows]


def policy_loss_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    is_weights: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    kl_estimator: str,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    chunk_tokens: int = BLOCK,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss.policy_loss_sums` in blocks of about `chunk_tokens` tokens: the same (L, sums), the
    same gradients.

    Forward computes d L / d logprob block by block and keeps only that [rows, S] tensor, so
    backward is one multiply (none when L itself is the loss). `weights` is a [rows, S] tensor or
    (bool mask [rows, S], scales [rows]). Beyond |logprob - old| = 20, where the clamp of the
    log-ratio cuts the gradient in the plain version, it is cut here too; the clip_frac metric
    may count such a token as clipped there.
    """

    def c(x):
        return None if x is None else x.contiguous()

    full, mask, scales = (weights, None, None) if isinstance(weights, torch.Tensor) else (None, *weights)
    cfg = (clip_low, clip_high, dual_clip, kl_estimator, kl_coef, entropy_coef, chunk_tokens)
    tensors = tuple(map(c, (old_logprobs, advantages, full, mask, scales, is_weights, ref_logprobs)))
    loss, totals = _Blocked.apply(c(logprobs), c(entropy), tensors, cfg)
    return loss, dict(zip(_SUMS, totals.unbind(0), strict=True))


class _Blocked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logprobs, entropy, tensors, cfg):
        old, adv, weights, mask, scales, isw, ref = tensors
        clip_low, clip_high, dual_clip, kl_name, kl_coef, entropy_coef, chunk = cfg
        rows, width = logprobs.shape
        dev = logprobs.device
        grad = torch.empty(rows, width, dtype=torch.float32, device=dev)  # d L / d logprob
        kl_fn = None if ref is None else KL_GRADS[kl_name]
        per_row = adv.dim() == 1 and isw is None
        if per_row:  # the clip as per-row bounds on the ratio (see _surrogate_rows)
            bounds = _row_bounds(adv.float(), clip_low, clip_high, dual_clip)
        step = max(1, chunk // max(width, 1))  # rows per block
        ws = _Workspace(min(step, rows), width, dev)
        # Summation: sum_{i,t} w x = sum over blocks of (the block's sum of the fp32 products w x).
        # A block sums with torch's cascade sum (short sequential runs added level by level: the
        # error is a few u = 6e-8 of sum |w x| at any length, measured 0.7-1.5e-7 from 2^12 to
        # 2^24 terms under each ATEN_CPU_CAPABILITY); block totals add up in fp64. So a total's
        # error does not grow with the token count. (A BLAS matrix-vector product accumulates
        # sequentially in a CPU-dependent kernel: MKL's generic path, which AMD CPUs get, was
        # off by 2.4e-5 in the mass of 270k tokens.)
        s = torch.zeros(len(_Q), dtype=torch.float64, device=dev)
        for a in range(0, rows, step):
            b = min(a + step, rows)
            qm, q, t = ws.views(b - a, width)
            if weights is not None:
                w = q["w"].copy_(weights[a:b])
            else:  # (a bool tensor in arithmetic is slow on CPU; its uint8 view is not)
                w = torch.mul(mask[a:b].view(torch.uint8), scales[a:b, None], out=q["w"])
            lp = logprobs[a:b].float()
            logratio = torch.sub(lp, old[a:b], out=q["approx_kl"])
            if per_row:
                logratio.clamp_(-20.0, 20.0)
                ratio = torch.exp(logratio, out=t[4])
                nav, lo, hi, dual_hi = bounds[a:b].unbind(1)
                _surrogate_rows(ratio, nav, lo, hi, dual_hi, dual_clip is not None, q, t[0])
                rk = torch.addcmul(ratio, ratio, q["clip"], value=-1.0, out=t[0])  # r, 0 if clipped
            else:
                inside = torch.abs(logratio, out=t[3]).le_(20.0)
                logratio.clamp_(-20.0, 20.0)
                ratio = torch.exp(logratio, out=t[4])
                nav = adv[a:b, None] if adv.dim() == 1 else adv[a:b]
                if isw is None:
                    nav = torch.neg(nav, out=t[2])
                else:
                    nav = torch.mul(nav, isw[a:b], out=t[2]).neg_()
                _surrogate_tokens(ratio, nav, clip_low, clip_high, dual_clip, q, t[0], t[1])
                rk = torch.addcmul(ratio, ratio, q["clip"], value=-1.0, out=t[0]).mul_(inside)
            torch.sub(ratio, logratio, out=q["approx_kl"]).sub_(1.0)  # r - 1 - log r
            # d L / d lp = w (-A r [not clipped] + kl_coef d kl / d lp)
            g = grad[a:b]
            dkl = 0.0 if kl_fn is None else kl_fn(lp, ref[a:b], kl_coef, q["kl"], t[1], t[3])
            if isinstance(dkl, torch.Tensor):
                torch.addcmul(dkl, rk, nav, out=g)
            else:
                torch.mul(rk, nav, out=g).add_(dkl)
            g.mul_(w)
            if entropy is not None:
                q["entropy"].copy_(entropy[a:b])
            qm[:-1].mul_(qm[-1])  # w x per token, each row x of Q but w itself
            s += qm.sum(1)
        q = dict(zip(_Q, s.unbind(0), strict=True))
        totals = torch.stack([
            q["pg"],
            q["w"],  # the mass, sum w
            q["clip"],
            q["dual"],
            q["approx_kl"],  # sum w (r - 1 - log r): k3 of the new policy against the old
            q["kl"],
            q["entropy"],
        ])
        loss = (totals[0] + kl_coef * totals[5] - entropy_coef * totals[6]).float()
        totals = totals.float()
        ctx.save_for_backward(grad, weights, mask, scales)
        ctx.entropy_coef = entropy_coef
        ctx.lp_dtype = logprobs.dtype
        ctx.ent_dtype = None if entropy is None else entropy.dtype
        ctx.mark_non_differentiable(totals)
        return loss, totals

    @staticmethod
    def backward(ctx, grad_loss, _grad_totals):
        grad, weights, mask, scales = ctx.saved_tensors
        grad_lp = grad_ent = None
        if ctx.needs_input_grad[0]:
            # (L is usually the loss itself: grad_loss == 1, and the saved gradient is the answer)
            one = grad.device.type == "cpu" and bool(grad_loss == 1.0)
            grad_lp = (grad if one else grad * grad_loss).to(ctx.lp_dtype)
        if ctx.needs_input_grad[1] and ctx.entropy_coef != 0.0:
            c = -ctx.entropy_coef * grad_loss
            w = weights * c if weights is not None else mask.view(torch.uint8) * (scales[:, None] * c)
            grad_ent = w.to(ctx.ent_dtype)
        return grad_lp, grad_ent, None, None


def _row_bounds(adv, clip_low, clip_high, dual_clip):
    """[rows, 4, 1]: per row -A, then the bounds lo, hi of the ratio and dual_hi of the dual clip."""
    inf = torch.full_like(adv, float("inf"))
    dual_hi = torch.where(adv < 0, float(dual_clip), inf) if dual_clip is not None else inf
    lo = torch.where(adv < 0, 1.0 - clip_low, -inf).clamp_(min=_IN_LO)
    hi = torch.where(adv > 0, 1.0 + clip_high, dual_hi).clamp_(max=_IN_HI)
    return torch.stack([adv.neg(), lo, hi, dual_hi], 1)[:, :, None]


def _surrogate_rows(ratio, nav, lo, hi, dual_hi, dual, q, tmp):
    """One A per row: max(-A r, -A clamp(r, 1 - cl, 1 + ch)), capped at -A dual_clip for A < 0, is
    -A c with c = clamp(r, lo, hi): A > 0 clips above 1 + ch, A < 0 below 1 - cl and above
    dual_clip, A = 0 never. `clip` (no gradient through r) where c != r."""
    c = torch.minimum(torch.maximum(ratio, lo, out=tmp), hi, out=tmp)
    torch.mul(c, nav, out=q["pg"])
    torch.ne(c, ratio, out=q["clip"])
    if dual:
        torch.gt(ratio, dual_hi, out=q["dual"])


def _surrogate_tokens(ratio, nav, clip_low, clip_high, dual_clip, q, tmp, tmp2):
    """One A per token (nav = -A v): loss.ppo_surrogate, written into the workspace."""
    unclipped = torch.mul(ratio, nav, out=tmp)
    pg = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high, out=q["pg"]).mul_(nav)
    torch.maximum(pg, unclipped, out=pg)
    if dual_clip is not None:
        cap = torch.abs(nav, out=tmp2).mul_(dual_clip)
        torch.gt(pg, cap, out=q["dual"])
        torch.minimum(pg, cap, out=pg)
    torch.ne(pg, unclipped, out=q["clip"])
