"""The policy as a Hugging Face directory (config, weights, tokenizer with its chat template,
generation config), loadable by transformers and servable by vLLM as it is: what a run leaves as
run_dir/policy and what the vllm engine loads after each update (models/load.py reads it back).

Tied embeddings: a model whose output layer shares the input embedding is written untied
(lm_head.weight stored, tie_word_embeddings false). From a tied checkpoint as save_pretrained
writes it (no lm_head.weight), vLLM 0.32's in-place reload left the output layer on the old
weights (greedy output after a reload differed from transformers' on the new weights; the
regression test in tests/engines/test_engine_vllm.py fails that way); with lm_head.weight stored the
reload reaches both. The logits are the same; the file holds the vocab x hidden matrix twice.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def untied_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every tensor its own (shared ones, e.g. tied embeddings,
    copied), contiguous and on the CPU: what safetensors stores."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        t = t.detach()
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        t = t.clone() if key in seen else t
        seen.add(key)
        out[name] = t.to("cpu").contiguous()
    return out


def untied_config(model: torch.nn.Module):
    config = copy.deepcopy(model.config)
    for c in {id(config): config, id(config.get_text_config()): config.get_text_config()}.values():
        if getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    return config


def write_weights(model: torch.nn.Module, directory: str | Path) -> Path:
    """DIR/model.safetensors from the model (untied), written beside and renamed: a reader never
    sees half a file."""
    from safetensors.torch import save_file

    path = Path(directory) / WEIGHTS_FILE
    tmp = path.with_name(WEIGHTS_FILE + ".tmp")
    save_file(untied_state_dict(model), str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def write_hf_dir(model: torch.nn.Module, tokenizer, directory: str | Path) -> Path:
    """The policy as a Hugging Face directory (config, weights, tokenizer with its chat template,
    generation config): loadable by transformers and servable by vLLM as it is."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.safetensors*"):  # e.g. shards of an earlier save_pretrained
        stale.unlink()
    untied_config(model).save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    write_weights(model, directory)
    return directory
