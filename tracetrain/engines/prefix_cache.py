"""A radix tree over token ids holding the KV of prompt prefixes, per model version and adapter,
bounded by a memory budget with the least recently used entries evicted first.

Contract:
- One tree per (model version, adapter): rows decoded by different LoRA adapters share no KV (their
  keys and values differ), and KV of one version never answers another (`clear` on new weights;
  a lookup under a version the tree has not seen drops the other versions' trees too).
- A node holds an edge: `ids` (n >= 1 token ids following its parent's prefix) and `kv`, one
  (key, value) pair per layer, each [1, K, n, D] (K kv heads, D head dim; the model's dtype and
  device), or None while the node is planned but not computed yet. The KV of a prefix is its
  path's edges concatenated along the sequence dimension (`path_kv`): a prefix shared by several
  prompts is stored once, at the node where they part.
- `match` is the longest prefix of ids whose KV is stored (it may end inside an edge);
  `insert` makes the tree hold the whole of ids (splitting an edge where ids leave it; new nodes
  have kv None until the caller `store`s theirs) and returns the path (a later insert may split
  it: `path(its last node)` is the path then).
- Every match, insert and store marks the nodes on the path used now; `evict` removes leaves,
  least recently used first, until the stored KV takes at most `budget` bytes. A node is used no
  earlier than its descendants, so removing leaves in that order is LRU over whole prefixes.
  Nothing is evicted between `evict` calls: a batch's prefill plans, computes and reads its
  prefixes, then evicts (the budget bounds what is kept between batches).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from typing import Any

import torch

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: key, value [1, K, n, D]


class Node:
    __slots__ = ("ids", "kv", "children", "parent", "used")

    def __init__(self, ids: tuple[int, ...], parent: Node | None):
        self.ids, self.parent = ids, parent
        self.kv: KV | None = None
        self.children: dict[int, Node] = {}
        self.used = 0

    @property
    def nbytes(self) -> int:
        if self.kv is None:
            return 0
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n, k = min(len(a), len(b)), 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


class PrefixCache:
    """Radix tree of prefix KV (module docstring). `budget`: bytes of KV kept after `evict`."""

    def __init__(self, budget: int):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"the prefix cache's budget must be an int >= 0 (bytes), got {budget!r}")
        self.budget = budget
        self.roots: dict[tuple[int, Any], Node] = {}
        self.nbytes = 0
        self._clock = itertools.count(1)

    def clear(self) -> None:
        """Forget every prefix (their KV came from weights that changed)."""
        self.roots, self.nbytes = {}, 0

    def _root(self, version: int, adapter: Any) -> Node:
        if any(v != version for v, _ in self.roots):
            self.clear()
        return self.roots.setdefault((version, adapter), Node((), None))

    def _touch(self, node: Node) -> None:
        t = next(self._clock)
        while node is not None:
            node.used = t
            node = node.parent

    def match(self, version: int, adapter: Any, ids: Sequence[int]) -> int:
        """The number of leading tokens of `ids` whose KV is stored (0..len(ids))."""
        node, k = self._root(version, adapter), 0
        while k < len(ids):
            child = node.children.get(ids[k])
            if child is None or child.kv is None:
                break
            j = _common(child.ids, ids[k : k + len(child.ids)])
            k += j
            node = child
            if j < len(child.ids):
                break
        if k:
            self._touch(node)
        return k

    def insert(self, version: int, adapter: Any, ids: Sequence[int]) -> list[Node]:
        """The path of nodes (root excluded) that spells exactly `ids`, made where missing."""
        node, k, path = self._root(version, adapter), 0, []
        while k < len(ids):
            child = node.children.get(ids[k])
            if child is None:
                child = Node(tuple(ids[k:]), node)
                node.children[ids[k]] = child
            else:
                j = _common(child.ids, ids[k : k + len(child.ids)])
                if j < len(child.ids):
                    child = self._split(child, j)
            path.append(child)
            k += len(child.ids)
            node = child
        if path:
            self._touch(path[-1])
        return path

    def _split(self, node: Node, j: int) -> Node:
        """Cut `node`'s edge after j tokens: the new upper node (its first j tokens) is returned."""
        upper = Node(node.ids[:j], node.parent)
        upper.used = node.used
        node.parent.children[node.ids[0]] = upper
        node.ids, node.parent = node.ids[j:], upper
        upper.children[node.ids[0]] = node
        if node.kv is not None:  # clones: each half's memory is its own (evicted apart)
            upper.kv = [(k[:, :, :j].clone(), v[:, :, :j].clone()) for k, v in node.kv]
            node.kv = [(k[:, :, j:].clone(), v[:, :, j:].clone()) for k, v in node.kv]
        return upper

    def store(self, node: Node, kv: KV) -> None:
        """Set a planned node's KV (per layer [1, K, len(node.ids), D])."""
        assert node.kv is None and all(k.shape[-2] == len(node.ids) for k, _ in kv)
        node.kv = kv
        self.nbytes += node.nbytes
        self._touch(node)

    @staticmethod
    def path(node: Node | None) -> list[Node]:
        """The nodes from the root (excluded) down to `node`: a path `insert` returned may have
        been split by a later insert; its last node still ends the same prefix."""
        out = []
        while node is not None and node.ids:
            out.append(node)
            node = node.parent
        return out[::-1]

    @staticmethod
    def path_kv(node: Node | None, n: int | None = None) -> KV | None:
        """The KV of the prefix that ends at `node` (all of its edge, or its first n tokens):
        per layer [1, K, length, D]; None for the root (no tokens)."""
        chain = PrefixCache.path(node)
        if not chain:
            return None
        parts = [nd.kv for nd in chain]
        if n is not None:
            parts[-1] = [(k[:, :, :n], v[:, :, :n]) for k, v in parts[-1]]
        if len(parts) == 1:
            return parts[0]
        return [(torch.cat([p[i][0] for p in parts], dim=-2), torch.cat([p[i][1] for p in parts], dim=-2))
                for i in range(len(parts[0]))]

    def evict(self) -> list[Node]:
        """Remove least recently used leaves until at most `budget` bytes are kept; the removed
        nodes, in the order removed."""
        if self.nbytes <= self.budget:
            return []
        leaves = []
        for root in self.roots.values():
            stack = [root]
            while stack:
                nd = stack.pop()
                stack.extend(nd.children.values())
                if not nd.children and nd.ids:
                    leaves.append((nd.used, id(nd), nd))
        heapq.heapify(leaves)
        gone = []
        while self.nbytes > self.budget and leaves:
            _, _, nd = heapq.heappop(leaves)
            self.nbytes -= nd.nbytes
            parent = nd.parent
            del parent.children[nd.ids[0]]
            nd.parent = None
            gone.append(nd)
            if not parent.children and parent.ids:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        return gone

    def __len__(self) -> int:
        """Tokens whose KV is stored."""
        n = 0
        for root in self.roots.values():
            stack = [root]
            while stack:
                nd = stack.pop()
                stack.extend(nd.children.values())
                n += len(nd.ids) if nd.kv is not None else 0
        return n
