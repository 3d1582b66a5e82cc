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
    nccl_env: Callable[[int], dict[str, str]] | None = None
    """``(tp)``: the NCCL settings its start sets in one process only, which every rank then exports
    before its first communicator (:func:`rollpacker.dist.init_distributed`). None: it sets none."""

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


def _sglang_nccl_env(tp: int) -> dict[str, str]:
    from rollpacker.rollout.sglang_engine import nccl_env

    return nccl_env(tp)


def _load_sglang(config: EngineConfig, model_path, device, dtype, tp_mesh) -> Engine:
    import torch

    from rollpacker.rollout.sglang_engine import SGLangEngine

    return SGLangEngine(model_path, config, tp_mesh=tp_mesh, dtype=dtype,
                        **sglang_speculative_args(config, torch.device(device).type))


ENGINES: dict[str, EngineKind] = {
    "torch": EngineKind(load=_load_torch, empty=_empty_torch),
    "vllm": EngineKind(load=_load_vllm, join_world=_join_vllm, no_tp_switch=(
        "a TP switch rebuilds the engines in-process, and vLLM's TP groups are process-wide state built once from "
        "the whole world (its shutdown destroys the trainer's default process group)")),
    "sglang": EngineKind(load=_load_sglang, nccl_env=_sglang_nccl_env, no_tp_switch=(
        "a TP switch would restart SGLang's engines, and SGLang's Engine.shutdown kills every child process of the "
        "rank (the reward workers too); a start also takes 20-50 s on CPU (its processes import SGLang)")),
}
"""Every engine by ``engine.kind``: a new engine is its module and one entry here."""


def build_engine(config: EngineConfig, model_path: str | Path, device: torch.device | str,
                 dtype: torch.dtype, tp_mesh: DeviceMesh | None = None) -> Engine:
    """This rank's rollout engine (replica or TP shard) of ``config.kind`` (``auto``: see
    :func:`~rollpacker.rollout.config.resolve_kind`), loaded from the Hugging Face directory
    ``model_path``. Imports the chosen engine only."""
    import torch

    from rollpacker.rollout.config import resolve_kind

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
