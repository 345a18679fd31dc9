"""Rows packed into one sequence, every shared prefix computed once, logprobs without full logits.

A micro-batch's rows (their real tokens; left and right padding dropped) go into a prefix tree
keyed by token id: rows whose first k tokens are equal share those k nodes (the step's system
prompt, a group's question, a rollout's earlier turns). The nodes, in insertion order, are one
sequence of N tokens, with

    input_ids[n]    = the token of node n
    position_ids[n] = the depth of node n: its position in every row that passes through it
    allowed[n, m]   = m is n or an ancestor of n                      (attention mask, [N, N])

A causal LM's hidden state at a position depends only on the tokens up to it and their positions,
so node n's hidden state is the one every row through it would compute there: one forward over the
N nodes gives each row's logprobs as the padded batch does (up to float reassociation), and its
backward gives the sum of the rows' gradients, each shared node's once with every row's share
added. With `share=False` every row is its own chain: plain packing, no padding, no sharing.

The logprob of response column t of row i is read at the node of the row's token just before it:

    logprob[i, t] = z[y] - logsumexp(z),   z = lm_head(h[node(i, P_i + t - 1)]) / T,  y its token
    entropy[i, t] = logsumexp(z) - sum_v softmax(z)_v z_v

computed `chunk` positions at a time under activation checkpointing: the logits held at once are
[chunk, V], never [rows, S, V]; the backward recomputes one chunk's logits at a time. A model whose
forward pass changes lm_head's logits (a final soft-cap, a logit scale: `scales_logits`) is called
whole instead, its logits kept at the needed positions only.

Only models whose every layer is full attention are packed (`packable`): a sliding-window layer's
mask is made from the columns of one sequence, and a conv layer mixes a sequence's neighbouring
tokens, across the rows of a pack; their rows are computed padded.

Attention over a pack: under SDPA it runs row by row (sparse_pack.py): each row's new nodes
attend over its own path, sum_i q_i * L_i scores instead of N^2 (without sharing, each row's own
causal square, what a padded batch computes), and the [N, N] mask is never built. Under eager
attention (kept for its explicit weights), or with PACK_ATTENTION = "dense", the tree mask goes to
the model as a dense [N, N] mask, and the attention over a pack costs N^2: packs are kept to
`pack_tokens` (see minibatch.plan_step). FlexAttention would skip the blocks off the tree too, but
its CPU path has no backward in torch 2.13.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from tracetrain.learn import sparse_pack
from tracetrain.learn.head import head_logprobs
from tracetrain.learn.logprobs import autocast, logprobs_from_logits
from tracetrain.learn.sparse_pack import SparsePlan, build_plan

# How a pack's attention runs: "auto" (row by row, sparse_pack.py, where the model's attention is
# SDPA and that computes fewer scores than the dense mask; else the dense [N, N] mask), "dense",
# or "sparse" (row by row for every SDPA model, even where it computes as many scores; an error
# where the model's attention bypasses the dispatcher). Benchmarks and tests set it.
PACK_ATTENTION = "auto"
# auto's threshold: the row blocks' gathers cost about what the scores they save do until the plan
# is down to half the dense scores (measured with bench/bench_pack_attention.py: docs/benchmarks.md,
# "A pack's attention without the dense mask")
AUTO_SCORES = 0.5
# The head's logprobs without entropy through learn/head.py's written-out gradient (False: each
# chunk checkpointed and differentiated by autograd). Benchmarks and tests set it.
USE_HEAD_FUNCTION = True


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, N] int64: one token per tree node
    position_ids: torch.Tensor  # [1, N] int64: the node's depth
    node: torch.Tensor  # [rows, P+S] int64: the node of each real token of each row, -1 on padding
    n_row_tokens: int  # real tokens over all rows (what a forward without sharing computes)
    _allowed: torch.Tensor | None = field(default=None, repr=False)
    _plan: SparsePlan | None = field(default=None, repr=False)

    @property
    def n_tokens(self) -> int:
        """N: the tokens this pack's forward computes."""
        return self.input_ids.shape[1]

    @property
    def allowed(self) -> torch.Tensor:
        """[N, N] bool: allowed[n, m] = m is n or an ancestor of n (built on first use: the sparse
        attention never needs it)."""
        if self._allowed is None:
            N = self.n_tokens
            allowed = torch.zeros(N, N, dtype=torch.bool)
            for row in self.node:  # each row's chain: a token sees itself and every token before it
                p = row[row >= 0]
                k = p.numel()
                if k:
                    q, kv = torch.tril_indices(k, k)
                    allowed[p[q], p[kv]] = True
            self._allowed = allowed
        return self._allowed

    def sparse_plan(self) -> SparsePlan:
        """The pack's attention row by row (sparse_pack.build_plan), built on first use."""
        if self._plan is None:
            self._plan = build_plan(self.node, self.n_tokens)
        return self._plan


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, share: bool = True) -> Packed:
    """Pack rows [rows, P+S] (real tokens where attention_mask is 1, contiguous in each row) into
    one tree-shaped sequence; see the module docstring."""
    ids = input_ids.tolist()
    real = attention_mask.bool()
    node = torch.full(input_ids.shape, -1, dtype=torch.int64)
    tokens: list[int] = []
    depth: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for i, row in enumerate(ids):
        cols = real[i].nonzero().squeeze(1)
        if cols.numel() and int(cols[-1] - cols[0]) + 1 != cols.numel():
            raise ValueError(f"row {i}: its real tokens (attention_mask 1) are not contiguous")
        path = []
        parent = -1
        for d, c in enumerate(cols.tolist()):
            key = (parent, row[c])
            n = children.get(key) if share else None
            if n is None:
                n = len(tokens)
                tokens.append(row[c])
                depth.append(d)
                if share:
                    children[key] = n
            path.append(n)
            parent = n
        node[i, cols] = torch.tensor(path, dtype=torch.int64)
    return Packed(
        input_ids=torch.tensor([tokens], dtype=torch.int64),
        position_ids=torch.tensor([depth], dtype=torch.int64),
        node=node,
        n_row_tokens=int(real.sum()),
    )


