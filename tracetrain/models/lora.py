"""LoRA (with peft): the policy is the frozen base weights plus a low-rank adapter; only the
adapter trains, is checkpointed and is synced.

    W' = W + (alpha / r) · B A        A: r × d_in (random), B: d_out × r (zero at the start: W' = W)

for each linear layer named in `model.lora.target_modules`. The local engine decodes with the
same module (base + adapter, nothing copied); `merged(model)` is the plain model with W' in place
of W, for `run_dir/policy` and for anything that does not know peft. A vLLM engine serves
`base(model)` and takes the adapter alone after each update (engines/vllm.py, LoraTransport).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from tracetrain.config import ConfigError, LoraConfig


def wrap(model: torch.nn.Module, lc: LoraConfig) -> torch.nn.Module:
    """`model` with a fresh adapter on `lc.target_modules`; its base parameters frozen; in eval
    mode, as everything that decodes or scores with it expects (peft leaves the adapter's modules
    in training mode: the adapter's dropout would act on the first rollouts; the update, the warm
    start and SFT set training mode around their own passes)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    config = PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                            target_modules=list(lc.target_modules), task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config).eval()
    except ValueError as e:  # e.g. a target module the model does not have
        raise ConfigError(f"config key 'model.lora.target_modules': {e}") from None


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: the adapter's under LoRA, else all."""
    return [p for p in model.parameters() if p.requires_grad]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: the adapter under LoRA (the base never changes),
    else the whole state dict."""
    if is_lora(model):
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return model.state_dict()


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `weights`."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model, state)
    unexpected = getattr(result, "unexpected_keys", None)
    if unexpected:
        raise ValueError(f"adapter weights with keys the model's adapter lacks: {unexpected[:4]}")


def base(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model without the adapter (a copy of the frozen base weights), for
    a vLLM server that applies the adapter itself. Not under LoRA: the model itself."""
    if not is_lora(model):
        return model
    return copy.deepcopy(model).unload()


def merged(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model with the adapter merged into the base weights (a copy; the
    policy keeps its adapter). Not under LoRA: the model itself."""
    if not is_lora(model):
        return model
    return copy.deepcopy(model).merge_and_unload()
