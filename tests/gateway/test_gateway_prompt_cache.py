"""The prompt caches give exactly the ids of `apply_chat_template(..., tokenize=True)`: whole
prompts seen before, and prompts split at special tokens with the pieces' ids reused. Splitting is
refused for tokenizers where it would not be exact."""

from __future__ import annotations

import pytest
from gateway_fixtures import tiny_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tracetrain.gateway.prompt_cache import (
    _PROBES_AFTER,
    _PROBES_BEFORE,
    PromptEncoder,
    _overlapped,
    cut_tokens,
)
from tracetrain.models.tiny import CHAT_TEMPLATE

FRAGMENTS = [
    "hello",
    " world",
    "Guess 42",
    "100",
    " ",
    "  ",
    "\n",
    "\n\n",
    "é",
    "数字",
    "🙂",
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
    "<|im_",
    "|>",
    "<",
    "assistant\n",
]
TEXT = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), max_size=8).map("".join), st.text(max_size=30)
)
MESSAGE = st.builds(
    lambda role, content: {"role": role, "content": content},
    st.sampled_from(["system", "user", "assistant", "tool"]),
    TEXT,
)


_SHARED: list[PromptEncoder] = []


def shared_encoder() -> PromptEncoder:
    """One encoder for the property tests: its caches fill up across examples, so later examples
    also check answers that come from pieces and prompts cached by earlier ones."""
    if not _SHARED:
        _SHARED.append(PromptEncoder(tiny_tokenizer()))
    return _SHARED[0]


def reference(tok, messages, tools=None) -> list[int]:
    kw = {"tools": tools} if tools else {}
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"])


def cached(enc: PromptEncoder, messages, tools=None) -> list[int]:
    def render():
        kw = {"tools": tools} if tools else {}
        return enc.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kw
        )

    return enc.chat_ids(messages, tools, render)


def test_chatml_special_tokens_are_the_cut_points():
    assert cut_tokens(tiny_tokenizer()) == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


@settings(max_examples=150, deadline=None)
@given(text=TEXT)
def test_encode_equals_the_tokenizer(text):
    enc = shared_encoder()
    truth = enc.tokenizer.encode(text, add_special_tokens=False)
    assert enc.encode(text) == truth
    assert enc.encode(text) == truth  # again, from the cached pieces


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(st.lists(MESSAGE, min_size=1, max_size=3), min_size=1, max_size=5))
def test_multi_turn_chat_ids_equal_a_full_render(turns):
    """A growing conversation (each call = the history + new messages), each call made twice:
    every answer equals apply_chat_template(tokenize=True) on the same messages."""
    enc = shared_encoder()
    tok = enc.tokenizer
    history: list[dict] = []
    for new in turns:
        history = history + new
        truth = reference(tok, history)
        assert cached(enc, history) == truth
        hits = enc.prompt_hits
        assert cached(enc, history) == truth
        assert enc.prompt_hits == hits + 1  # the second call was answered from the cache


def test_a_new_turn_encodes_only_its_new_messages():
    tok = tiny_tokenizer()
    enc = PromptEncoder(tok)
    history = [
        {"role": "system", "content": "You are playing a game. Guess the secret number."},
        {"role": "user", "content": "I am thinking of a number between 1 and 100."},
    ]
    assert cached(enc, history) == reference(tok, history)
    for k, answer in enumerate(["50", "75", "62"]):
        history += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Higher, attempt {k}."},
        ]
        misses = enc.misses
        assert cached(enc, history) == reference(tok, history)
        assert enc.misses - misses == 2  # the two new messages; the history came from the cache


def test_tools_are_part_of_the_prompt_key():
    tok = tiny_tokenizer()
    enc = PromptEncoder(tok)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {}}}]
    assert cached(enc, msgs) == reference(tok, msgs)
    assert cached(enc, msgs, tools) == reference(tok, msgs, tools) != reference(tok, msgs)
    assert cached(enc, msgs) == reference(tok, msgs)


def test_a_new_template_clears_the_prompt_cache_and_a_clock_template_is_never_cached():
    tok = tiny_tokenizer()
    saved = tok.chat_template
    enc = PromptEncoder(tok)
    msgs = [{"role": "user", "content": "hi"}]
    try:
        assert cached(enc, msgs) == reference(tok, msgs)
        tok.chat_template = "{{ 'PREFIX ' }}" + CHAT_TEMPLATE
        assert cached(enc, msgs) == reference(tok, msgs)
        tok.chat_template = "{{ strftime_now('%Y') }}" + CHAT_TEMPLATE
        for _ in range(2):
            assert cached(enc, msgs) == reference(tok, msgs)
        assert enc.prompt_hits == 0
    finally:
        tok.chat_template = saved


