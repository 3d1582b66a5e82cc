"""The decoder: Llama, Qwen2/Qwen2.5 and Qwen3 in one implementation.

Tokens are packed: ``forward`` takes a flat ``[T]`` token tensor and its ``[T]`` positions, so a
prefill of several prompts and a decode step of many requests are the same call. Attention is
delegated to an :class:`~rollpacker.model.attention.AttentionBackend` chosen by the caller.

Parameter names are Hugging Face's without the ``model.`` prefix (``layers.0.self_attn.q_proj``
…), so loading is a prefix strip. Projections reshape with ``-1`` heads, so the same module runs
unchanged when tensor parallelism leaves each rank a slice of the heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rollpacker.model.args import ModelArgs
from rollpacker.model.attention import AttentionBackend


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalized in fp32 like Hugging Face, scaled in the input dtype; one fused op
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32 on CPU, with Llama-3 scaling when configured."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    s = args.rope_scaling
    if not s:
        return inv_freq
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin [T, 1, head_dim] in :func:`apply_rope`'s layout."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    cos = freqs.cos().repeat(1, 2)[:, None, :].to(dtype)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)[:, None, :].to(dtype)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] in Hugging Face's half-rotation layout, with the sign of
    the first half of ``sin`` flipped, so rotate_half(x) * sin == x.roll(D/2) * sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, hd = args.hidden_size, args.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, args.num_heads * hd, bias=args.qkv_bias)
        self.k_proj = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.v_proj = nn.Linear(d, args.num_kv_heads * hd, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * hd, d, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(hd, args.rms_norm_eps)
            self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, attn: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, -1, self.head_dim)
        k = self.k_proj(x).view(t, -1, self.head_dim)
        v = self.v_proj(x).view(t, -1, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        out = attn(layer, apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, layer: int, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    logit_softcap: float | None = None
    """The output head's logits are not capped (Gemma-2's are, on the Hugging Face path)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(args)  # a plain attribute: no meta-device init, not saved
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (again after a load
        with ``assign=True`` replaced the embedding)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, std: float = 0.02) -> None:
        """Fresh random weights (Hugging Face's scheme); used only to make new models."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """tokens, positions: [T] -> final hidden states [T, hidden_size] (normed), or
        ``head(hidden, lm_head.weight)`` when given: the trainer's token log-probs run inside the
        forward, where FSDP2 has the output head's weight gathered."""
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(positions, self.inv_freq, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, attn)
        x = self.norm(x)
        return x if head is None else head(x, self.lm_head.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> [N, vocab_size] in fp32."""
        return self.lm_head(hidden).float()