def base_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers causal LM inside DDP (`.module`) and peft (`get_base_model()`) wrappers."""
    lm = getattr(model, "module", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def scales_logits(model: torch.nn.Module) -> str | None:
    """The config field by which the model's forward pass changes lm_head's logits (gemma2's
    final_logit_softcapping, granite's logits_scaling, ...), or None."""
    cfg = getattr(base_lm(model), "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            return attr
    return None


def packable(model: torch.nn.Module) -> bool:
    """Whether rows of the model may be packed: every layer full attention. A sliding-window
    layer's window (its mask is made from the columns of a sequence) and a conv layer (it mixes
    neighbouring tokens of the sequence, across a pack's rows) need the padded rows."""
    cfg = getattr(base_lm(model), "config", None)
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    kinds = getattr(cfg, "layer_types", None)
    if kinds is not None:
        return set(kinds) <= {"full_attention"}
    return getattr(cfg, "sliding_window", None) is None and not getattr(
        cfg, "attention_chunk_size", None)


def split_lm(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder, lm_head) of a transformers causal LM (also under peft's PeftModel): the decoder
    maps ids to the final normed hidden states, lm_head those to logits. ValueError when the model
    does not split that way or scales its logits (softcapping, logit_scale), which the chunked
    head would miss."""
    lm = base_lm(model)
    if attr := scales_logits(model):
        raise ValueError(f"the model scales its logits ({attr}); packed logprobs need a plain lm_head")
    get_decoder = getattr(lm, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if decoder is None or not isinstance(head, torch.nn.Linear):
        raise ValueError(f"{type(lm).__name__} has no decoder + linear lm_head to pack rows through")
    return decoder, head


def attention_mask_4d(allowed: torch.Tensor, attn_implementation: str | None, dtype: torch.dtype):
    """[1, 1, N, N]: bool for SDPA and flex (True = attend), additive float for eager."""
    if attn_implementation == "eager":
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, torch.finfo(dtype).min)[None, None]
    return allowed[None, None]


def _head_logprobs(h, weight, bias, target, temperature: float, with_entropy: bool):
    return logprobs_from_logits(torch.nn.functional.linear(h, weight, bias).float(), target,
                                temperature, with_entropy)


def chunked_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Linear,
    target: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = 512,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [M, H], target [M] -> (logprob [M], entropy [M] or None), `chunk` positions at a
    time; no [chunk, V] logits are kept for the backward: without entropy the gradient is written
    out (learn/head.py), with it each chunk is checkpointed (recomputed in the backward)."""
    if not with_entropy and USE_HEAD_FUNCTION:
        return head_logprobs(hidden, head, target, temperature=temperature, chunk=chunk), None
    lps, ents = [], []
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    for s in range(0, hidden.shape[0], chunk):
        args = (hidden[s : s + chunk], head.weight, head.bias, target[s : s + chunk], temperature,
                with_entropy)
        if grad:
            lp, ent = checkpoint(_head_logprobs, *args, use_reentrant=False)
        else:
            lp, ent = _head_logprobs(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, (empty if with_entropy else None)
    return torch.cat(lps), (torch.cat(ents) if with_entropy else None)


def row_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    need: torch.Tensor,
    *,
    pack: bool = True,
    share: bool = True,
    chunk: int = 512,
    temperature: float = 1.0,
    with_entropy: bool = False,
    precision: str = "fp32",
    packed: Packed | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, Packed | None]:
    """Rows [rows, P+S] as in TrainingBatch -> (logprobs [rows, S], entropy [rows, S] or None,
    the pack or None), computed where `need` [rows, S] (bool) is True and 0 elsewhere.

    pack: one tree-shaped sequence (shared prefixes once when `share`), else the padded rows.
    chunk: positions per lm_head chunk (0: all at once). A model wrapped for data parallelism
    (it has `.module`) is called whole, so that DDP sees the forward: the logits of the needed
    positions only (transformers' logits_to_keep), not chunked. `packed` reuses a pack of the same
    rows (e.g. the reference model's pass after the policy's)."""
    rows, width = input_ids.shape
    S = response_length
    dev = input_ids.device
    need = need.bool().cpu()
    r_idx, t_idx = need.nonzero(as_tuple=True)
    target = input_ids[r_idx.to(dev), (width - S + t_idx).to(dev)]
    if pack and packed is None:
        packed = pack_rows(input_ids.cpu(), attention_mask.cpu(), share=share)
    if pack:
        pred = packed.node[r_idx, width - S + t_idx - 1]  # the node before each needed token
        if (pred < 0).any():
            raise ValueError("a needed response token has no real token before it in its row")
        ids, pos = packed.input_ids.to(dev), packed.position_ids.to(dev)
    else:
        pred = r_idx * width + (width - S + t_idx - 1)  # flat index into [rows * width]
        ids, pos = input_ids, position_ids
    pred = pred.to(dev)
    impl = getattr(getattr(base_lm(model), "config", None), "_attn_implementation", None)

    def forward(mask, extra):
        return _forward(model, ids, mask, pos, pred, target, width=width, pack=pack, extra=extra,
                        chunk=chunk, temperature=temperature, with_entropy=with_entropy)

    with autocast(precision, dev):
        if not pack:
            lp, ent = forward(attention_mask, {})
        else:
            lp, ent = _pack_forward(forward, packed, impl, dev, type(base_lm(model)).__name__)
    index = (r_idx.to(dev), t_idx.to(dev))
    logprobs = torch.zeros(rows, S, dtype=torch.float32, device=dev).index_put(index, lp.float())
    entropy = None
    if with_entropy:
        entropy = torch.zeros(rows, S, dtype=torch.float32, device=dev).index_put(index, ent.float())
    return logprobs, entropy, packed


def _forward(model, ids, mask, pos, pred, target, *, width, pack, extra, chunk, temperature,
             with_entropy):
    """(logprob, entropy) of `target` at the positions `pred` of one forward (row_logprobs)."""
    # DDP: the whole model is called, for DDP to see the forward; a model that scales its logits:
    # for its forward to scale them
    if hasattr(model, "module") or scales_logits(model):
        if not pack:
            keep = torch.unique(pred % width)  # the columns any row needs
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep)
            z = out.logits[pred // width, torch.searchsorted(keep, pred % width)]
        else:
            z = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=pred,
                      **extra).logits[0]
        return logprobs_from_logits(z.float(), target, temperature, with_entropy)
    decoder, head = split_lm(model)
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                     **extra).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])[pred]
    return chunked_logprobs(hidden, head, target, temperature=temperature,
                            with_entropy=with_entropy, chunk=chunk or max(1, len(pred)))


