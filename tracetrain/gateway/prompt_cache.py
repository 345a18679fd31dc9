"""Prompt ids without re-rendering or re-tokenizing what the gateway has seen before.

Two caches, both exact (the ids are those of `apply_chat_template(..., tokenize=True)`):

1. Whole prompts. The chat template is a pure function of (messages, tools), so the ids of a
   request whose messages and tools equal an earlier one's are that one's ids: the rollouts of a
   group (GRPO's n samples of one task) open with the same prompt, and single-turn tasks are only
   that. An LRU keyed by the JSON of (messages, tools), off for templates that read the clock
   (`strftime_now`), cleared if the tokenizer's template changes.

2. Pieces. A multi-turn agent sends its whole history on every call, so most of each rendered
   prompt is text the gateway has tokenized before. A fast
   (Rust) tokenizer splits its input at added tokens *before* normalizing, pre-tokenizing and
   running the model, and encodes each piece between them on its own. So for a special token s
   that nothing else can overlap,

       encode(A + s + B) == encode(A) + [id(s)] + encode(B)

   and a prompt is the concatenation of its pieces' ids, split at those tokens (ChatML's
   <|im_start|> / <|im_end|>: one piece per message). The ids of recent pieces are kept (an LRU
   bounded in characters); only the pieces not seen before are encoded: the new messages.

The split is used only for tokens where it is exact, checked once per tokenizer (`cut_tokens`):
a special token that is not stripped, not normalized, not single-word, that no other added token
overlaps (so the tokenizer's leftmost-longest match cannot pick something else around it), and on
which probe strings split exactly against `tokenizer.encode` (this catches pre-tokenizers that
treat the start of the input differently, e.g. Metaspace's prepend_scheme="first"). Anything else
(a slow tokenizer, split_special_tokens, truncation or padding left set on the backend) encodes the
whole text with `tokenizer.encode(text, add_special_tokens=False)`, which is also the reference the
probes and the tests compare with.
"""

from __future__ import annotations

import re
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from tracetrain.gateway.jsonbytes import dumps

_PROBES_BEFORE = ["", "a", "Hello world", " ", "\n", "x\n\n", "12", "é", "<", "|"]
_PROBES_AFTER = ["", "a", "hello", " hi", "\n", "\n\nx y", "7 8", "é", "  ", ">", "|>"]


