"""The model's training-side settings (no torch import: configs parse before heavy imports).

:class:`MemoryConfig` is how :func:`~rollpacker.model.parallelize.parallelize` holds a trained model
(precision, activation checkpointing, offload, LoRA adapters); the trainer's config extends it, so
its options stay ``train.*``. The memory plan (:mod:`rollpacker.plan.memory`) reads the same fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollpacker.choices import check_choices


@dataclass(kw_only=True)
class LoraConfig:
    """LoRA (rollpacker.model.lora): only low-rank adapters train; the base stays frozen."""

    rank: int = 0
    """Rank of the adapters (0 = off: every weight trains)."""
    alpha: float = 16.0
    """Scaling numerator: an adapter adds (alpha / rank) x B A to its weight."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Linear layers that get adapters, by module name ("all-linear": every linear but the output head)."""
    export_merged: bool = False
    """At export, also write the merged weights as a whole Hugging Face model (run_dir/hf_merged)."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.alpha <= 0:
            raise ValueError(f"train.lora: rank must be >= 0 (got {self.rank}) and alpha > 0 (got {self.alpha})")
        if self.rank and not self.target_modules:
            raise ValueError("train.lora.target_modules is empty: name the linear layers to adapt (e.g. q_proj v_proj)")
        bad = [m for m in self.target_modules if m in ("lm_head", "embed_tokens")]
        if bad:
            raise ValueError(f"train.lora.target_modules names {bad}: rollpacker adapts the decoder layers' linears "
                             "only (the output head and embedding can be tied); drop them")
        if "all-linear" in self.target_modules and len(self.target_modules) > 1:  # PEFT: a name matching nothing
            raise ValueError(f"train.lora.target_modules={list(self.target_modules)}: all-linear is every linear "
                             "already; give it alone, or name the linears without it")


@dataclass(kw_only=True)
class MemoryConfig:
    """How the trained model is held in memory (``train.*``)."""

    mixed_precision: bool = True
    """bf16 compute with fp32 master weights and gradient reduction, on GPU only (CPU stays fp32)."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """Recompute activations in backward: none, full (every block) or selective (see ac_every and ac_part)."""
    ac_every: int = 2
    """selective: checkpoint every this many blocks (1: all of them)."""
    ac_part: Literal["block", "attention", "mlp"] = "block"
    """selective: what a checkpointed block recomputes: the whole block, its attention or its MLP."""
    offload: bool = False
    """Keep parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy); the KL reference too."""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_choices(self, "train")
        if self.ac_every <= 0:
            raise ValueError(f"train.ac_every must be positive, got {self.ac_every}")
