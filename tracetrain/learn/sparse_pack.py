"""Attention over a pack without its [N, N] mask: each row's new tokens attend over its own path.

A pack (packing.py) is a prefix tree laid out as one sequence of N nodes; node n may attend to
itself and its ancestors. Read as rows: row i's path is the L_i nodes of its real tokens, of which
the first s_i were already in the pack (shared with earlier rows) and the last q_i = L_i - s_i
are new, contiguous nodes that row i added. Every node is new in exactly one row, so the pack's
attention is, row by row,

    out[new nodes of row i] = softmax(Q[new_i] K[path_i]^T * scale + causal(offset s_i)) V[path_i]

a [q_i, L_i] block per row instead of the [N, N] mask: sum_i q_i * L_i scores instead of N^2 (for
32 rows of 127 tokens that share 114: 32 * 13 * 127 = 53k instead of 1,185^2 = 1.4M; without
sharing, each row's own causal square, what a padded batch computes, instead of the pack's N^2).

The rows' blocks go to torch's scaled_dot_product_attention batched: rows sorted by q_i and cut
into a few groups, each padded to its largest block (a bool mask [B, 1, Qmax, Kmax]: the offset
causal pattern, padded keys off; a padded query sees key 0 so that no softmax is empty, and its
output is dropped). Q, K and V are gathered per group by index (a shared prefix's K and V once per
row that reads them; the backward adds their gradients back), the outputs put back in node order.

How transformers gets there, without touching the model or its config (the engine may decode
with the same module meanwhile): `install()` puts a dispatcher in transformers' attention registry
under "sdpa"; it runs the original SDPA function unless the call carries a plan as the keyword
`tracetrain_pack`, which the model's forward passes down to every attention call. The 4-D
attention mask given alongside is a stride-0 placeholder (no [N, N] memory) that only tells the
mask builder to leave it as it is. A model whose attention did not come through the dispatcher
(plan.calls stays 0) is computed again with the dense mask by the caller (packing.row_logprobs).

FlexAttention's CPU path (torch 2.13) has no backward ("FlexAttention does not support backward on
CPU"), so it cannot run the update; this module is the CPU path for packs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KWARG = "tracetrain_pack"  # the keyword the model's forward hands to each attention call
SLACK = 2.0  # a group takes a row while its padded scores stay within SLACK x its rows' own
# grouped-query attention (H = rep x Hkv query heads): the rep query heads of a kv head as rep x
# Qmax queries of one head (K and V read as they are), instead of K and V copied rep times as
# transformers' repeat_kv does. Benchmarks and tests set it.
FOLD_GQA = True
# Under autocast, the row blocks' attention computed by torch's CPU flash kernel in fp32 on the
# operands autocast gives it (bf16, kept so for the backward: Fp32Flash) instead of the kernel's
# bf16 path: torch 2.13's bf16 backward is about twice its fp32 one at these block sizes
# (docs/benchmarks.md, "The update at its floor ..., part 2"). Benchmarks and tests set it.
WIDE_ATTENTION = True


@dataclass
class Group:
    """B rows of one batched SDPA call."""

    q_idx: torch.Tensor  # [B * Qmax] int64: the node of each query slot (0 on padding)
    k_idx: torch.Tensor  # [B * Kmax] int64: the node of each key slot (0 on padding)
    mask: torch.Tensor  # [B, 1, Qmax, Kmax] bool: True = attend
    keep: torch.Tensor  # [n real queries] int64: the real query slots, in the flat [B * Qmax]
    shape: tuple[int, int, int]  # (B, Qmax, Kmax)
    masks: dict = field(default_factory=dict, repr=False)  # (rep, dtype) -> attn_mask's result

    def attn_mask(self, rep: int, dtype: torch.dtype) -> torch.Tensor:
        """[B, 1, rep * Qmax, Kmax]: the mask, its rows repeated `rep` times (a kv head's rep query
        heads as one), as bool (dtype torch.bool) or as an additive bias (0 where attended, -inf
        elsewhere); made once per group, for every layer."""
        if (rep, dtype) not in self.masks:
            B, Qm, Km = self.shape
            mask = self.mask.expand(B, rep, Qm, Km).reshape(B, 1, rep * Qm, Km)
            self.masks[rep, dtype] = mask if dtype == torch.bool else torch.zeros(
                mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        return self.masks[rep, dtype]


@dataclass
class SparsePlan:
    """How one pack's attention is computed row by row; built once per pack, used by every layer
    (and by the reference model's forward over the same pack)."""

    groups: list[Group]
    order: torch.Tensor  # [N] int64: the node n's output is row order[n] of the groups' outputs
    n_tokens: int  # N
    scores: int  # query-key pairs the groups compute (padding included)
    calls: int = field(default=0)  # attention calls that went through the plan (see dense fallback)

    @property
    def dense_scores(self) -> int:
        return self.n_tokens * self.n_tokens

    def to(self, device: torch.device) -> SparsePlan:
        if all(g.q_idx.device == torch.device(device) for g in self.groups):
            return self
        mv = lambda t: t.to(device)  # noqa: E731
        groups = [Group(mv(g.q_idx), mv(g.k_idx), mv(g.mask), mv(g.keep), g.shape) for g in self.groups]
        return SparsePlan(groups, mv(self.order), self.n_tokens, self.scores)


def row_segments(node: torch.Tensor, n_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """node [rows, width] (packing.Packed.node: each real token's node, -1 on padding) ->
    (path_i, s_i) for each row that added nodes: its path (node ids, in depth order) and how many
    of its first nodes earlier rows added. ValueError when a row's new nodes are not the end of
    its path (not a pack of prefix-tree rows)."""
    seen = torch.zeros(n_tokens, dtype=torch.bool)
    out = []
    for row in node:
        path = row[row >= 0]
        old = seen[path]
        s = int(old.sum())
        if s == path.numel():
            continue  # a row wholly inside earlier ones adds no queries
        if bool(old[s:].any()) or not bool(old[:s].all()):
            raise ValueError("a row's shared nodes are not a prefix of its path")
        seen[path] = True
        out.append((path, s))
    return out


def _group(segs: list[tuple[torch.Tensor, int]]) -> Group:
    B = len(segs)
    Qm = max(p.numel() - s for p, s in segs)
    Km = max(p.numel() for p, _ in segs)
    q_idx = torch.zeros(B, Qm, dtype=torch.int64)
    k_idx = torch.zeros(B, Km, dtype=torch.int64)
    mask = torch.zeros(B, 1, Qm, Km, dtype=torch.bool)
    real = torch.zeros(B, Qm, dtype=torch.bool)
    j = torch.arange(Qm)[:, None]
    k = torch.arange(Km)[None, :]
    for b, (p, s) in enumerate(segs):
        L, q = p.numel(), p.numel() - s
        q_idx[b, :q] = p[s:]
        k_idx[b, :L] = p
        mask[b, 0] = (k <= j + s) & (j < q)  # query j (depth s + j) sees depths 0..s + j
        mask[b, 0, q:, 0] = True  # padded queries: one key, so that no softmax row is empty
        real[b, :q] = True
    return Group(q_idx.reshape(-1), k_idx.reshape(-1), mask, real.reshape(-1).nonzero().squeeze(1),
                 (B, Qm, Km))


def build_plan(node: torch.Tensor, n_tokens: int, *, slack: float = SLACK) -> SparsePlan:
    """The pack's rows (Packed.node) -> their attention blocks, grouped: rows sorted by new
    tokens (then path length), largest first; a group takes the next row while its padded
    B x Qmax x Kmax stays within `slack` x the sum of its rows' q_i x L_i."""
    segs = row_segments(node, n_tokens)
    segs.sort(key=lambda ps: (ps[0].numel() - ps[1], ps[0].numel()), reverse=True)
    chunks: list[list[tuple[torch.Tensor, int]]] = []
    own = qm = km = 0
    for p, s in segs:
        q, L = p.numel() - s, p.numel()
        if chunks:
            b = len(chunks[-1]) + 1
            if b * max(qm, q) * max(km, L) <= slack * (own + q * L):
                chunks[-1].append((p, s))
                own, qm, km = own + q * L, max(qm, q), max(km, L)
                continue
        chunks.append([(p, s)])
        own, qm, km = q * L, q, L
    groups = [_group(c) for c in chunks]
    # the groups' real query slots, concatenated, hold node (q_idx[keep]); order inverts that
    flat = torch.cat([g.q_idx[g.keep] for g in groups]) if groups else torch.zeros(0, dtype=torch.int64)
    if flat.numel() != n_tokens or not torch.equal(flat.sort().values, torch.arange(n_tokens)):
        raise ValueError("the pack's rows do not cover each node once")
    order = torch.empty(n_tokens, dtype=torch.int64)
    order[flat] = torch.arange(n_tokens)
    scores = sum(b * qm * km for b, qm, km in (g.shape for g in groups))
    return SparsePlan(groups, order, n_tokens, scores)


def pack_attention(query, key, value, plan: SparsePlan, *, scaling: float | None = None,
                   dropout: float = 0.0) -> torch.Tensor:
    """query [1, H, N, D], key and value [1, Hkv, N, D] (H a multiple of Hkv, as repeat_kv takes
    them) -> [1, N, H, D], the pack's attention output as transformers' attention functions give it."""
    q, k, v = query[0], key[0], value[0]
    H, _, D = q.shape
    Hkv = k.shape[0]
    rep = H // Hkv
    fold = rep if rep > 1 and FOLD_GQA else 1  # query heads per kv head in one block
    outs = []
    for g in plan.groups:
        B, Qm, Km = g.shape
        qg = q.index_select(1, g.q_idx).view(H, B, Qm, D).transpose(0, 1)
        kg = k.index_select(1, g.k_idx).view(Hkv, B, Km, D).transpose(0, 1)
        vg = v.index_select(1, g.k_idx).view(Hkv, B, Km, D).transpose(0, 1)
        if fold > 1:  # query head h = kv head h // rep: [B, Hkv, rep * Qm, D]
            qg = qg.reshape(B, Hkv, rep * Qm, D)
        elif rep > 1:  # kv head h // rep serves query head h (transformers' repeat_kv)
            kg = kg[:, :, None].expand(B, Hkv, rep, Km, D).reshape(B, H, Km, D)
            vg = vg[:, :, None].expand(B, Hkv, rep, Km, D).reshape(B, H, Km, D)
        if _fp32_flash(q, dropout):
            low = torch.get_autocast_dtype(q.device.type)
            o = Fp32Flash.apply(qg.to(low), kg.to(low), vg.to(low),
                                g.attn_mask(fold, torch.float32), scaling)
        else:
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.attn_mask(fold, torch.bool),
                                               dropout_p=dropout, scale=scaling)
        o = o.reshape(B, H, Qm, D)
        outs.append(o.transpose(1, 2).reshape(B * Qm, H, D).index_select(0, g.keep))
    plan.calls += 1
    return torch.cat(outs).index_select(0, plan.order).unsqueeze(0)


def _fp32_flash(q: torch.Tensor, dropout: float) -> bool:
    """Whether a block's attention runs as Fp32Flash: WIDE_ATTENTION, on the CPU, under
    autocast, without dropout."""
    return (WIDE_ATTENTION and q.device.type == "cpu" and not dropout
            and torch.is_autocast_enabled("cpu"))


class Fp32Flash(torch.autograd.Function):
    """o [B, h, q, D] = Fp32Flash.apply(q [B, h, q, D], k, v [B, h, k, D], bias [B, 1, q, k],
    scale): softmax(q k^T * scale + bias) v by torch's CPU flash kernel in fp32, on operands
    given (and kept for the backward) in a narrower dtype, o in that dtype. The backward runs the
    kernel's fp32 backward on the kept operands (and o) widened again. scale None: 1/sqrt(D)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale):
        with torch.autocast("cpu", enabled=False):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q.float(), k.float(), v.float(), attn_mask=bias, scale=scale)
        low = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, low, lse, bias)
        ctx.scale = scale
        return low

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, bias = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, False,
                attn_mask=bias, scale=ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


_lock = threading.Lock()
_original = None


def _dispatch(module, query, key, value, attention_mask, *args, **kwargs):
    plan = kwargs.pop(KWARG, None)
    if plan is None:
        return _original(module, query, key, value, attention_mask, *args, **kwargs)
    return pack_attention(query, key, value, plan, scaling=kwargs.get("scaling"),
                          dropout=kwargs.get("dropout", 0.0)), None


def install() -> bool:
    """Put the dispatcher in transformers' attention registry under "sdpa" (once; the original
    runs for every call without a plan). False when transformers has no such registry."""
    global _original
    with _lock:
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        except ImportError:
            return False
        current = ALL_ATTENTION_FUNCTIONS.get("sdpa")
        if current is None:
            return False
        if current is not _dispatch:
            _original = current
            ALL_ATTENTION_FUNCTIONS["sdpa"] = _dispatch
        return True


def placeholder_mask(n: int, device: torch.device) -> torch.Tensor:
    """[1, 1, N, N] bool of stride 0: a 4-D mask the model passes on as it is (no N^2 memory);
    the attention calls that carry the plan ignore it."""
    return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device).expand(1, 1, n, n)