def _truth(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _truths(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """[_truth(tokenizer, t) for t in texts], in one batch call of the tokenizer."""
    batch = tokenizer(texts, add_special_tokens=False, return_attention_mask=False,
                      return_token_type_ids=False)
    return [list(ids) for ids in batch["input_ids"]]


def _substrings(s: str) -> set[str]:
    return {""} | {s[i:j] for i in range(len(s)) for j in range(i + 1, len(s) + 1)}


def _overlapped(contents: list[str]) -> set[str]:
    """The contents that another content overlaps: one holds the other, or a proper prefix of one
    is a suffix of the other. From counts, over the distinct contents, of the contents holding
    each string, starting with it and ending with it (a linear pass), not by comparing pairs:
    added tokens number in the thousands (DeepSeek: 1,283)."""
    whole = set(contents)
    holders: Counter[str] = Counter()
    prefixes: Counter[str] = Counter()
    suffixes: Counter[str] = Counter()
    for c in whole:
        holders.update(_substrings(c))
        prefixes.update(c[:k] for k in range(1, len(c) + 1))
        suffixes.update(c[-k:] for k in range(1, len(c) + 1))
    out = set()
    for s in whole:  # each count below includes s's own: another overlaps s when one is higher
        if (
            holders[s] > 1  # another holds s
            or any(part in whole for part in _substrings(s) if part != s)  # s holds another
            or any(suffixes[s[:k]] > s.endswith(s[:k]) for k in range(1, len(s)))  # ends in s
            or any(prefixes[s[-k:]] > s.startswith(s[-k:]) for k in range(1, len(s)))  # s ends in
        ):
            out.add(s)
    return out


def cut_tokens(tokenizer: Any) -> dict[str, int]:
    """{text: id} of the special tokens at which prompts can be split exactly ({} if none)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or not getattr(tokenizer, "is_fast", False)
        or getattr(tokenizer, "split_special_tokens", False)
    ):
        return {}
    added = backend.get_added_tokens_decoder()  # {id: AddedToken}
    counts = Counter(t.content for t in added.values())
    overlapped = _overlapped(list(counts))
    candidates = [
        (tid, tok.content)
        for tid, tok in added.items()
        if tok.special and not (tok.lstrip or tok.rstrip or tok.single_word or tok.normalized)
        and tok.content and counts[tok.content] == 1 and tok.content not in overlapped
    ]
    pairs = [(a, b) for a in _PROBES_BEFORE for b in _PROBES_AFTER]
    try:
        before = dict(zip(_PROBES_BEFORE, _truths(tokenizer, _PROBES_BEFORE), strict=True))
        after = dict(zip(_PROBES_AFTER, _truths(tokenizer, _PROBES_AFTER), strict=True))
    except Exception:  # a tokenizer that cannot encode a probe is not one to be clever with
        return {}
    try:  # every candidate's probes in one call
        whole = _truths(tokenizer, [a + s + b for _, s in candidates for a, b in pairs])
    except Exception:  # one candidate's probe cannot be encoded: find whose, one at a time
        whole = None
    cuts: dict[str, int] = {}
    for n, (tid, s) in enumerate(candidates):
        if whole is not None:
            probed = whole[n * len(pairs) : (n + 1) * len(pairs)]
        else:
            try:
                probed = _truths(tokenizer, [a + s + b for a, b in pairs])
            except Exception:  # not one to be clever with
                continue
        if all(got == before[a] + [tid] + after[b] for got, (a, b)
               in zip(probed, pairs, strict=True)):
            cuts[s] = tid
    return cuts


class PromptEncoder:
    """Prompt ids for one tokenizer, from the two caches of the module docstring.

    chat_ids(messages, tools, render)  the ids of render() (the chat template's text) for them
    encode(text)                       == tokenizer.encode(text, add_special_tokens=False)

    Memory is bounded: each cache holds at most `max_bytes` (ids as int32, 4 bytes each, plus
    the text or key and ~100 bytes per entry), evicting the least recently used. Not
    thread-safe: one per event loop."""

    def __init__(self, tokenizer: Any, *, max_bytes: int = 8 << 20):
        self.tokenizer = tokenizer
        self.cuts = cut_tokens(tokenizer)
        self.max_bytes = max_bytes
        self._pieces: OrderedDict[str, array] = OrderedDict()
        self._pieces_bytes = 0
        self.hits = self.misses = 0  # pieces
        self._template = getattr(tokenizer, "chat_template", None)
        self._clock = "strftime_now" in str(self._template)
        self._prompts: OrderedDict[bytes, array] = OrderedDict()
        self._prompts_bytes = 0
        self.prompt_hits = self.prompt_misses = 0
        if self.cuts:
            alternatives = sorted(self.cuts, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(map(re.escape, alternatives)) + ")").split
            self._backend = tokenizer.backend_tokenizer

    def _prompt_key(self, messages: list[dict], tools: list[dict] | None) -> bytes | None:
        template = getattr(self.tokenizer, "chat_template", None)
        if template is not self._template:  # a new template: what was rendered no longer holds
            self._template, self._clock = template, "strftime_now" in str(template)
            self._prompts.clear()
            self._prompts_bytes = 0
        if self._clock:  # the date is part of the prompt
            return None
        try:
            return dumps((messages, tools))
        except TypeError:  # not JSON at all (an object no encoder writes): no key, just render
            return None

    def chat_ids(
        self, messages: list[dict], tools: list[dict] | None, render: Callable[[], str]
    ) -> list[int]:
        """The ids of the chat template's `render()` for (messages, tools), cached."""
        key = self._prompt_key(messages, tools)
        got = None if key is None else self._prompts.get(key)
        if got is not None:
            self.prompt_hits += 1
            self._prompts.move_to_end(key)
            return got.tolist()
        self.prompt_misses += 1
        ids = self.encode(render())
        if key is not None:  # a copy: orjson's bytes keep a 4 KB buffer behind a short key
            key = bytes(memoryview(key))
            self._prompts_bytes += self._keep(
                self._prompts, key, array("i", ids), self._prompts_bytes
            )
        return ids

    def _keep(self, cache: OrderedDict, key: Any, ids: array, used: int) -> int:
        """Put (key, ids) in `cache`, evicting old entries to stay within max_bytes; returns the
        change in bytes used."""
        size = len(key) + 4 * len(ids) + 100
        if size > self.max_bytes // 8:  # a huge entry would evict everything else
            return 0
        cache[key] = ids
        change = size
        while used + change > self.max_bytes:
            old_key, old = cache.popitem(last=False)
            change -= len(old_key) + 4 * len(old) + 100
        return change

    def _direct(self) -> bool:
        """True when the backend is as `tokenizer.encode` would set it (no truncation, padding or
        special-token splitting left on it by another caller)."""
        b = self._backend
        return b.truncation is None and b.padding is None and not b.encode_special_tokens

    def encode(self, text: str) -> list[int]:
        if not self.cuts or not self._direct():
            return _truth(self.tokenizer, text)
        pieces, cuts, cache = self._split(text), self.cuts, self._pieces
        ids: list[int] = []
        for k, piece in enumerate(pieces):  # piece, cut, piece, cut, ..., piece
            if k & 1:
                ids.append(cuts[piece])
            elif piece:
                got = cache.get(piece)
                if got is None:
                    got = self._miss(piece)
                else:
                    self.hits += 1
                    cache.move_to_end(piece)
                ids.extend(got)
        return ids

    def _miss(self, piece: str) -> list[int]:
        self.misses += 1
        got = self._backend.encode(piece, add_special_tokens=False).ids
        self._pieces_bytes += self._keep(self._pieces, piece, array("i", got), self._pieces_bytes)
        return got
