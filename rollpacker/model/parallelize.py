"""How the decoder is split across devices, for rollout and for training.

Rollout: Megatron-style tensor parallelism with DTensor; each TP rank keeps its slice of the heads
and of the KV cache. Training (:func:`parallelize`): activation checkpointing per block, then FSDP2
per block, then the root, as torchtitan orders it.

Invariants:

- Loading never puts the whole model on a device: :func:`load_sharded` fills a sharded meta model
  from the state dict one rank holds in host memory.
- Parameter names do not change with checkpointing on or off.
- With ``train.lora`` the adapters go in first, so each block's adapters shard with it.
- The native :class:`~rollpacker.model.transformer.Transformer` and
  :class:`~rollpacker.model.hf_decoder.HFDecoder` both offer ``layers`` with ``self_attn`` and ``mlp``.

Why one function per side: every model takes the same split, and weight pushes, checkpoints and
the export see the same names. Settings and their memory: ``docs/memory.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollpacker.model.config import MemoryConfig
from rollpacker.model.transformer import Transformer


def checkpointed(num_layers: int, mode: str, every: int, part: str) -> list[tuple[int, str]]:
    """(block index, part) of every module that ``train.activation_checkpointing`` recomputes in
    backward: none; full, every block whole; selective, blocks 0, k, 2k, ... (k = ``ac_every``), the
    whole block or its ``ac_part``."""
    if mode == "none":
        return []
    if mode == "full":
        every, part = 1, "block"
    return [(i, part) for i in range(0, num_layers, every)]


def apply_rollout_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shard ``model`` in place over the 1-D ``tp_mesh``."""
    tp, args = tp_mesh.size(), model.args
    if args.num_kv_heads % tp:
        raise ValueError(f"rollout TP={tp} does not divide num_key_value_heads={args.num_kv_heads}")
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(args.num_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, tp_mesh, plan)
    model.tie_weights()  # both sides are sharded on the vocabulary dim: the tie survives


def apply_activation_checkpointing(layers: nn.ModuleList, config: MemoryConfig) -> None:
    """Composable ``checkpoint`` on the blocks (or their parts) that :func:`checkpointed` names."""
    from torch.distributed._composable import checkpoint

    attr = {"attention": "self_attn", "mlp": "mlp"}
    for i, part in checkpointed(len(layers), config.activation_checkpointing, config.ac_every, config.ac_part):
        module = layers[i] if part == "block" else getattr(layers[i], attr[part], None)
        if module is None:
            raise ValueError(f"train.ac_part={part!r}: block {i} ({type(layers[i]).__name__}) has no "
                             f"{attr[part]!r} submodule; use ac_part='block'")
        checkpoint(module)


