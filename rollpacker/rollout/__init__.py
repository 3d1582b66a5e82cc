"""Rollout engines behind one contract (``engine.py``): TorchEngine, VLLMEngine (in-process, CPU or
GPU), SGLangEngine (GPU; CPU for tests, docs/sglang.md). :func:`build_engine` picks one by
``EngineConfig.kind``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Engine


def build_engine(config: EngineConfig, model_path: str | Path, device: torch.device | str,
                 dtype: torch.dtype, tp_mesh: DeviceMesh | None = None) -> Engine:
    """This rank's rollout engine (replica or TP shard) of ``config.kind`` (``auto``: see
    :func:`~rollpacker.rollout.config.resolve_kind`), loaded from the Hugging Face directory
    ``model_path``. Imports the chosen engine only."""
    import torch

    from rollpacker.rollout.config import resolve_kind

    tp = tp_mesh.size() if tp_mesh is not None else 1
    kind = resolve_kind(config.kind, torch.device(device).type)
    if kind == "torch":
        from rollpacker.model import load_model
        from rollpacker.rollout.torch_engine import TorchEngine

        return TorchEngine(load_model(model_path, device, dtype), config, tp_mesh)
    if kind == "vllm":
        from rollpacker.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, config, tp_size=tp, dtype=dtype)
    if kind == "sglang":
        from rollpacker.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(model_path, config, tp_mesh=tp_mesh, dtype=dtype)
    raise ValueError(f"engine.kind must be auto, torch, vllm or sglang, got {config.kind!r}")
