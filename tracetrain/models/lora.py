"""LoRA (with peft): the policy is the frozen base weights plus a low-rank adapter; only the
adapter trains, is checkpointed and is synced.

    W' = W + (alpha / r) · B A        A: r × d_in (random), B: d_out × r (zero at the start: W' = W)

for each layer named in `model.lora.target_modules`, by default every linear projection of the
model's decoder blocks, as its architecture names them (`default_targets`: the attention's and the
MLP's, q/k/v/o_proj and gate/up/down_proj of a Llama, phi3's fused qkv_proj and gate_up_proj,
lfm2's conv in_proj/out_proj and w1/w2/w3, ...); a MoE's experts and router are left alone
unless named (transformers' fused experts are not linear modules). The local engine decodes with the
same module (base + adapter, nothing copied); `merged(model)` is the plain model with W' in place
of W, for `run_dir/policy` and for anything that does not know peft. A vLLM engine serves
`base(model)` and takes the adapter alone after each update (engines/vllm.py, LoraTransport).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from tracetrain.config import ConfigError, LoraConfig

# path parts of modules a default adapter leaves alone: a MoE's experts and router, the heads
_NOT_DEFAULT = frozenset({"experts", "router", "gate", "shared_expert_gate", "lm_head", "score"})


def _linear(module: torch.nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D  # (GPT-2's linear layers)

    return isinstance(module, (torch.nn.Linear, Conv1D))


def default_targets(model: torch.nn.Module) -> list[str]:
    """The names (last part, in the model's order) of its linear layers outside the output head,
    a MoE's experts and its router: the decoder blocks' projections (module docstring)."""
    head = model.get_output_embeddings()
    names: list[str] = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if module is not head and _linear(module) and not _NOT_DEFAULT.intersection(parts):
            if parts[-1] not in names:
                names.append(parts[-1])
    return names


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)  # (peft's rule for a list of names)


def peft_config(model: torch.nn.Module, lc: LoraConfig, key: str):
    """peft's LoraConfig for `lc` on `model`: the named targets, each checked to match a module,
    or `default_targets` (modules of the same name under experts or a router excluded);
    ConfigError naming `key` (the config key of `lc.target_modules`) otherwise."""
    from peft import LoraConfig as PeftLoraConfig

    names = [n for n, _ in model.named_modules()]
    exclude: list[str] = []
    if lc.target_modules is None:
        targets = default_targets(model)
        if not targets:
            raise ConfigError(f"config key '{key}': the model ({type(model).__name__}) has no "
                              "linear projections to adapt by default; name its target modules")
        exclude = [n for n in names if _NOT_DEFAULT.intersection(n.split(".")[:-1])
                   and any(_matches(n, t) for t in targets)]
    else:
        targets = list(lc.target_modules)
        for t in targets:
            if not any(_matches(n, t) for n in names):
                raise ConfigError(f"config key '{key}': {t!r} matches no module of the model "
                                  f"(its linear layers: {default_targets(model)})")
    return PeftLoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                          target_modules=targets, exclude_modules=exclude or None,
                          task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, lc: LoraConfig) -> torch.nn.Module:
    """`model` with a fresh adapter on `lc.target_modules` (`peft_config`); its base parameters
    frozen; in eval mode, as everything that decodes or scores with it expects (peft leaves the
    adapter's modules in training mode: the adapter's dropout would act on the first rollouts;
    the update, the warm start and SFT set training mode around their own passes)."""
    from peft import get_peft_model

    config = peft_config(model, lc, "model.lora.target_modules")
    try:
        return get_peft_model(model, config).eval()
    except ValueError as e:  # e.g. a target module of a kind peft cannot adapt
        raise ConfigError(f"config key 'model.lora.target_modules': {e}") from None


def wrap_policies(model: torch.nn.Module, adapters: dict[str, LoraConfig]) -> torch.nn.Module:
    """`model` with one fresh adapter per policy (config `policies`), named by it, made in the
    order given; the base frozen; in eval mode (as `wrap`). A forward pass runs the active adapter
    (`model.set_adapter(name)`, which also makes its parameters alone require a gradient), or one
    per row with `adapter_names=[...]` (peft; BASE for a row without one)."""
    from peft import get_peft_model

    configs = {name: peft_config(model, lc, f"policies.{name}.lora.target_modules")
               for name, lc in adapters.items()}  # (on the plain model: peft changes it)
    for k, (name, config) in enumerate(configs.items()):
        try:
            if k == 0:
                model = get_peft_model(model, config, adapter_name=name)
            else:
                model.add_adapter(name, config)
        except ValueError as e:  # e.g. a target module of a kind peft cannot adapt
            raise ConfigError(f"config key 'policies.{name}.lora.target_modules': {e}") from None
    model.set_adapter(next(iter(adapters)))
    return model.eval()


@contextlib.contextmanager
def base_trainable(model: torch.nn.Module):
    """Within: a forward pass is the base model's alone (every adapter off) and the base's
    parameters require a gradient, so a warm start trains the base that every policy shares;
    as before after."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    with model.disable_adapter():
        for p in frozen:
            p.requires_grad_(True)
        try:
            yield model
        finally:
            for p in frozen:
                p.requires_grad_(False)


BASE = "__base__"  # peft's name for "no adapter" in a mixed batch's adapter_names


def is_lora(model: Any) -> bool:
    return hasattr(model, "peft_config")


def adapter_names(model: Any) -> list[str]:
    """The adapters of a model with several policies (wrap_policies), in order; [] for a model
    with one policy (a plain model, or `wrap`'s single adapter "default")."""
    names = list(getattr(model, "peft_config", {}))
    return [] if names in ([], ["default"]) else names


def policy_parameters(model: torch.nn.Module, name: str) -> list[torch.nn.Parameter]:
    """The parameters of adapter `name` (what policy `name`'s optimizer updates)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = []
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            for layer in module.adapter_layer_names:
                part = getattr(module, layer)
                if name in part:
                    out += (list(part[name].parameters()) if isinstance(part[name], torch.nn.Module)
                            else [part[name]])
    if not out:
        raise ValueError(f"the model has no adapter {name!r} (it has {adapter_names(model)})")
    return out


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters an optimizer updates: the adapter's under LoRA, else all."""
    return [p for p in model.parameters() if p.requires_grad]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint keeps of the policy: the adapter under LoRA (the base never changes),
    else the whole state dict."""
    if is_lora(model):
        from peft import get_peft_model_state_dict

        if names := adapter_names(model):  # several policies: {policy: its adapter's}
            return {name: {k: v.detach().clone() for k, v in
                           get_peft_model_state_dict(model, adapter_name=name).items()} for name in names}
        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}
    return model.state_dict()


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Inverse of `weights`."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    from peft import set_peft_model_state_dict

    names = adapter_names(model)
    if names and sorted(state) != sorted(names):
        raise ValueError(f"adapter weights of policies {sorted(state)}; the model's are {sorted(names)}")
    for name, part in ([(n, state[n]) for n in names] or [("default", state)]):
        result = set_peft_model_state_dict(model, part, adapter_name=name)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"adapter weights with keys the model's adapter lacks: {unexpected[:4]}")


def base(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model without the adapter (a copy of the frozen base weights), for
    a vLLM server that applies the adapter itself. Not under LoRA: the model itself."""
    if not is_lora(model):
        return model
    return copy.deepcopy(model).unload()


def merged(model: torch.nn.Module, adapter: str | None = None) -> torch.nn.Module:
    """The plain transformers model with the adapter (with several policies: `adapter`) merged
    into the base weights (a copy; the policy keeps its adapter). Not under LoRA: the model itself."""
    if not is_lora(model):
        return model
    if adapter is None:
        return copy.deepcopy(model).merge_and_unload()
    return copy.deepcopy(model).merge_and_unload(adapter_names=[adapter])