def _pack_forward(forward, packed: Packed, impl: str | None, dev, model_name: str):
    """forward(mask, extra) over a pack, its attention as pack_plan chooses: row by row (a
    stride-0 placeholder mask, the plan as the attention calls' keyword), else the dense mask; a
    model whose attention did not come through the dispatcher is computed again with the mask."""
    plan = pack_plan(packed, impl)
    if plan is not None:
        plan = plan.to(dev)
        before = plan.calls
        out = forward(sparse_pack.placeholder_mask(packed.n_tokens, dev), {sparse_pack.KWARG: plan})
        if plan.calls > before:
            return out
        if PACK_ATTENTION == "sparse":
            raise ValueError(f"{model_name}'s attention does not go through transformers' "
                             "registry: no sparse pack attention")
    return forward(attention_mask_4d(packed.allowed.to(dev), impl, torch.float32), {})


def pack_plan(packed: Packed, attn_implementation: str | None) -> SparsePlan | None:
    """The pack's row-by-row attention plan (sparse_pack.py), or None for the dense [N, N] mask:
    per PACK_ATTENTION; "auto" takes it where the model's attention is SDPA and the plan computes
    at most AUTO_SCORES of the dense mask's scores; an eager model keeps the dense mask (its
    attention weights are what eager is chosen for)."""
    mode = PACK_ATTENTION
    if mode not in ("auto", "dense", "sparse"):
        raise ValueError(f"PACK_ATTENTION {mode!r}: expected auto, dense or sparse")
    if mode == "dense":
        return None
    if attn_implementation != "sdpa" or not sparse_pack.install():
        return None
    plan = packed.sparse_plan()
    return None if mode == "auto" and plan.scores > AUTO_SCORES * plan.dense_scores else plan


