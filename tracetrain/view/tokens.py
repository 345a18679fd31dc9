"""Token ids as the text a reader sees, one piece per token.

    token_pieces(tokenizer, ids, known) -> [(text, whole)]    (known: a dict kept per tokenizer)

`text` is the token decoded alone; where that is not whole text (a byte-level token holding part
of a multi-byte character decodes to U+FFFD) it is the tokenizer's own name for the token (e.g.
`âĢ`) and `whole` is False, so the page marks it. Without a tokenizer a token is its id. Pieces
are plain strings: the page escapes them (a trace's `<script>` is printed, never run).
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


def token_pieces(tokenizer, ids: Sequence[int], known: dict[int, tuple[str, bool]]) -> list[tuple[str, bool]]:
    """The pieces of `ids`; `known` caches the pieces of ids seen before (the same tokenizer's)."""
    if tokenizer is None:
        return [(f"{i} ", True) for i in ids]
    new = sorted({i for i in ids if i not in known})
    if new:
        texts = tokenizer.batch_decode([[i] for i in new], skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False)
        names = tokenizer.convert_ids_to_tokens(new)
        for i, text, name in zip(new, texts, names, strict=True):
            if REPLACEMENT in text and name is not None and REPLACEMENT not in name:
                known[i] = (name, False)
            else:
                known[i] = (text, True)
    return [known[i] for i in ids]
