"""LoRA on the trainer's model (``train.lora``): PEFT's LoRA linears, sharded with FSDP2.

- :func:`apply` puts PEFT's ``lora.Linear`` in place of the targeted linears of the native decoder
  or of an :class:`~rollpacker.model.hf_decoder.HFDecoder` (``peft.inject_adapter_in_model``: no
  wrapper, the model keeps its class and calling convention) and freezes everything else. It runs
  before :func:`~rollpacker.model.parallelize.parallelize`, so each block's adapters are sharded
  with it; the optimizer then holds the adapters alone.
- :func:`merged_weights` is what the engines receive through the weight-sync seam: every base
  weight under its own name, ``W + (alpha / r) B A`` where an adapter sits, sharded like ``W``.
  No engine knows about LoRA.
- :class:`AdaptersOff` is the KL reference: the same model with its adapters switched off, so the
  base weights are held once.
- :func:`save_adapter` writes a PEFT adapter directory (``adapter_config.json``,
  ``adapter_model.safetensors``) that ``peft.PeftModel.from_pretrained`` loads on the base model.

Parameter names gain PEFT's ``base_layer`` (``q_proj.base_layer.weight``) and adapters
(``q_proj.lora_A.default.weight``); :func:`base_name` maps back to the checkpoint's names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from rollpacker.errors import UserError
from rollpacker.model.config import LoraConfig

ADAPTER = "default"
"""PEFT's adapter name (one adapter per model)."""


def apply(model: nn.Module, config: LoraConfig) -> nn.Module:
    """Adapters on ``config.target_modules`` of ``model`` (in place; returned), the rest frozen.
    On the meta device the adapters are on meta too (filled by the sharded load)."""
    try:
        import peft
    except ImportError:
        raise ImportError("train.lora needs PEFT: pip install 'rollpacker[lora]' (or peft)") from None
    names = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name != "lm_head"]
    linears = sorted({name.rpartition(".")[2] for name in names})
    named = [t for t in config.target_modules if t != "all-linear"]
    if named and not any(n == t or n.endswith("." + t) for n in names for t in named):  # PEFT's match rule
        # said once, as the user's to fix: PEFT's ValueError was a traceback on every rank
        raise UserError(f"train.lora.target_modules names {', '.join(named)}, none of them a linear layer of the "
                        f"model: name some of {', '.join(linears)}, or all-linear")
    try:
        peft.inject_adapter_in_model(peft_config(config), model)
    except ValueError as e:
        raise UserError(f"train.lora.target_modules={list(config.target_modules)}: {e}") from None
    # PEFT also adapts a MoE's fused experts (3-D parameters, not linears): merge() knows W + B A only
    unmerged = list(dict.fromkeys(name.split(".base_layer")[0] for name, m in lora_layers(model).items()
                                  if not isinstance(m, peft.tuners.lora.Linear)))
    if unmerged:
        raise UserError(f"train.lora.target_modules={list(config.target_modules)} adapts the fused experts of "
                        f"{len(unmerged)} MoE layers ({unmerged[0]}, ...), which rollpacker cannot merge into the "
                        "weights the engines get: name linears outside the experts, e.g. "
                        "train.lora.target_modules q_proj k_proj v_proj o_proj")
    return model


def peft_config(config: LoraConfig, **extra):
    """``train.lora`` as PEFT's ``LoraConfig`` (the output head never adapted)."""
    import peft

    targets = "all-linear" if config.target_modules == ("all-linear",) else list(config.target_modules)
    return peft.LoraConfig(r=config.rank, lora_alpha=config.alpha,
                           target_modules=targets, exclude_modules=["lm_head"], **extra)


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Module name -> PEFT LoRA layer, in ``model``'s order (empty without adapters: PEFT not imported)."""
    if not has_adapters(model):
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapters(model: nn.Module) -> bool:
    return any(is_adapter(name) for name, _ in model.named_parameters())


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A parameter's name in the base model: PEFT's ``.base_layer`` dropped."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merge(layer: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight + scaling B A`` of a LoRA ``layer``. A DTensor ``weight`` gives a DTensor of its
    placements: B's rows are sharded as the weight's (FSDP2 shards dim 0 of both alike), A (r x in)
    is gathered whole, so this rank computes its own rows only."""
    a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
    scale = layer.scaling[ADAPTER]
    if not hasattr(weight, "to_local"):
        return weight + scale * (b @ a).to(weight.dtype)
    from torch.distributed.tensor import DTensor

    if b.placements != weight.placements:
        raise RuntimeError(f"LoRA merge: B is sharded as {b.placements}, its weight as {weight.placements}")
    local = weight.to_local() + scale * (b.to_local() @ a.full_tensor().to(b.to_local().device)).to(weight.dtype)
    return DTensor.from_local(local, weight.device_mesh, weight.placements, shape=weight.shape,
                              stride=weight.stride())


def merged_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights the engines hold, by base name, in ``model``'s order: each parameter as it is,
    adapted weights merged (:func:`merge`: collective over the training mesh), adapters left out.
    Without adapters, ``model.named_parameters()``."""
    layers = lora_layers(model)
    for name, param in model.named_parameters():
        if is_adapter(name):
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        yield base_name(name), merge(layers[owner], param) if leaf == "weight" and owner in layers else param


def engine_shapes(model: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of :func:`merged_weights`, without merging anything."""
    return [(base_name(n), tuple(p.shape)) for n, p in model.named_parameters() if not is_adapter(n)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """``model`` runs as its base inside. Only PEFT's flag is set: PEFT's ``enable_adapters`` also
    flips the adapters' ``requires_grad``, which FSDP2 copies into its unsharded parameters once,
    at their first all-gather (a reference forward first would freeze them for good)."""
    layers = list(lora_layers(model).values())
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


class AdaptersOff:
    """The policy with its adapters off, called like it: the KL reference of a LoRA run (no second
    copy of the base weights). Not a module: its parameters are the policy's."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.logit_softcap = model.logit_softcap

    def __call__(self, *args, **kwargs):
        with adapters_disabled(self.model):
            return self.model(*args, **kwargs)


def hf_name(model: nn.Module, name: str) -> str:
    """A parameter's name in the ``transformers`` causal LM: the native decoder's gain ``model.``."""
    from rollpacker.model.transformer import Transformer

    return f"model.{name}" if isinstance(model, Transformer) and not name.startswith("lm_head") else name


def save_adapter(model: nn.Module, config: LoraConfig, path: Path, base: Path, *, write: bool) -> None:
    """``model``'s adapters as a PEFT adapter directory for the base model at ``base``. Collective
    (sharded adapters are gathered); ``write`` on the one rank that writes."""
    from safetensors.torch import save_file

    state = {}
    for name, param in model.named_parameters():
        if is_adapter(name):
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            key = "base_model.model." + hf_name(model, name).replace(f".{ADAPTER}.", ".")
            state[key] = full.detach().to("cpu", torch.float32).contiguous()
    if not write:
        return
    path.mkdir(parents=True, exist_ok=True)
    peft_config(config, task_type="CAUSAL_LM", base_model_name_or_path=str(base.resolve())).save_pretrained(
        str(path))  # resolved: a relative path resolves only from where the run started
    save_file(state, path / "adapter_model.safetensors", metadata={"format": "pt"})