def shard_model(model: nn.Module, mesh: DeviceMesh, *, mixed_precision: bool, offload: bool = False) -> None:
    """FSDP2 per block, then the root (embedding, final norm, output head)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision else None
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kw = {"mesh": mesh, "offload_policy": policy} | ({"mp_policy": mp} if mp else {})
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)


def parallelize(model: nn.Module, mesh: DeviceMesh, config: MemoryConfig, *, mixed_precision: bool,
                offload: bool | None = None, adapters: bool = True) -> nn.Module:
    """The policy for training: LoRA adapters (``train.lora``, unless it has them or not ``adapters``: a
    critic trains whole), activation checkpointing, then FSDP2 (in place; returned)."""
    from rollpacker.model import lora

    if adapters and config.lora.rank and not lora.has_adapters(model):
        lora.apply(model, config.lora)
    apply_activation_checkpointing(model.layers, config)
    shard_model(model, mesh, mixed_precision=mixed_precision, offload=config.offload if offload is None else offload)
    return model


def with_value_head(model: nn.Module) -> nn.Module:
    """PPO's critic made of a decoder (in place; returned): its output head becomes one output, never tied to
    the embedding. A reward model's score head (one output, which the native decoder loads as its head) stays:
    the critic starts as the reward model, as OpenRLHF's and verl's do. Any other head starts at zero (the first
    values are 0)."""
    head = model.lm_head.weight
    if head.shape[0] == 1:
        return model
    model.lm_head = nn.Linear(head.shape[1], 1, bias=False, device=head.device)
    nn.init.zeros_(model.lm_head.weight)
    return model


def prepare_reference(model: nn.Module, mesh: DeviceMesh, config: MemoryConfig, *, mixed_precision: bool,
                      device: torch.device) -> nn.Module:
    """The frozen KL reference: with ``train.offload`` kept in host memory and streamed to ``device``
    layer by layer (the judge's :class:`~rollpacker.model.offload.StreamedModel`; a Hugging Face model
    gets FSDP2's CPU offload instead), else sharded like the policy."""
    from rollpacker.model.offload import StreamedModel

    model.requires_grad_(False).eval()
    if config.offload and isinstance(model, Transformer):
        return StreamedModel(model.to(torch.bfloat16 if mixed_precision else torch.float32), device)
    shard_model(model, mesh, mixed_precision=mixed_precision, offload=config.offload)
    return model


def build_for_training(path: str, impl: str, mesh: DeviceMesh, config: MemoryConfig, *, src: int,
                       group: dist.ProcessGroup | None, device: torch.device, reference: bool = False,
                       critic: bool = False) -> nn.Module:
    """The policy (or, with ``reference``, the frozen KL reference; with ``critic``, PPO's critic:
    :func:`with_value_head`, no LoRA) of the model directory ``path`` for training, never whole on the
    device: built on the meta device, parallelized, then filled from the whole model that rank ``src``
    alone loads into host memory (:func:`load_sharded`). A streamed reference is whole in every rank's
    host memory. ``impl``: native or hf."""
    from rollpacker.model import lora
    from rollpacker.model.hf import load_model, read_args
    from rollpacker.model.hf_decoder import full_state, load_hf

    mixed = config.mixed_precision and device.type == "cuda"
    if reference and config.offload and impl == "native":
        return prepare_reference(load_model(path, "cpu", torch.float32), mesh, config, mixed_precision=mixed,
                                 device=device)

    def build(meta: bool) -> nn.Module:
        if impl == "hf":
            model = load_hf(path, meta=meta)
        elif not meta:
            model = load_model(path, "cpu", torch.float32)
        else:
            with torch.device("meta"):
                model = Transformer(read_args(path))
        return with_value_head(model) if critic else model

    model = build(meta=True)
    full = None
    if dist.get_rank() == src:  # the adapters' initial values too (PEFT's init: A random, B zero)
        whole = build(meta=False)
        full = full_state(lora.apply(whole, config.lora) if config.lora.rank and not (reference or critic) else whole)
    if reference:
        shard_model(model.requires_grad_(False).eval(), mesh, mixed_precision=mixed, offload=config.offload)
    else:
        parallelize(model, mesh, config, mixed_precision=mixed, adapters=not critic)
    load_sharded(model, full, src=src, group=group, device=device, offload=config.offload)
    return model


@torch.no_grad()
def load_sharded(model: nn.Module, full: dict[str, torch.Tensor] | None, *, src: int,
                 group: dist.ProcessGroup | None, device: torch.device, offload: bool = False) -> None:
    """Fill ``model``, sharded and still on the meta device, from ``full``: on rank ``src`` every
    parameter and buffer by name, in host memory; None elsewhere.

    Tensor by tensor, ``src`` broadcasts it over ``group`` and every rank keeps its own shard (the
    DTensor's placements); buffers are kept whole. Shards go to host memory with ``offload`` (FSDP2's
    ``CPUOffloadPolicy``), else to ``device``. Tied weights stay tied: one parameter, filled once.
    """
    model.to_empty(device="cpu" if offload else device)
    rank = dist.get_rank()
    for name, target in [*model.named_parameters(), *model.named_buffers()]:
        if rank == src:
            if name not in full:
                raise ValueError(f"loading the trainer's model: the checkpoint has no tensor {name!r}")
            buffer = full[name].to(device=device, dtype=target.dtype).contiguous()
            if buffer.shape != target.shape:
                raise ValueError(f"loading the trainer's model: {name} has shape {tuple(buffer.shape)}, "
                                 f"the model expects {tuple(target.shape)}")
        else:
            buffer = torch.empty(target.shape, dtype=target.dtype, device=device)
        dist.broadcast(buffer, src, group=group)
        if hasattr(target, "device_mesh"):  # a DTensor: keep this rank's shard
            buffer = distribute_tensor(buffer, target.device_mesh, target.placements, src_data_rank=None).to_local()
            target = target.to_local()
        target.copy_(buffer)
