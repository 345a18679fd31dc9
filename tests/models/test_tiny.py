"""The tiny toolkit: tokenizer (numbers, losslessness, ChatML, determinism) and model (size, ties)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jinja2.exceptions import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

from tracetrain.models.tiny import (
    MIN_VOCAB_SIZE,
    build_model,
    build_tokenizer,
    save_tiny,
    train_bpe,
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids_of(tok, messages, **kw):
    return tok.apply_chat_template(messages, tokenize=True, **kw)["input_ids"]


def test_every_number_up_to_100_is_one_token(tok):
    for n in range(101):
        ids = tok.encode(str(n))
        assert len(ids) == 1, (n, tok.convert_ids_to_tokens(ids))
        assert tok.decode(ids) == str(n)
    # inside text the number is cut from the words around it, still one token
    ids = tok.encode("guess 42, or 7?")
    assert "42" in tok.convert_ids_to_tokens(ids) and "7" in tok.convert_ids_to_tokens(ids)


def test_special_tokens_and_sizes(tok):
    assert len(tok) == 512
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.encode("<|im_start|>user")[0] == 1  # special strings map to their single id


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_any_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chatml_rendering_is_exact(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Guess 1..8"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "higher"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nGuess 1..8<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>tool\nhigher<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tok.apply_chat_template(messages, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_tool_calls_and_content_parts_render(tok):
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"e": "2+2"}'},
                }
            ],
        },
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\n2+2?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "calc", "arguments": {"e": "2+2"}}</tool_call>'
        "<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    with_tools = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}],
        tools=tools,
        tokenize=False,
    )
    assert with_tools.startswith("<|im_start|>system\nS\n\n# Tools\n")
    assert '{"type": "function", "function": {"name": "calc", "parameters": {}}}' in with_tools
    assert with_tools.count("<|im_start|>system") == 1
    assert with_tools.endswith("<|im_start|>user\nu<|im_end|>\n")


def test_unknown_role_is_an_error_naming_it(tok):
    with pytest.raises(TemplateError, match="wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


@settings(max_examples=60, deadline=None)
@given(
    st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Zs", "Cc"]),
        min_size=1,
        max_size=20,
    ),
    st.text(max_size=20),
)
def test_next_turn_prompt_extends_previous_context(tok, reply, observation):
    """Prompt of turn 2 = prompt of turn 1 + the reply's ids + <|im_end|> + the new messages' ids:
    what trajectory-level aggregation relies on when the model's reply is canonically tokenized."""
    turn1 = [{"role": "user", "content": "Guess a number."}]
    prompt1 = ids_of(tok, turn1, add_generation_prompt=True)
    response = tok.encode(reply) + [tok.eos_token_id]
    turn2 = turn1 + [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": observation},
    ]
    prompt2 = ids_of(tok, turn2, add_generation_prompt=True)
    assert prompt2[: len(prompt1) + len(response)] == prompt1 + response


def test_build_is_deterministic_across_processes(tok):
    # no transformers import
    code = "from tracetrain.models.tiny import train_bpe; print(train_bpe().to_str())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == train_bpe().to_str()
    assert build_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()
    assert tok.get_vocab() == train_bpe().get_vocab()


def test_custom_corpus_changes_merges_and_small_vocab_is_refused():
    a = build_tokenizer(["zebra zebra zebra quokka"] * 20, vocab_size=400)
    assert len(a) < 400  # a small corpus runs out of merges before the bound
    assert len(a.encode("zebra")) == 1 and len(a.encode(" quokka")) == 1
    assert len(build_tokenizer().encode(" quokka")) > 1
    with pytest.raises(ValueError, match="vocab_size is 300"):
        build_tokenizer(vocab_size=300)
    assert MIN_VOCAB_SIZE == 3 + 256 + 101


def test_model_is_small_tied_and_seeded(tok):
    m = build_model(tok)
    n = sum(p.numel() for p in m.parameters())
    assert 0.5e6 < n < 1.0e6, n
    assert m.get_input_embeddings().weight.data_ptr() == m.get_output_embeddings().weight.data_ptr()
    assert m.config.vocab_size == len(tok) and m.config.eos_token_id == tok.eos_token_id
    same = build_model(tok, seed=0)
    other = build_model(tok, seed=1)
    w = m.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(w, same.model.layers[0].self_attn.q_proj.weight)
    assert not torch.equal(w, other.model.layers[0].self_attn.q_proj.weight)
    bigger = build_model(tok, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1)
    assert bigger.config.intermediate_size == 192 and len(bigger.model.layers) == 2


def test_save_and_load_with_auto_classes_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = build_model(tok, seed=3)
    save_tiny(tmp_path, tok, model)
    tok2 = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    model2 = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True)
    text = "abc123 guess 42, then 100 or 1000. é"
    assert tok2.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert ids_of(tok2, msgs, add_generation_prompt=True) == ids_of(
        tok, msgs, add_generation_prompt=True
    )
    assert tok2.eos_token_id == tok.eos_token_id and tok2.pad_token_id == tok.pad_token_id
    x = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(x).logits, model2.eval()(x).logits)
