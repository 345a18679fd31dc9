"""The local engine's prefill: each prompt prefix computed once, kept in a radix tree of KV
(tracetrain/engines/prefix_cache.py) across batches and steps, per model version and adapter.

Each row's head (its prompt less the last token) is looked up, then inserted, in the tree of its
adapter (`adapters[b]`; None without LoRA); nodes without KV are the batch's new prefixes. Rows with
the same adapter and prompt (a group) are one distinct prompt until the end. Then:

1. Shared prefixes: the new nodes on the heads of two distinct prompts or more (a system prompt,
   a question asked of several prompts) are computed level by level, parents first: one forward
   pass per level, each node once, as a row
       [pad ... | its parent's prefix KV, P_n tokens] [pad ... | the node's tokens]
   with positions P_n, P_n + 1, ... A shared node shorter than MIN_SHARED_PREFIX goes into its
   shared children's rows, or, with none, into the distinct prompts' own rows of step 2 (a short
   shared prefix is not worth a forward pass of its own).
2. Distinct prompts: one forward pass, each distinct prompt a row over the KV of its longest
   computed prefix (from the tree), the rest of its head and its last token as input:
       [pad ... | cached or shared prefix, c_d tokens] [pad ... | rest of head, last token]
   positions c_d, c_d + 1, ...; its new nodes' KV goes into the tree, and the cache, the mask
   [D, P + S] and the next-token logits [D, V] are repeated to the batch's B rows (a group's rows
   share everything up to here).

The KV cache handed to the decode is that of step 2 (padding inside it is masked). The tree then
evicts least recently used prefixes down to its budget (bytes; 0: nothing kept between batches,
each batch's shared prefixes still computed once). `stats` (the engine's) counts the prompts'
tokens ("prompt_tokens"), the tokens forwarded ("prefill_tokens": padding included, a shared
prefix once) and those whose KV came from an earlier batch ("prefix_cache_tokens", per row): a
step's hit rate is prefix_cache_tokens / prompt_tokens.

The layers' KV are full attention's, every token's (a sliding-window layer's too: its mask
windows by position, engines/attention.py; engines/layers.py). A model with conv layers
(engines/layers.py: their state is not a slice of the prefix's tokens) is prefilled `plain`: each
distinct prompt whole, one forward pass, no tree.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tracetrain.engines.layers import FULL, empty_cache
from tracetrain.engines.prefix_cache import KV, Node, PrefixCache

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30  # prefix KV kept between batches (SmolLM2-135M: ~23k tokens)
MIN_SHARED_PREFIX = 8  # a shorter shared prefix is not worth a separate forward pass

# forward(input_ids [B, S], attention_mask [B, P+S], position_ids [B, S], cache, adapters) ->
# (next-token logits [B, V], cache); adapters: one adapter name per row, or None
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any, "list[str] | None"], tuple]


def _layers(cache: Any) -> list:
    layers = cache.layers
    if any(type(layer) is not DynamicLayer for layer in layers):  # (engines/layers.py's kinds)
        raise ValueError("the local engine's prefix cache keeps attention layers' KV only "
                         f"(DynamicLayer); this cache has {sorted({type(x).__name__ for x in layers})}")
    return layers


def _left_padded(kvs: list[KV | None]) -> tuple[DynamicCache | None, list[int]]:
    """One cache of len(kvs) rows, row i's KV (per layer [1, K, n_i, D]; None: no tokens)
    right-aligned in [rows, K, max n_i, D] with zeros before it (None when every row is empty),
    and the n_i. Rows that hold the same KV object are copied in together."""
    lengths = [0 if kv is None else kv[0][0].shape[-2] for kv in kvs]
    P = max(lengths)
    if P == 0:
        return None, lengths
    like = next(kv for kv in kvs if kv is not None)
    same: dict[int, list[int]] = {}
    for r, kv in enumerate(kvs):
        if kv is not None:
            same.setdefault(id(kv), []).append(r)
    layers = []
    for i, (k0, v0) in enumerate(like):
        k = k0.new_zeros((len(kvs), k0.shape[1], P, k0.shape[3]))
        v = v0.new_zeros((len(kvs), v0.shape[1], P, v0.shape[3]))
        for rows in same.values():
            kv, n = kvs[rows[0]], lengths[rows[0]]
            idx = torch.tensor(rows, device=k.device)
            k[idx, :, P - n :] = kv[i][0]
            v[idx, :, P - n :] = kv[i][1]
        layers.append((k, v))
    return DynamicCache(layers), lengths


class Prefill:
    """Prefill over a radix tree of prefixes (module docstring). `budget`: bytes of prefix KV kept
    between batches (0: none); `kinds`: the model's layer kinds (engines/layers.py; None: full
    attention); `plain`: each distinct prompt whole, without the tree."""

    def __init__(self, forward: Forward, *, pad_id: int, device: torch.device, budget: int,
                 stats: MutableMapping[str, Any], kinds: list[str] | None = None,
                 plain: bool = False):
        self.forward, self.pad_id, self.device, self.stats = forward, pad_id, device, stats
        self.tree = PrefixCache(0 if plain else budget)
        self.kinds, self.plain = kinds, plain

    def clear(self) -> None:
        """Forget the kept prefixes (their KV came from weights that changed)."""
        self.tree.clear()

    def __call__(self, prompts: list[list[int]], version: int, adapters: list[str] | None = None):
        """(next-token logits [B, V], cache, attention mask [B, C+1], position of the next token
        [B]) for `prompts`, row b decoded by adapter `adapters[b]` (None: the model as it is)."""
        if self.plain:
            return self._whole(prompts, adapters)
        try:
            return self._prefill(prompts, version, adapters)
        except BaseException:
            self.tree.clear()  # no half-planned node outlives its batch
            raise

    def _prefill(self, prompts: list[list[int]], version: int, adapters: list[str] | None):
        tree, B = self.tree, len(prompts)
        names = [None] * B if adapters is None else adapters
        heads = [p[:-1] for p in prompts]
        hits = [tree.match(version, a, h) for a, h in zip(names, heads, strict=True)]
        ends = [tree.insert(version, a, h)[-1:] for a, h in zip(names, heads, strict=True)]
        paths = [PrefixCache.path(e[0]) if e else [] for e in ends]  # (after every split)
        distinct: dict[tuple, int] = {}  # (adapter, prompt) -> its row in step 2
        row_of = [distinct.setdefault((a, tuple(p)), len(distinct))
                  for a, p in zip(names, prompts, strict=True)]
        first = []  # the first row of each distinct prompt, in the order of their rows in step 2
        for b, d in enumerate(row_of):
            if d == len(first):
                first.append(b)
        users: dict[Node, int] = {}  # new nodes: how many distinct prompts' heads pass them
        for b in first:
            for nd in paths[b]:
                if nd.kv is None:
                    users[nd] = users.get(nd, 0) + 1
        many = {nd for nd, n in users.items() if n > 1}

        def worth(nd: Node) -> bool:  # a forward pass of its own (or in a shared child's row)
            return len(nd.ids) >= MIN_SHARED_PREFIX or any(
                c in many and worth(c) for c in nd.children.values())

        shared = [nd for nd in users if nd in many and worth(nd)]  # (parents first)
        names_of = {nd: names[b] for b in first for nd in paths[b]}
        while shared:
            self._level(shared, names_of, lora=adapters is not None)
        # step 2: each distinct prompt over its longest computed prefix
        pasts, inputs, rests = [], [], []
        memo: dict[Node, KV | None] = {}
        for b in first:
            k = next((i for i, nd in enumerate(paths[b]) if nd.kv is None), len(paths[b]))
            top = paths[b][k - 1] if k else None
            if top not in memo:
                memo[top] = PrefixCache.path_kv(top)
            pasts.append(memo[top])
            rests.append(paths[b][k:])
            inputs.append([t for nd in paths[b][k:] for t in nd.ids] + prompts[b][-1:])
        logits, cache, mask, position = self._forward_rows(
            pasts, inputs, None if adapters is None else [adapters[b] for b in first])
        self._store(cache, [r + [None] for r in rests], inputs)
        if len(first) < B:  # a group's rows: the same logits and KV, repeated
            idx = torch.tensor(row_of, device=self.device)
            cache.batch_select_indices(idx)
            logits, mask, position = logits[idx], mask[idx], position[idx]
        tree.evict()
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        self.stats["prefix_cache_tokens"] += sum(hits)
        return logits, cache, mask, position[:, -1] + 1

    def _whole(self, prompts: list[list[int]], adapters: list[str] | None):
        """`plain`: one forward pass of the distinct prompts, whole (a group's rows share it)."""
        names = [None] * len(prompts) if adapters is None else adapters
        distinct: dict[tuple, int] = {}  # (adapter, prompt) -> its row
        row_of = [distinct.setdefault((a, tuple(p)), len(distinct))
                  for a, p in zip(names, prompts, strict=True)]
        inputs = [list(p) for _, p in distinct]
        logits, cache, mask, position = self._forward_rows(
            [None] * len(inputs), inputs, None if adapters is None else [a for a, _ in distinct])
        if len(inputs) < len(prompts):
            idx = torch.tensor(row_of, device=self.device)
            cache.batch_select_indices(idx)
            logits, mask, position = logits[idx], mask[idx], position[idx]
        self.stats["prompt_tokens"] += sum(len(p) for p in prompts)
        return logits, cache, mask, position[:, -1] + 1

    def _forward_rows(self, pasts: list[KV | None], inputs: list[list[int]], adapters):
        """One forward pass of rows [pad | pasts[r]] [pad | inputs[r]]: (logits [N, V], cache
        [N, K, P + S, D] per layer, mask [N, P + S], positions [N, S])."""
        dev, N, S = self.device, len(inputs), max(len(x) for x in inputs)
        cache, lengths = _left_padded(pasts)
        P = max(lengths)
        ids = torch.full((N, S), self.pad_id, dtype=torch.long)
        mask = torch.zeros((N, P + S), dtype=torch.long)
        position = torch.zeros((N, S), dtype=torch.long)
        for r, (x, n) in enumerate(zip(inputs, lengths, strict=True)):
            ids[r, S - len(x) :] = torch.tensor(x)
            mask[r, P - n : P] = 1
            mask[r, P + S - len(x) :] = 1
            position[r, S - len(x) :] = torch.arange(n, n + len(x))
            position[r, : S - len(x)] = n
        ids, mask, position = ids.to(dev), mask.to(dev), position.to(dev)
        if cache is None and self.kinds is not None and set(self.kinds) != {FULL}:
            cache = empty_cache(self.kinds)  # (not transformers' own: a sliding layer's or conv's)
        logits, cache = self.forward(ids, mask, position, cache, adapters)
        if not self.plain:
            _layers(cache)
        self.stats["prefill_tokens"] += N * S
        return logits, cache, mask, position

    def _store(self, cache, chains: list[list[Node | None]], inputs: list[list[int]]) -> None:
        """Put into the tree the KV of each row's chain of nodes (None: tokens not kept), which the
        row's input spells in order, right-aligned; a node computed twice is stored once."""
        end = cache.layers[0].keys.shape[-2]
        for r, (chain, x) in enumerate(zip(chains, inputs, strict=True)):
            at = end - len(x)
            for nd in chain:
                if nd is None:
                    break
                n = len(nd.ids)
                if nd.kv is None:
                    self.tree.store(nd, [(layer.keys[r : r + 1, :, at : at + n].clone(),
                                          layer.values[r : r + 1, :, at : at + n].clone())
                                         for layer in cache.layers])
                at += n

    def _level(self, shared: list[Node], names_of: dict[Node, Any], lora: bool) -> None:
        """One forward pass that computes the shared nodes whose parent's KV is known, a short one
        inside each of its shared children's rows (module docstring); they leave `shared`."""
        todo, chains = set(shared), []

        def expand(chain: list[Node]) -> None:
            kids = [c for c in chain[-1].children.values() if c in todo]
            if len(chain[-1].ids) < MIN_SHARED_PREFIX and kids:
                for c in kids:
                    expand(chain + [c])
            else:
                chains.append(chain)

        for nd in shared:  # (parents before children)
            if nd.parent.kv is not None or not nd.parent.ids:
                expand([nd])
        assert chains, "a shared prefix whose parent is neither computed nor shared"
        memo: dict[Node, KV | None] = {}
        for c in chains:
            if c[0].parent not in memo:
                memo[c[0].parent] = PrefixCache.path_kv(c[0].parent)
        inputs = [[t for nd in c for t in nd.ids] for c in chains]
        _, cache, _, _ = self._forward_rows([memo[c[0].parent] for c in chains], inputs,
                                            [names_of[c[0]] for c in chains] if lora else None)
        self._store(cache, chains, inputs)
        shared[:] = [nd for nd in shared if nd.kv is None]
