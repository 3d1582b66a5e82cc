"""How the decoder is split across devices.

Rollout side: Megatron-style tensor parallelism with DTensor (column-parallel q/k/v and
gate/up, row-parallel o and down, vocabulary-parallel embedding and output head). Each TP rank
keeps ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads, so its KV cache holds
only its slice. The training side (FSDP2) is added here by the trainer.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from rollpacker.model.transformer import Transformer


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
