"""The interface through which the decoder reads and writes keys and values.

The model owns no KV-cache policy: each attention layer hands its projected ``q, k, v`` to an
:class:`AttentionBackend` and gets the attention output back. The rollout engine passes a paged
backend that writes K/V into its block cache; training and reference decoding pass
:class:`CausalAttention`, plain causal attention over packed sequences.

Packed layout everywhere: one flat token dimension ``T`` holding several sequences back to back.
Ragged sequences are padded into length buckets (:func:`length_buckets`) so that padding stays
under 2x the real work even when one sequence is far longer than the rest (the long tail).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim] -> [T, num_heads, head_dim]."""
        ...


@dataclass
class Bucket:
    """Sequences of similar length padded to one rectangle: ``index[b, l]`` is a flat token index
    (0 where padded), ``valid[b, l]`` marks real tokens, ``rows`` are the sequences' positions."""

    rows: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)
    """Sliding-window masks by window and dtype (:func:`window_mask`)."""


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of ``lengths`` grouped by the next power of two (at least 16) of each length, so
    padding a group to its longest member at most doubles its work."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(max(16, 1 << (n - 1).bit_length()), []).append(i)
    return list(groups.values())


def length_buckets(lengths: list[int], starts: list[int], device: torch.device) -> list[Bucket]:
    """Sequences (flat token ranges ``starts[i] : starts[i] + lengths[i]``) padded per length group."""
    buckets = []
    for rows in length_groups(lengths):
        width = max(lengths[i] for i in rows)
        lens = torch.tensor([lengths[i] for i in rows])
        offs = torch.tensor([starts[i] for i in rows])
        pos = torch.arange(width)
        valid = pos[None, :] < lens[:, None]
        index = torch.where(valid, offs[:, None] + pos[None, :], 0)
        buckets.append(Bucket(torch.tensor(rows, device=device), index.to(device), valid.to(device)))
    return buckets


def window_mask(b: Bucket, window: int, like: torch.Tensor) -> torch.Tensor:
    """Bucket ``b``'s additive sliding-window mask ``[L, L]`` in ``like``'s dtype: each query sees the last
    ``window`` keys, its own included. Built once, shared by the layers: SDPA keeps a float mask for backward
    as it is (a bool one it converts anew in every layer); its rows are 16-element aligned, so CUDA's
    memory-efficient kernel takes it without a padded copy."""
    if (window, like.dtype) not in b.masks:
        width = b.index.shape[1]
        i = torch.arange(width, device=like.device)
        ahead = i[:, None] - i[None, :]
        rows = torch.full((width, -(-width // 16) * 16), float("-inf"), dtype=like.dtype, device=like.device)
        b.masks[window, like.dtype] = rows[:, :width].masked_fill_((ahead >= 0) & (ahead < window), 0.0)
    return b.masks[window, like.dtype]


def causal_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, buckets: list[Bucket],
    scale: float | None = None, window: int | None = None,
) -> torch.Tensor:
    """Causal self-attention of each packed sequence over its own tokens (``scale``: SDPA's, default
    ``1/sqrt(head_dim)``); with ``window``, each query sees only the last ``window`` keys, its own included.

    Padding sits at the end of each row, so the causal mask alone keeps real queries off it. A window
    mask is needed only by a bucket wider than the window (:func:`window_mask`).
    """
    out = q.new_empty(q.shape)  # contiguous: the o projection's input as it is
    for b in buckets:
        qb, kb, vb = (x[b.index].transpose(1, 2) for x in (q, k, v))  # [B, H, L, D]
        if window and b.index.shape[1] > window:
            mask = window_mask(b, window, q)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
        out[b.index[b.valid]] = ob.transpose(1, 2)[b.valid]
    return out


class CausalAttention:
    """Backend for training and reference decoding: no cache, causal within each sequence."""

    def __init__(self, seq_lens: list[int], device: torch.device | str = "cpu"):
        starts = [0]
        for n in seq_lens[:-1]:
            starts.append(starts[-1] + n)
        self.buckets = length_buckets(seq_lens, starts, torch.device(device))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_packed_attention(q, k, v, self.buckets)
