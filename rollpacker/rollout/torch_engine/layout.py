"""TorchEngine's inference layout: the model's forward with fused, transposed weights.

- q/k/v run as one matmul, gate/up as another, over weights stored ``[in, out]``.
- The model's parameters become views of the fused tensors, so a weight update needs no copy.
- Under TP the layers run on local shards and all-reduce the row-parallel outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rollpacker.model.transformer import Transformer, rope_cos_sin


class Decoder:
    """The model's forward in the engine's inference layout; same math as :class:`Transformer`.

    - **Fused, transposed projections.** q/k/v are one matmul and gate/up another, and every
      layer weight is stored transposed, ``[in, out]``, which small-batch CPU matmuls run ~25%
      faster than ``x @ W.T``. The model's parameters are replaced by views into these tensors
      (this rank's shards under TP), so ``update_weights`` writing the parameters writes the
      engine's weights: no copy, no extra memory.
    - **Explicit tensor parallelism.** The layers run on plain local tensors; row-parallel outputs
      (o, down) are all-reduced over the TP group. The vocabulary-parallel embedding and output
      head still go through the model's DTensor modules.
    - **RoPE table.** cos/sin of every position are computed once, then gathered per step.
    - **Attention backends** get ``(layer, q [T, heads, head_dim], kv [T, 2, kv_heads, head_dim])``
      with RoPE applied, K and V side by side as the fused projection left them (one write each).
    """

    def __init__(self, model: Transformer, tp_group: dist.ProcessGroup | None, max_len: int):
        args = model.args
        self.model, self.tp_group = model, tp_group
        self.eps, self.head_dim = args.rms_norm_eps, args.head_dim
        tp = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.num_heads, self.num_kv_heads = args.num_heads // tp, args.num_kv_heads // tp
        self.intermediate = args.intermediate_size // tp
        self.layers = []
        for block in model.layers:
            a, m = block.self_attn, block.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            self.layers.append(FusedBlock(
                input_norm=block.input_layernorm.weight, post_norm=block.post_attention_layernorm.weight,
                qkv=fuse(qkv, "weight"), qkv_bias=fuse(qkv, "bias"),
                q_norm=a.q_norm.weight if args.qk_norm else None, k_norm=a.k_norm.weight if args.qk_norm else None,
                o=fuse([a.o_proj], "weight"), o_bias=local(a.o_proj.bias),
                gate_up=fuse([m.gate_proj, m.up_proj], "weight"), down=fuse([m.down_proj], "weight"),
            ))
        weight = model.norm.weight
        self.cos, self.sin = rope_cos_sin(torch.arange(max_len, device=weight.device), model.inv_freq, weight.dtype)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor,
                 attn: Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """tokens, positions: [T] -> final hidden states [T, hidden_size] (normed)."""
        t, d = tokens.shape[0], self.head_dim
        q_width, qk_heads = self.num_heads * d, self.num_heads + self.num_kv_heads
        cos, sin = self.cos.index_select(0, positions), self.sin.index_select(0, positions)  # [T, 1, head_dim]
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.layers):
            qkv = linear(rms_norm(x, layer.input_norm, self.eps), layer.qkv, layer.qkv_bias)
            qk = qkv[:, : qk_heads * d].view(t, qk_heads, d)  # q heads then k heads, normed and rotated in place
            if layer.q_norm is not None:
                qk[:, : self.num_heads] = rms_norm(qk[:, : self.num_heads], layer.q_norm, self.eps)
                qk[:, self.num_heads:] = rms_norm(qk[:, self.num_heads:], layer.k_norm, self.eps)
            rotated = qk.roll(d // 2, dims=-1)  # apply_rope, in place
            qk.mul_(cos).addcmul_(rotated, sin)
            out = attn(i, qkv[:, :q_width].view(t, self.num_heads, d), qkv[:, q_width:].view(t, 2, -1, d))
            x += self._row_parallel(out, layer.o, layer.o_bias)
            gate_up = linear(rms_norm(x, layer.post_norm, self.eps), layer.gate_up, None)
            x += self._row_parallel(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:],
                                       layer.down, None)
        return rms_norm(x, self.model.norm.weight, self.eps)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight + bias`` where ``weight`` holds this rank's input rows: the partial sums
        are all-reduced over the TP group before the (replicated) bias is added once."""
        if self.tp_group is None:
            return linear(x, weight, bias)
        out = torch.mm(x, weight)
        dist.all_reduce(out, group=self.tp_group)
        return out if bias is None else out + bias


@dataclass
class FusedBlock:
    """One decoder layer's weights in the inference layout (local TP shards, plain tensors);
    matmul weights are transposed, ``[in, out]``."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: torch.Tensor
    """[hidden, (heads + 2 * kv_heads) * head_dim]: q columns, then k, then v."""
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    """[hidden, 2 * intermediate]: gate columns, then up."""
    down: torch.Tensor


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight + bias`` for a transposed ``[in, out]`` weight."""
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Hugging Face computes it (fp32 statistics, scaled in the input
    dtype): the model's :class:`~rollpacker.model.transformer.RMSNorm` in fewer ops than the
    ``F.rms_norm`` composite it calls on CPU (bit-identical there in fp32)."""
    h = x.float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True).add_(eps))
    return h.to(x.dtype).mul_(weight)


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a (possibly DTensor) parameter, as a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def fuse(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    """The ``name`` parameters of ``linears`` (this rank's shards) concatenated on their output
    dim, weights transposed to ``[in, out]``; each linear's parameter is replaced by a view into
    the result, so writing it writes the fused tensor."""
    params = [getattr(m, name) for m in linears]
    if params[0] is None:
        return None
    parts = [local(p).detach() for p in params]
    if name == "weight":
        fused = torch.cat([t.t() for t in parts], dim=1)  # [in, sum of outs], contiguous
        views = fused.t().split([len(t) for t in parts])
    else:
        fused = torch.cat(parts)
        views = fused.split([len(t) for t in parts])
    for m, p, view in zip(linears, params, views):
        if isinstance(p, DTensor):
            view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                      stride=p.stride())
        setattr(m, name, nn.Parameter(view, requires_grad=False))
    return fused
