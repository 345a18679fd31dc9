"""A GGUF model's tokenizer as its model was trained with it (tracetrain.models.load.gguf_tokenizer):
transformers drops the file's pre-tokenizer (tokenizer.ggml.pre); SmolLM2's ("smollm") splits
digits one by one before the byte-level split. The expected ids are llama.cpp's for the same file
(llama-cpp-python 0.3, `Llama(vocab_only=True).tokenize(text, add_bos=False)`, 2026-12-02), which
transformers' plain load does not give for the strings with spaces before digits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

LLAMA_CPP_IDS = {
    "x = [1,  2,   3]": [104, 446, 933, 33, 28, 256, 34, 28, 333, 35, 77],
    "12*7 + 305": [33, 34, 26, 39, 1232, 216, 35, 32, 37],
    "  42 apples": [256, 36, 34, 13855],
    "The year 2026.": [504, 713, 216, 34, 32, 34, 38, 30],
    "a\n\n  9": [81, 39892, 41],
}


@pytest.fixture(scope="module")
def smollm2():
    import real_tokenizers

    try:
        return real_tokenizers.smollm2()  # tracetrain.models.load.gguf_tokenizer, cached
    except real_tokenizers.MissingPackage as e:
        pytest.fail(f"{e} (scripts/test.sh installs it)")


@pytest.mark.parametrize("text", list(LLAMA_CPP_IDS))
def test_smollm2_from_gguf_tokenizes_as_llama_cpp(smollm2, text):
    assert smollm2.encode(text, add_special_tokens=False) == LLAMA_CPP_IDS[text]


@settings(max_examples=200, deadline=None)
@given(text=st.text(st.sampled_from("0123456789 abc.\n"), max_size=30))
def test_digits_are_single_tokens_and_text_round_trips(smollm2, text):
    ids = smollm2.encode(text, add_special_tokens=False)
    pieces = [smollm2.decode([i]) for i in ids]
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
    assert smollm2.decode(ids) == text
