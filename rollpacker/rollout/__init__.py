"""Rollout engines behind one contract (``engine.py``): TorchEngine, VLLMEngine (in-process, CPU or
GPU), SGLangEngine (GPU; CPU for tests, docs/sglang.md).

:data:`ENGINES` is the one registry: ``EngineConfig.kind`` names an entry, which says how to build
the engine and what the rest of the job may ask of it (a TP switch, process groups over the whole
world). The job and the root config ask these capabilities, never an engine's name. Nothing here
imports torch or an engine until an engine is built: configs check capabilities before that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from rollpacker.model import ModelArgs
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Engine


@dataclass(frozen=True)
class EngineKind:
    """One engine of the registry: its builders and its capabilities."""

    load: Callable[..., Engine]
    """``(config, model_path, device, dtype, tp_mesh)``: this rank's engine, loaded from a Hugging Face directory."""
    empty: Callable[..., Engine] | None = None
    """``(model_args, config, device, dtype, tp_mesh)``: an engine with no weights yet, to load from the
    trainer's live parameters (``update_weights``). None: it cannot be rebuilt in-process."""
    join_world: Callable[..., None] | None = None
    """``(model_path, config, tp, dtype)``, called on a rank that hosts no engine: join the process
    groups over the whole world that the engines' start makes. None: the start makes none."""
    no_tp_switch: str = ""
    """Why the planner cannot rebuild it at another TP (an engine without ``empty``)."""
    package: str = ""
    """The package it needs beyond torch (``auto`` on GPU picks it only when installed)."""
    own_drafter: bool = False
    """It drafts by itself (n-gram over the request's own context): the controller offers no drafts."""
    native_only: bool = False
    """It runs rollpacker's native decoder only (Llama, Qwen2, Qwen3), not a Hugging Face model."""
    releases_weights: bool = False
    """``release_memory`` frees its weights too, not only the KV cache (nothing of it stays while training)."""

    @property
    def supports_tp_switch(self) -> bool:
        """The parallelism planner may rebuild it at another TP, in-process, from the trainer's weights."""
        return self.empty is not None

    @property
    def needs_world_groups(self) -> bool:
        """Ranks without an engine must join its start (one_step_off's training pool)."""
        return self.join_world is not None


def _load_torch(config: EngineConfig, model_path, device, dtype, tp_mesh) -> Engine:
    from rollpacker.model import load_model
    from rollpacker.rollout.torch_engine import TorchEngine

    return TorchEngine(load_model(model_path, device, dtype), config, tp_mesh)


def _empty_torch(args: ModelArgs, config: EngineConfig, device, dtype, tp_mesh) -> Engine:
    from rollpacker.model import empty_model
    from rollpacker.rollout.torch_engine import TorchEngine

    return TorchEngine(empty_model(args, device, dtype), config, tp_mesh)


def _load_vllm(config: EngineConfig, model_path, device, dtype, tp_mesh) -> Engine:
    from rollpacker.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, config, tp_size=tp_mesh.size() if tp_mesh is not None else 1, dtype=dtype)


def _join_vllm(model_path, config: EngineConfig, tp: int, dtype) -> None:
    from rollpacker.rollout.vllm_engine import join_parallel_state

    join_parallel_state(model_path, config, tp, dtype)


def _load_sglang(config: EngineConfig, model_path, device, dtype, tp_mesh) -> Engine:
    import torch

    from rollpacker.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(model_path, config, tp_mesh=tp_mesh, dtype=dtype,
                        **sglang_speculative_args(config, torch.device(device).type))


ENGINES: dict[str, EngineKind] = {
    "torch": EngineKind(load=_load_torch, empty=_empty_torch, native_only=True),
    "vllm": EngineKind(load=_load_vllm, join_world=_join_vllm, package="vllm", own_drafter=True,
                       releases_weights=True, no_tp_switch=(
        "a TP switch rebuilds the engines in-process, and vLLM's TP groups are process-wide state built once from "
        "the whole world (its shutdown destroys the trainer's default process group)")),
    "sglang": EngineKind(load=_load_sglang, package="sglang", own_drafter=True, releases_weights=True, no_tp_switch=(
        "a TP switch would restart SGLang's engines, and SGLang's Engine.shutdown kills every child process of the "
        "rank (the reward workers too); a start also takes 20-50 s on CPU (its processes import SGLang)")),
}
"""Every engine by ``engine.kind``: a new engine is its module and one entry here."""

AUTO_ORDER = {"cuda": ("sglang", "vllm", "torch"), "cpu": ("torch", "vllm")}
"""What ``engine.kind=auto`` prefers, by device: on CPU TorchEngine, the faster there (``bench
engine``: 2.0x vLLM's CPU build at batch 32 on the toy model); on GPU SGLang, then vLLM, when installed."""


def resolve_kind(kind: str, device_type: str, planner: bool = False, native: bool = True) -> str:
    """The engine ``kind`` runs: itself, or for ``auto`` the first of :data:`AUTO_ORDER` that fits.
    ``planner``: it must allow a TP switch; ``native``: the model is rollpacker's native decoder
    (else a Hugging Face one). On GPU an engine whose package is missing is passed over."""
    if kind != "auto":
        return kind
    from importlib.util import find_spec

    cuda = device_type == "cuda"
    for name in AUTO_ORDER["cuda" if cuda else "cpu"]:
        engine = ENGINES[name]
        if (planner and not engine.supports_tp_switch) or (engine.native_only and not native):
            continue
        if not cuda or not engine.package or find_spec(engine.package) is not None:
            return name
    raise ValueError(f"engine.kind=auto found no engine for this {'HF ' if not native else ''}model on "
                     f"{device_type}{' with the planner' if planner else ''}: install one (bash launch/install.sh)")


def build_engine(config: EngineConfig, model_path: str | Path, device: torch.device | str,
                 dtype: torch.dtype, tp_mesh: DeviceMesh | None = None) -> Engine:
    """This rank's rollout engine (replica or TP shard) of ``config.kind`` (``auto``: see
    :func:`resolve_kind`), loaded from the Hugging Face directory ``model_path``. Imports the chosen
    engine only."""
    import torch

    return ENGINES[resolve_kind(config.kind, torch.device(device).type)].load(config, model_path, device, dtype,
                                                                              tp_mesh)


def sglang_speculative_args(config: EngineConfig, device_type: str) -> dict:
    """SGLang server arguments for ``engine.speculative``: its NGRAM drafts (the request's own
    context), ``engine.spec_max_tokens`` per step. SGLang runs NGRAM on CUDA only."""
    if config.speculative == "off":
        return {}
    if device_type != "cuda":
        raise ValueError(f"engine.speculative={config.speculative!r} with engine.kind=sglang on {device_type}: "
                         "SGLang's NGRAM speculative decoding runs on CUDA only; set engine.speculative=off")
    return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": config.spec_max_tokens,
            "speculative_ngram_max_match_window_size": 8}