def row_costs(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, share: bool = True) -> torch.Tensor:
    """[rows] int64: the tokens each row adds to a pack that holds the rows before it: its real
    tokens, less (with `share`) those it shares from its start with the previous row. Summed over
    consecutive rows this bounds the pack's N from above (a row may share more with an earlier one)."""
    real = attention_mask.bool()
    counts = real.sum(1)
    if not share or input_ids.shape[0] < 2:
        return counts.to(torch.int64)
    costs = [int(counts[0])]
    prev = input_ids[0][real[0]]
    for i in range(1, input_ids.shape[0]):
        cur = input_ids[i][real[i]]
        k = min(prev.numel(), cur.numel())
        diff = (prev[:k] != cur[:k]).nonzero()
        common = int(diff[0]) if diff.numel() else k
        costs.append(cur.numel() - common)
        prev = cur
    return torch.tensor(costs, dtype=torch.int64)


def default_pack_tokens(model: torch.nn.Module) -> int:
    """4 x the model's hidden size d (2304 for SmolLM2-135M): per token and layer a pack's dense
    attention costs 2*N*d multiply-adds against ~12*d^2 for the matmuls, 2/3 of them at N = 4d."""
    hidden = getattr(getattr(base_lm(model), "config", None), "hidden_size", None)
    return 4 * int(hidden) if hidden else 4096