def test_backend_state_left_by_another_caller_falls_back_to_the_tokenizer():
    tok = tiny_tokenizer()
    enc = PromptEncoder(tok)
    text = "<|im_start|>user\nhello<|im_end|>\n"
    before = enc.misses
    tok.backend_tokenizer.encode_special_tokens = True  # what split_special_tokens=True leaves
    try:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
    finally:
        tok.backend_tokenizer.encode_special_tokens = False
    tok.backend_tokenizer.enable_padding(length=64)
    try:
        assert enc.encode(text) == tok.encode(text, add_special_tokens=False)
    finally:
        tok.backend_tokenizer.no_padding()
    assert enc.misses == before  # neither call went through the pieces


def test_memory_is_bounded():
    tok = tiny_tokenizer()
    enc = PromptEncoder(tok, max_bytes=16 * 1024)
    for k in range(500):
        msgs = [{"role": "user", "content": f"message number {k} " * 3}]
        ids = cached(enc, msgs)
        assert k % 50 or ids == reference(tok, msgs)
    assert enc._prompts_bytes <= enc.max_bytes and enc._pieces_bytes <= enc.max_bytes
    assert 0 < len(enc._prompts) < 500 and 0 < len(enc._pieces) < 500
    msgs = [{"role": "user", "content": "message number 499 " * 3}]  # the newest is still there
    hits = enc.prompt_hits
    assert cached(enc, msgs) == reference(tok, msgs) and enc.prompt_hits == hits + 1


# ----------------------------------------------------------- tokenizers where splitting is not exact


def _bpe(pre_tokenizer, specials: list[AddedToken]) -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.BPE(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizer
    corpus = ["hello world", "a b c", "hi there", "Guess again"] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=["[UNK]"]))
    raw.add_special_tokens(specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _metaspace_first():
    sp = pre_tokenizers.Metaspace(prepend_scheme="first")
    return _bpe(sp, [AddedToken(t, special=True, normalized=False) for t in ("<s1>", "<s2>")])


@pytest.mark.parametrize(
    ("name", "make", "expect"),
    [
        # Metaspace prepends "▁" at the start of the input only: a piece encoded on its own
        # would get one it does not get inside the prompt.
        ("metaspace first", _metaspace_first, set()),
        (
            "rstrip",
            lambda: _bpe(
                pre_tokenizers.Whitespace(),
                [
                    AddedToken("<s1>", special=True, normalized=False, rstrip=True),
                    AddedToken("<s2>", special=True, normalized=False),
                ],
            ),
            {"<s2>", "[UNK]"},
        ),
        (
            "overlapping added tokens",
            lambda: _bpe(
                pre_tokenizers.Whitespace(),
                [
                    AddedToken("<s1>", special=True, normalized=False),
                    AddedToken("<s1>\n", special=True, normalized=False),
                    AddedToken("<s2>", special=True, normalized=False),
                ],
            ),
            {"<s2>", "[UNK]"},
        ),
    ],
)
def test_splitting_is_refused_where_it_would_not_be_exact(name, make, expect):
    tok = make()
    assert set(cut_tokens(tok)) == expect
    enc = PromptEncoder(tok)
    for text in ["<s1>\nhello<s2> world", "hi<s2>there<s1>  a b", "<s1><s2>hello world"]:
        for _ in range(2):
            assert enc.encode(text) == tok.encode(text, add_special_tokens=False), (name, text)


def _overlaps_pairwise(contents: list[str]) -> set[str]:
    """The definition, pair by pair: s is overlapped when another content holds it, it holds
    another, or a proper prefix of one is a suffix of the other."""
    whole = set(contents)
    return {
        s
        for s in whole
        if any(
            s in o or o in s or any(o.endswith(s[:k]) or s.endswith(o[:k]) for k in range(1, len(s)))
            for o in whole
            if o != s
        )
    }


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(alphabet="<|>ab", max_size=6), max_size=12))
def test_overlapped_contents_are_those_of_the_pairwise_definition(contents):
    assert _overlapped(contents) == _overlaps_pairwise(contents)


@pytest.mark.parametrize(
    "name", [pytest.param("deepseek", marks=pytest.mark.slow), "qwen", "smollm2"]  # ~30 s: 135k encodes
)
def test_cut_tokens_of_real_tokenizers_are_checked_one_token_at_a_time_too(name):
    """cut_tokens checks every candidate's probes in one batch; the same check token by token,
    with tokenizer.encode (the reference), keeps the same tokens. DeepSeek has 1,283 added tokens,
    two of them overlapped by others."""
    import real_tokenizers

    tok = getattr(real_tokenizers, name)()
    added = tok.backend_tokenizer.get_added_tokens_decoder()
    contents = [t.content for t in added.values()]
    overlapped = _overlapped(contents)  # as the pairwise definition (the property test above)

    def truth(text):
        return tok.encode(text, add_special_tokens=False)

    expect = {
        t.content: tid
        for tid, t in added.items()
        if t.special and not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        and t.content and contents.count(t.content) == 1 and t.content not in overlapped
        and all(truth(a + t.content + b) == truth(a) + [tid] + truth(b)
                for a in _PROBES_BEFORE for b in _PROBES_AFTER)
    }
    assert cut_tokens(tok) == expect and len(expect) > 0
