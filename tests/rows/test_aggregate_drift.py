"""Drift: each kind of prefix break is classified correctly, with exact positions and recomputed
token counts (recomputed = prompt tokens of the new row as placed in the batch)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracetrain.rows.aggregate import aggregate
from tracetrain.rows.drift import break_position, classify_break, first_difference
from tracetrain.types import Rollout, Turn
from tracetrain.view.trace_rows import build_demo_tokenizer

P0 = list(range(10, 20))  # 10 prompt tokens
R0 = list(range(20, 25))  # 5 response tokens at context positions 10..14
OBS = [30, 31]


def two_turns(prompt1, response1=(40, 41)):
    return Rollout("r", "g", [Turn(P0, R0), Turn(list(prompt1), list(response1))], reward=1.0)


def run(rollouts, tokenizer=None, **kw):
    kw.setdefault("max_prompt_length", 1000)
    kw.setdefault("max_response_length", 1000)
    return aggregate(rollouts, tokenizer=tokenizer, return_breaks=True, **kw)


# (name, turn-1 prompt, kind, position, recomputed)
ID_CASES = [
    ("system prompt edited", P0[:3] + [99] + P0[4:] + R0 + OBS, "context_rewrite", 3, 17),
    ("oldest context dropped", P0[4:] + R0 + OBS, "context_rewrite", 0, 13),
    ("prompt end rewritten", P0[:9] + [98] + R0 + OBS, "context_rewrite", 9, 17),
    ("tool call re-serialized", P0 + [20, 21, 98, 23, 24] + OBS, "assistant_rewrite", 12, 17),
    ("reasoning stripped", P0 + R0[2:] + OBS, "assistant_rewrite", 10, 15),
    ("response cut at the end", P0 + R0[:3], "assistant_rewrite", 13, 13),
    ("last response token changed", P0 + R0[:4] + [97] + OBS, "assistant_rewrite", 14, 17),
]


@pytest.mark.parametrize(
    "name,prompt1,kind,position,recomputed", ID_CASES, ids=[c[0] for c in ID_CASES]
)
def test_break_kind_position_and_recomputed_count(name, prompt1, kind, position, recomputed):
    batch, m, breaks = run([two_turns(prompt1)])
    assert batch.n_rows == 2 and batch.turn_index.tolist() == [0, 1]
    (b,) = breaks
    assert (b.rollout_id, b.turn_index, b.kind, b.position, b.recomputed_tokens) == (
        "r",
        1,
        kind,
        position,
        recomputed,
    )
    assert m["breaks/total"] == 1 and m[f"breaks/{kind}"] == 1
    assert m[f"recomputed_tokens/{kind}"] == recomputed
    other = {"context_rewrite", "assistant_rewrite", "retokenization"} - {kind}
    assert all(m[f"breaks/{k}"] == 0 and m[f"recomputed_tokens/{k}"] == 0 for k in other)
    assert (
        "context ids" in b.snippet
        and str(prompt1[position] if position < len(prompt1) else "") in b.snippet
    )


def test_a_clean_extension_is_no_break():
    batch, m, breaks = run([two_turns(P0 + R0 + OBS)])
    assert batch.n_rows == 1 and breaks == [] and m["breaks/total"] == 0
    batch, m, breaks = run([two_turns(P0 + R0)])  # no observation in between: still merged
    assert batch.n_rows == 1 and breaks == []


def test_counts_add_up_over_a_batch_and_rows_follow_breaks():
    rs = []
    for i, (_, prompt1, *_rest) in enumerate(ID_CASES):
        r = two_turns(prompt1)
        r.rollout_id = f"r{i}"
        rs.append(r)
    batch, m, breaks = run(rs)
    assert [b.rollout_id for b in breaks] == [f"r{i}" for i in range(len(ID_CASES))]
    assert (
        m["breaks/context_rewrite"] == 3 and m["recomputed_tokens/context_rewrite"] == 17 + 13 + 17
    )
    assert (
        m["breaks/assistant_rewrite"] == 4
        and m["recomputed_tokens/assistant_rewrite"] == 17 + 15 + 13 + 17
    )
    assert m["n_multi_row_rollouts"] == len(ID_CASES) and m["max_rows_per_rollout"] == 2
    assert m["n_rows"] == 2 * len(ID_CASES)


def test_recomputed_counts_the_truncated_prompt_of_the_new_row():
    _, m, (b,) = run([two_turns(ID_CASES[0][1])], max_prompt_length=12, overlong="truncate")
    assert b.recomputed_tokens == 12 and m["recomputed_tokens/context_rewrite"] == 12
    assert m["truncated/prompt_tokens"] == 17 - 12


def test_response_spans_survive_a_break_in_the_unchanged_prefix():
    # Turn 1 changes the last token of response 0: the first 4 response tokens (context 10..13)
    # stay a model response in the new row's prompt. Turn 2 then edits context position 11.
    p1 = P0 + R0[:4] + [97] + OBS  # 17 tokens; response 1 at 17..18
    r1 = [40, 41]
    ctx1 = p1 + r1
    inside_old_response = ctx1[:11] + [96] + ctx1[12:] + [33]
    inside_old_prompt = ctx1[:5] + [96] + ctx1[6:] + [33]
    for p2, kind, pos in (
        (inside_old_response, "assistant_rewrite", 11),
        (inside_old_prompt, "context_rewrite", 5),
    ):
        r = Rollout("r", "g", [Turn(P0, R0), Turn(p1, r1), Turn(p2, [42])])
        _, _, breaks = run([r])
        assert [(b.turn_index, b.kind, b.position, b.recomputed_tokens) for b in breaks] == [
            (1, "assistant_rewrite", 14, 17),
            (2, kind, pos, 20),
        ]


def test_classify_break_rejects_a_prompt_that_extends_the_context():
    with pytest.raises(ValueError, match="no break"):
        classify_break([1, 2], [1, 2, 3], [])


def naive_first_difference(a, b):
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return min(len(a), len(b))


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), max_size=200),
    b_tail=st.lists(st.integers(0, 3), max_size=80),
    cut=st.integers(0, 200),
)
def test_first_difference_matches_a_naive_scan(a, b_tail, cut):
    b = a[: min(cut, len(a))] + b_tail  # long shared prefixes exercise the bisection
    assert first_difference(a, b) == naive_first_difference(a, b)
    assert first_difference(b, a) == naive_first_difference(a, b)


@settings(max_examples=200, deadline=None)
@given(
    prev_prompt=st.lists(st.integers(0, 3), min_size=1, max_size=120),
    prev_response=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    tail=st.lists(st.integers(0, 3), max_size=40),
    cut=st.integers(0, 200),
)
def test_break_position_matches_a_naive_scan_of_the_joined_context(
    prev_prompt, prev_response, tail, cut
):
    """The break position found over (prompt, response) without joining them is the naive one."""
    context = prev_prompt + prev_response
    prompt = context[: min(cut, len(context))] + tail  # edits anywhere, or a clean extension
    want = naive_first_difference(context, prompt)
    assert break_position(prev_prompt, prev_response, prompt) == want


# ------------------------------------------------------------------ with a real tokenizer

SYSTEM = "<|system|>You are a careful agent. Use the calculator tool.<|end|>"
USER = "<|user|>What is 17 + 25?<|end|><|assistant|>"
CORPUS = [SYSTEM + USER + "I will use the calculator now.<|end|><|tool|>result: 42<|end|>"] * 3


@pytest.fixture(scope="module")
def tok():
    return build_demo_tokenizer(CORPUS)


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def sampled_response(tok):
    """'I will use the calculator now.<|end|>' as a model might sample it: 'calcu' + 'lator'."""
    ids = enc(tok, "I will use the calcu") + enc(tok, "lator now.<|end|>")
    canonical = enc(tok, "I will use the calculator now.<|end|>")
    assert ids != canonical and tok.decode(ids) == tok.decode(canonical)  # precondition of the case
    return ids, canonical


def test_retokenization_same_text_other_ids(tok):
    p0 = enc(tok, SYSTEM + USER)
    r0, canonical = sampled_response(tok)
    p1 = enc(
        tok,
        SYSTEM
        + USER
        + "I will use the calculator now.<|end|><|tool|>result: 42<|end|><|assistant|>",
    )
    rollout = Rollout("r", "g", [Turn(p0, r0), Turn(p1, enc(tok, "The answer is 42.<|end|>"))])
    _, m, (b,) = run([rollout], tokenizer=tok)
    position = len(p0) + naive_first_difference(r0, canonical)
    assert (b.kind, b.position, b.recomputed_tokens) == ("retokenization", position, len(p1))
    assert m["breaks/retokenization"] == 1 and m["recomputed_tokens/retokenization"] == len(p1)
    assert "calcu" in b.snippet and "context" in b.snippet
    # Without a tokenizer the same ids can only be placed: the change is in a model response.
    _, _, (b,) = run([rollout])
    assert (b.kind, b.position) == ("assistant_rewrite", position)


@pytest.mark.parametrize(
    "changed_tool_text,changed_answer,kind",
    [
        ("result: 42 (cached)", "ok.", "context_rewrite"),
        ("result: 42", "okay.", "assistant_rewrite"),
    ],
)
def test_real_rewrite_after_a_retokenization_is_placed_by_text(
    tok, changed_tool_text, changed_answer, kind
):
    # Turn 0's response is retokenized in later prompts AND later text was changed: the kind
    # follows where the text changed, not the earlier harmless id difference.
    p0 = enc(tok, SYSTEM + USER)
    r0, _ = sampled_response(tok)
    obs1 = enc(tok, "<|tool|>result: 42<|end|><|assistant|>")
    p1 = p0 + r0 + obs1  # recorded with the model's own ids: merged
    r1 = enc(tok, "ok.<|end|>")
    text2 = (
        SYSTEM + USER + "I will use the calculator now.<|end|>"
        f"<|tool|>{changed_tool_text}<|end|><|assistant|>{changed_answer}<|end|>"
        "<|user|>thanks<|end|><|assistant|>"
    )
    p2 = enc(tok, text2)
    rollout = Rollout("r", "g", [Turn(p0, r0), Turn(p1, r1), Turn(p2, enc(tok, "bye<|end|>"))])
    batch, _, (b,) = run([rollout], tokenizer=tok)
    assert batch.turn_index.tolist() == [0, 2]
    assert (b.turn_index, b.kind, b.recomputed_tokens) == (2, kind, len(p2))
    assert b.position == len(p0) + naive_first_difference(
        r0, enc(tok, "I will use the calculator now.<|end|>")
    )
