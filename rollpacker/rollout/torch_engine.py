"""TorchEngine: continuous batching over rollpacker's own decoder, on CPU or GPU.

- **Paged KV cache.** Prefill writes K and V into fixed-size blocks of one preallocated pool
  sized by a memory budget; each running request holds a list of blocks, charged for its decoded
  tokens too (the budget behind admission and preemption).
- **Decode workspace.** Decode steps read and append K/V in a per-row contiguous workspace
  (:class:`_DecodeBatch`) instead of gathering blocks every step. It follows the running set a
  row at a time: a request's row is gathered from the pool at its first decode step, dropped when
  it finishes, is aborted or preempted, and moved when its context outgrows its length group.
  Decoded K/V live in the workspace only: a request that leaves the running set frees its blocks
  (a preempted one is recomputed), so nothing ever reads them back from the pool.
- **Continuous batching.** Each ``step()`` is one forward pass: a prefill of newly admitted
  requests when any can be admitted (prefill first, as vLLM's v0 scheduler), otherwise one decode
  token for every running request. Finished requests leave and free their blocks at once.
- **Admission by priority.** Waiting requests are admitted lowest ``Request.priority`` first,
  FIFO among equals (all equal by default: plain FIFO).
- **Preemption by recomputation.** When a decode needs a block and none is free, the most
  recently admitted request of the worst priority is evicted: its blocks are freed, its tokens
  kept, and it is re-prefilled later, ahead of its equals. Each eviction is counted (the
  parallelism planner's signal).
- **Ragged attention without a long-tail penalty.** Decode rows are grouped by context length
  (power-of-two buckets), so one long request does not pad every short one to its length.
- **Inference layout.** q/k/v and gate/up each run as one matmul over fused, transposed weights
  that the model's own parameters are views of (:class:`_Decoder`), so weight updates need no copy.
- **Sampling** is batched (temperature, top-k, top-p per request). Each request's random draw at
  response position ``i`` is a hash of ``(seed, i)``: results do not depend on batch
  composition, preemption or TP rank, and a resumed request continues its sequence exactly.
- **Tensor parallelism** over a TP sub-mesh (gloo on CPU, NCCL on GPU): every rank of the group
  runs the same schedule on its slice of heads (the layers on local shards, all-reducing the
  row-parallel outputs); TP rank 0's sampled tokens are broadcast so the ranks can never diverge.

- **Speculative decoding** (``engine.speculative``; ``docs/speculative.md``): a decode step may
  verify model-free drafts (:mod:`~rollpacker.rollout.drafter`) in one forward over each row's
  newest token and draft (:class:`_VerifyAttention`). At each draft position it samples the token
  a plain step would, with that position's own draw, and keeps the draft while it matches, then
  that token: the output is exactly plain decoding's. ``auto`` drafts where the engine's measured
  step cost (:mod:`~rollpacker.rollout.spec_cost`) says it pays.

What it leaves out for now: prefix sharing across a prompt's group, chunked prefill (both would
need the decoded K/V written back to the pool), and CUDA graphs.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from rollpacker.model.attention import Bucket, causal_packed_attention, length_buckets
from rollpacker.model.parallelize import apply_rollout_tp
from rollpacker.model.transformer import Transformer, rope_cos_sin
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.drafter import Draft, Drafter
from rollpacker.rollout.engine import (
    ENGINE_DRAFT_SOURCES,
    EngineStats,
    Output,
    Request,
    SpecStats,
    append_token,
    check_stop,
    finish,
    start_output,
    stop_string_hit,
)
from rollpacker.rollout.spec_cost import Acceptance, SpecCost

_MASK64 = (1 << 64) - 1
_SPEC_COSTS: dict[tuple, SpecCost] = {}
"""Measured verify-step costs of this process, by model, TP size, device and engine settings."""


@dataclass(eq=False)
class _Seq:
    req: Request
    out: Output
    tokens: list[int]
    """Prompt followed by every generated token."""
    seed: int
    stop_ids: frozenset[int]
    max_len: int
    """Length of ``tokens`` at which the request finishes (max_new_tokens or the context length)."""
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    """One of the engine's ``max_num_seqs`` running slots while running; -1 otherwise."""
    group: _Group | None = None
    """The decode workspace group holding this request's K/V row; None before its first decode
    step, and once it leaves the running set."""
    slot: int = -1
    """Its row in ``group``."""
    draft: Draft | None = None
    """The draft this decode step verifies (speculation), if any."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Its recent draft acceptance (speculation's draft length)."""


def _uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) from (seed, index): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class _Decoder:
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
            self.layers.append(_FusedBlock(
                input_norm=block.input_layernorm.weight, post_norm=block.post_attention_layernorm.weight,
                qkv=_fuse(qkv, "weight"), qkv_bias=_fuse(qkv, "bias"),
                q_norm=a.q_norm.weight if args.qk_norm else None, k_norm=a.k_norm.weight if args.qk_norm else None,
                o=_fuse([a.o_proj], "weight"), o_bias=_local(a.o_proj.bias),
                gate_up=_fuse([m.gate_proj, m.up_proj], "weight"), down=_fuse([m.down_proj], "weight"),
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
            qkv = _linear(_rms_norm(x, layer.input_norm, self.eps), layer.qkv, layer.qkv_bias)
            qk = qkv[:, : qk_heads * d].view(t, qk_heads, d)  # q heads then k heads, normed and rotated in place
            if layer.q_norm is not None:
                qk[:, : self.num_heads] = _rms_norm(qk[:, : self.num_heads], layer.q_norm, self.eps)
                qk[:, self.num_heads:] = _rms_norm(qk[:, self.num_heads:], layer.k_norm, self.eps)
            rotated = qk.roll(d // 2, dims=-1)  # apply_rope, in place
            qk.mul_(cos).addcmul_(rotated, sin)
            out = attn(i, qkv[:, :q_width].view(t, self.num_heads, d), qkv[:, q_width:].view(t, 2, -1, d))
            x += self._row_parallel(out, layer.o, layer.o_bias)
            gate_up = _linear(_rms_norm(x, layer.post_norm, self.eps), layer.gate_up, None)
            x += self._row_parallel(F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate:],
                                       layer.down, None)
        return _rms_norm(x, self.model.norm.weight, self.eps)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight + bias`` where ``weight`` holds this rank's input rows: the partial sums
        are all-reduced over the TP group before the (replicated) bias is added once."""
        if self.tp_group is None:
            return _linear(x, weight, bias)
        out = torch.mm(x, weight)
        dist.all_reduce(out, group=self.tp_group)
        return out if bias is None else out + bias


@dataclass
class _FusedBlock:
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


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight + bias`` for a transposed ``[in, out]`` weight."""
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim as Hugging Face computes it (fp32 statistics, scaled in the input
    dtype): the model's :class:`~rollpacker.model.transformer.RMSNorm` in fewer ops than the
    ``F.rms_norm`` composite it calls on CPU (bit-identical there in fp32)."""
    h = x.float()
    h = h * torch.rsqrt((h * h).mean(-1, keepdim=True).add_(eps))
    return h.to(x.dtype).mul_(weight)


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of a (possibly DTensor) parameter, as a plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


def _fuse(linears: list[nn.Linear], name: str) -> torch.Tensor | None:
    """The ``name`` parameters of ``linears`` (this rank's shards) concatenated on their output
    dim, weights transposed to ``[in, out]``; each linear's parameter is replaced by a view into
    the result, so writing it writes the fused tensor."""
    params = [getattr(m, name) for m in linears]
    if params[0] is None:
        return None
    parts = [_local(p).detach() for p in params]
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


class _PrefillAttention:
    """Prefill backend: writes the new K/V into the paged pool, then each request attends
    causally over its own (all new) tokens."""

    def __init__(self, cache: torch.Tensor, slots: torch.Tensor, buckets: list[Bucket]):
        self.cache, self.slots, self.buckets = cache, slots, buckets

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.cache[layer].index_copy_(0, self.slots, kv)
        return causal_packed_attention(q, kv[:, 0], kv[:, 1], self.buckets).flatten(1)


@dataclass
class _Sampling:
    """Per-row sampling settings of a batch, as tensors."""

    temperatures: torch.Tensor | None
    """[B, 1] (1 for greedy rows); None when no row samples."""
    sampled: list[int]
    """Rows with temperature > 0."""
    sampled_index: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None

    @classmethod
    def of(cls, seqs: list[_Seq], vocab: int, device: torch.device) -> _Sampling:
        params = [s.req.params for s in seqs]
        temps = [p.temperature or 1.0 for p in params]
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if not sampled:
            return cls(None, [], None, None, None)
        return cls(
            torch.tensor(temps, device=device)[:, None],
            sampled,
            torch.tensor(sampled, device=device),
            torch.tensor([params[i].top_k or vocab for i in sampled], device=device),
            torch.tensor([params[i].top_p for i in sampled], device=device),
        )


class _DecodeBatch:
    """The running requests of the decode steps, with a per-row contiguous KV workspace that
    follows the running set a row at a time.

    Rows sit in power-of-two length groups (:class:`_Group`): a row of context ``L`` (cached
    tokens + the one decoded this step) lives in the group of capacity ``max(16, 2^ceil(log2
    L))``, left-aligned (token ``i`` in column ``i``), so its padding stays under 2x and no row
    depends on where the others are. The workspace changes only where the running set does:

    - a finished, aborted or preempted request's row is dropped at once, and its group's last
      row moves into the hole (one copy), so a group's rows stay contiguous;
    - a newly admitted request gets a row at its first decode step, gathered from the paged pool
      (its prefill K/V) for that row alone;
    - a row that outgrows its group's capacity moves to the group of twice the capacity (one copy
      of its K/V, batched with the rows that outgrow it at the same step): O(log length) moves
      per request, amortized O(1) copied columns per token.

    Decoded K/V are written to the workspace only, never to the pool: nothing would read them
    there, since a request leaving the running set (finish, abort, preemption) frees its blocks
    and a preempted one is recomputed. So the pool holds each request's prefill K/V, and the
    blocks charged to its decoded tokens keep the memory accounting (hence admission and
    preemption) as if they held theirs. The workspace costs memory on top of the pool: per row,
    its group's capacity (under 2x its context), plus the spare rows of each group: a group's
    rows grow by doubling and are kept (empty groups too) until ``release_memory``, so a steady
    workload allocates nothing.

    A step appends the K and V of a group's rows with one ``put_`` per layer (flat indices
    advanced in place), and attends over the group's longest context with an additive mask over
    each row's right padding. While a group's rows have the same length (steady batches) it
    needs neither: their newest tokens share a column, written with one strided copy each.
    Per layer, K is kept transposed, ``[rows * kv_heads, head_dim, capacity]`` (so ``q @ K^T``
    is a plain batched matmul), and V as ``[rows * kv_heads, capacity, head_dim]``. Per-step
    inputs (tokens, positions, indices, masks) are rebuilt on the host after rows change and
    advanced in place otherwise.
    """

    def __init__(self, engine: TorchEngine):
        self.cache, self.block_size = engine.cache, engine.config.block_size
        self.vocab_size = engine.model.args.vocab_size
        self.scale = self.cache.shape[-1] ** -0.5
        self.groups: dict[int, _Group] = {}
        """By capacity."""
        self.order: list[_Group] = []
        """The groups in batch order (longest first), as of the last layout."""
        self.seqs: list[_Seq] = []
        """The rows in batch order (each group's rows in turn), as of the last layout."""
        self.changed = False
        """Rows were added, dropped or moved since the last layout."""

    def remove(self, seq: _Seq) -> None:
        """Drop ``seq``'s row: its request leaves the running set, and its K/V are not needed."""
        seq.group.drop([seq.slot])
        seq.group, seq.slot = None, -1
        self.changed = True

    def update(self, running: list[_Seq], extra: int = 0) -> None:
        """Before a decode step over ``running`` that appends ``extra + 1`` tokens per row (``extra``:
        a verify step's draft length): move the rows that outgrew their group, add rows for the
        requests admitted since the last step, and lay the batch out if anything changed (a verify
        step needs the rows' places only; the next plain step builds its own state)."""
        for group in list(self.groups.values()):
            if group.seqs and group.width + extra > group.capacity:
                grown: dict[int, list[_Seq]] = {}
                for s in group.seqs:
                    if len(s.tokens) + extra > group.capacity:
                        grown.setdefault(_capacity(len(s.tokens) + extra), []).append(s)
                for capacity, seqs in grown.items():
                    self._group(capacity).take(seqs)
                self.changed = True
        if len(running) > sum(len(g.seqs) for g in self.groups.values()):
            admitted: dict[int, list[_Seq]] = {}
            for seq in running:
                if seq.group is None:
                    admitted.setdefault(_capacity(len(seq.tokens) + extra), []).append(seq)
            for capacity, seqs in admitted.items():
                self._group(capacity).gather(seqs, self.cache, self.block_size)
            self.changed = True
        if self.changed:
            self._layout(decode=not extra)

    def _group(self, capacity: int) -> _Group:
        """The group of ``capacity``, created if need be."""
        if capacity not in self.groups:
            self.groups[capacity] = _Group(capacity, self.cache)
        return self.groups[capacity]

    def _layout(self, decode: bool) -> None:
        dev = self.cache.device
        self.order = sorted((g for g in self.groups.values() if g.seqs), key=lambda g: -g.capacity)
        self.seqs, start = [], 0
        for group in self.order:
            group.layout(start, decode)
            self.seqs += group.seqs
            start += len(group.seqs)
        if not decode:
            return
        self.positions = torch.tensor([len(s.tokens) - 1 for s in self.seqs], device=dev)  # advanced in place
        self.tokens = torch.tensor([s.tokens[-1] for s in self.seqs], device=dev)
        self.sampling = _Sampling.of(self.seqs, self.vocab_size, dev)
        self.changed = False

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step that sampled ``tokens`` for every row: move every row one position on."""
        self.tokens = tokens
        self.positions += 1
        for group in self.order:
            if not group.advance():
                self.changed = True  # a row outgrew its group: moved at the next update

    def resync(self) -> None:
        """After a verify step (rows advanced by different counts): lay every group out again."""
        for group in self.groups.values():
            if group.seqs:
                group.width = max(len(s.tokens) for s in group.seqs)
                group.changed = True
        self.changed = True

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """Decode attention backend: append K/V to the workspace, attend per length group."""
        group_size = q.shape[1] // kv.shape[2]
        outs = []
        for g in self.order:
            w, rows = g.width, kv[g.start:g.stop]
            if g.index is None:  # the rows have the same length: their newest tokens share a column
                g.keys_now[layer][..., w - 1].copy_(rows[:, 0])
                g.values_now[layer][:, :, w - 1].copy_(rows[:, 1])
            else:
                g.flat[layer].put_(g.index, rows)
            qg = q[g.start:g.stop].mul(self.scale).view(-1, group_size, q.shape[2])  # scaled [rows * kv, group, d]
            if g.mask is None:
                scores = torch.bmm(qg, g.k_mats[layer][..., :w])
            else:
                scores = torch.baddbmm(g.mask[..., :w], qg, g.k_mats[layer][..., :w])
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            outs.append(torch.bmm(probs, g.v_mats[layer][:, :w]).view(g.stop - g.start, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class _VerifyAttention:
    """Verify-step attention backend: each row appends the K/V of its ``width`` queries (its newest
    token, then its draft, padded) to its workspace row and attends causally over its context and
    them. Columns past a row's accepted tokens are left behind: masked, and overwritten later."""

    def __init__(self, batch: _DecodeBatch, width: int):
        self.batch, self.width, self.scale = batch, width, batch.scale
        self.plans = [self._plan(g) for g in batch.order]

    def _plan(self, g: _Group) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The group's flat K and V write positions [rows, width, 2, kv, d], hidden columns
        [rows, 1, width, 1, attended] and attended width."""
        n, w, dev = len(g.seqs), self.width, g.store.device
        base, step = g.verify_index(w)
        lengths = [len(s.tokens) for s in g.seqs]
        newest = torch.tensor(lengths, device=dev) - 1  # the column of each row's first query
        attended = max(lengths) - 1 + w
        columns = newest[:, None] + torch.arange(w, device=dev)  # [rows, width]
        hidden = torch.arange(attended, device=dev) > columns[:, :, None]
        return base + newest.view(n, 1, 1, 1, 1) * step, hidden.view(n, 1, w, 1, attended), attended

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        w, kv_heads, d = self.width, kv.shape[2], q.shape[2]
        group_size = q.shape[1] // kv_heads
        outs = []
        for g, (index, hidden, attended) in zip(self.batch.order, self.plans):
            n, lo, hi = g.stop - g.start, g.start * w, g.stop * w
            g.store[layer].view(-1).put_(index, kv[lo:hi])
            qg = q[lo:hi].mul(self.scale).view(n, w, kv_heads, group_size, d).transpose(1, 2)
            scores = torch.bmm(qg.reshape(n * kv_heads, w * group_size, d), g.k_mats[layer][..., :attended])
            scores.view(n, kv_heads, w, group_size, attended).masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.bmm(probs, g.v_mats[layer][:, :attended]).view(n, kv_heads, w, group_size, d)
            outs.append(out.transpose(1, 2).reshape(n * w, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _capacity(context: int) -> int:
    """The workspace capacity of a row of ``context`` tokens: its power-of-two length bucket, as
    :func:`~rollpacker.model.attention.length_groups`."""
    return max(16, 1 << (context - 1).bit_length())


class _Group:
    """The decode rows whose context fits ``capacity`` columns (and, above 16, exceeds half of
    it), each left-aligned in its own row of the group's workspace ``store``.

    ``store`` is ``[layers, 2, rows, kv_heads, head_dim * capacity]``: per layer and row, K^T
    ``[kv_heads, head_dim, capacity]`` then V ``[kv_heads, capacity, head_dim]``; its first
    ``len(seqs)`` rows are in use, ``seqs[i]`` in row ``i`` (and ``seqs[i].slot == i``)."""

    def __init__(self, capacity: int, cache: torch.Tensor):
        num_layers, _, _, kv, d = cache.shape
        self.capacity, self.num_kv_heads, self.head_dim = capacity, kv, d
        self.store = cache.new_zeros(num_layers, 2, 0, kv, d * capacity)  # zeros: padding is finite
        self.seqs: list[_Seq] = []
        self.changed = True
        """Rows were added or dropped since the last layout."""
        # per-step state, set by layout(): the group's rows of the batch, its longest context,
        # the flat positions of every row's newest K and V in a layer's store and the mask
        # (None while all rows have the same length), per-layer views of the rows in use
        self.start = self.stop = self.width = 0
        self.index = self.index_step = self.mask = self.mask_index = None
        self.flat: list[torch.Tensor] = []
        self.keys_now: tuple[torch.Tensor, ...] = ()
        self.values_now: tuple[torch.Tensor, ...] = ()
        self.k_mats: tuple[torch.Tensor, ...] = ()
        self.v_mats: tuple[torch.Tensor, ...] = ()
        self.verify_cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        """A verify step's write positions for its current shape (see :meth:`verify_index`)."""

    @property
    def keys(self) -> torch.Tensor:
        """K^T [layers, rows, kv_heads, head_dim, capacity] (a view of ``store``)."""
        layers, _, rows, kv, _ = self.store.shape
        return self.store[:, 0].view(layers, rows, kv, self.head_dim, self.capacity)

    @property
    def values(self) -> torch.Tensor:
        """V [layers, rows, kv_heads, capacity, head_dim] (a view of ``store``)."""
        layers, _, rows, kv, _ = self.store.shape
        return self.store[:, 1].view(layers, rows, kv, self.capacity, self.head_dim)

    def append(self, seqs: list[_Seq]) -> int:
        """Give ``seqs`` the next rows (their K/V still to be written); the first one's index."""
        first, rows = len(self.seqs), self.store.shape[2]
        if first + len(seqs) > rows:  # grow by doubling, keeping the rows in use
            store = self.store.new_zeros(*self.store.shape[:2], max(first + len(seqs), 2 * rows),
                                         *self.store.shape[3:])
            store[:, :, :first].copy_(self.store[:, :, :first])
            self.store = store
        for i, seq in enumerate(seqs, first):
            seq.group, seq.slot = self, i
        self.seqs += seqs
        self.changed = True
        return first

    def gather(self, seqs: list[_Seq], cache: torch.Tensor, block_size: int) -> None:
        """Append rows for ``seqs`` and fill them with their cached K/V from the paged pool."""
        first = self.append(seqs)
        cached = [len(s.tokens) - 1 for s in seqs]  # all but the token decoded this step
        width = max(cached)
        # [rows, width] positions; past a row's end, its last token again (overwritten or masked)
        position = torch.minimum(torch.arange(width)[None, :], torch.tensor(cached)[:, None] - 1)
        slots = _slots(seqs, position, block_size).flatten().to(cache.device)
        num_layers, _, _, kv, d = cache.shape
        cached_kv = cache.index_select(1, slots).view(num_layers, len(seqs), width, 2, kv, d)
        rows = slice(first, first + len(seqs))
        self.keys[:, rows, ..., :width].copy_(cached_kv[:, :, :, 0].permute(0, 1, 3, 4, 2))
        self.values[:, rows, :, :width].copy_(cached_kv[:, :, :, 1].permute(0, 1, 3, 2, 4))

    def take(self, seqs: list[_Seq]) -> None:
        """Move the rows of ``seqs`` here from the (one) smaller group they outgrew."""
        src, rows = seqs[0].group, [s.slot for s in seqs]
        num_layers, _, _, kv, _ = src.store.shape
        d, cap = self.head_dim, src.capacity
        if rows == list(range(rows[0], rows[0] + len(rows))):  # as when a whole batch grows: no gather
            kv_rows = src.store[:, :, rows[0]:rows[0] + len(rows)]  # [layers, 2, rows, ...]
        else:
            kv_rows = src.store.index_select(2, torch.tensor(rows, device=src.store.device))
        first = self.append(seqs)
        moved = slice(first, first + len(seqs))
        self.keys[:, moved, ..., :cap].copy_(kv_rows[:, 0].view(num_layers, len(rows), kv, d, cap))
        self.values[:, moved, :, :cap].copy_(kv_rows[:, 1].view(num_layers, len(rows), kv, cap, d))
        src.drop(rows)

    def drop(self, rows: list[int]) -> None:
        """Free ``rows``: the last rows still in use move into those of them below the new end."""
        end, dropped = len(self.seqs) - len(rows), set(rows)
        holes = sorted(i for i in rows if i < end)
        movers = [i for i in range(end, len(self.seqs)) if i not in dropped]  # as many as the holes
        if holes:
            dev = self.store.device
            self.store.index_copy_(2, torch.tensor(holes, device=dev),
                                   self.store.index_select(2, torch.tensor(movers, device=dev)))
            for i, j in zip(holes, movers):
                self.seqs[i] = self.seqs[j]
                self.seqs[i].slot = i
        del self.seqs[end:]
        self.changed = True

    def layout(self, start: int, decode: bool = True) -> None:
        """Put the group's rows at ``start`` of the batch; rebuild its views, and its decode step
        state when ``decode``, if its rows changed."""
        n, kv, d, cap = len(self.seqs), self.num_kv_heads, self.head_dim, self.capacity
        self.start, self.stop = start, start + n
        if not self.changed:
            return
        keys, values = self.keys[:, :n], self.values[:, :n]
        self.keys_now, self.values_now = keys.unbind(0), values.unbind(0)  # [rows, kv, d | capacity, capacity | d]
        self.k_mats, self.v_mats = keys.flatten(1, 2).unbind(0), values.flatten(1, 2).unbind(0)
        if not decode:
            return
        self.changed = False
        dev = self.store.device
        lengths = [len(s.tokens) for s in self.seqs]
        self.width = max(lengths)
        if min(lengths) == self.width:
            self.index = self.index_step = self.mask = self.mask_index = None  # no row is padded
        else:
            contexts = torch.tensor(lengths)
            newest = (contexts - 1)[:, None, None]  # the column of each row's token of this step
            heads = torch.arange(n * kv).view(n, kv, 1)
            dims = torch.arange(d)
            k_index = (heads * d + dims) * cap + newest
            v_index = self.store.shape[2] * kv * d * cap + (heads * cap + newest) * d + dims
            self.index = torch.stack((k_index, v_index), dim=1).to(dev)  # [n, 2, kv, d]: flat, in a layer's store
            self.index_step = torch.tensor([1, d], device=dev).view(1, 2, 1, 1)
            self.flat = [layer.view(-1) for layer in self.store]
            valid = torch.arange(cap)[None, :] < contexts[:, None]  # [n, capacity]
            mask = torch.where(valid, 0.0, float("-inf")).to(self.store.dtype).repeat_interleave(kv, dim=0)
            self.mask = mask[:, None, :].to(dev)  # additive, over each row's right padding: [rows * kv, 1, capacity]
            self.mask_index = (torch.arange(n * kv) * cap + newest.flatten().repeat_interleave(kv)).to(dev)

    def verify_index(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat K and V positions [rows, width, 2, kv, d] of ``width`` columns from column 0 of
        every row in use, and their step per column of a row's start; cached per shape."""
        key = (len(self.seqs), width, self.store.shape[2])
        if key not in self.verify_cache:
            n, kv, d, cap = len(self.seqs), self.num_kv_heads, self.head_dim, self.capacity
            heads = torch.arange(n * kv).view(n, 1, kv, 1)
            dims, columns = torch.arange(d), torch.arange(width).view(1, width, 1, 1)
            k_index = (heads * d + dims) * cap + columns
            v_index = self.store.shape[2] * kv * d * cap + (heads * cap + columns) * d + dims
            step = torch.tensor([1, d]).view(1, 1, 2, 1, 1)
            dev = self.store.device
            self.verify_cache = {key: (torch.stack((k_index, v_index), dim=2).to(dev), step.to(dev))}
        return self.verify_cache[key]

    def advance(self) -> bool:
        """Move every row one column on; False if a row outgrew the group (and nothing moved)."""
        self.width += 1
        if self.width > self.capacity:
            return False
        if self.index is not None:
            self.index += self.index_step
            self.mask_index += 1
            self.mask.view(-1).index_fill_(0, self.mask_index, 0.0)
        return True


class TorchEngine:
    """Continuous-batching engine over :class:`Transformer`; see the module docstring."""

    logprobs_truncated = False

    def __init__(self, model: Transformer, config: EngineConfig | None = None, tp_mesh: DeviceMesh | None = None,
                 spec_cost: SpecCost | None = None, decode: Callable[[list[int]], str] | None = None):
        """``spec_cost``: the verify-step cost ``engine.speculative=auto`` decides by; None measures it
        at the first step that finds the engine idle (see :meth:`calibrate`). ``decode``: for stop strings."""
        self.config = config = config or EngineConfig()
        self.decode = decode
        self.model = model.eval().requires_grad_(False)
        args = model.args
        self.tp_group = None
        tp = 1
        if tp_mesh is not None and tp_mesh.size() > 1:
            apply_rollout_tp(model, tp_mesh)
            self.tp_group, tp = tp_mesh.get_group(), tp_mesh.size()
        self.device = model.norm.weight.device
        self.dtype = model.norm.weight.dtype
        self.num_kv_heads = args.num_kv_heads // tp
        self.max_model_len = config.max_model_len or args.max_position_embeddings
        self.eos_ids = frozenset(args.eos_token_ids)
        block_bytes = (
            config.block_size * 2 * args.num_layers * self.num_kv_heads * args.head_dim * self.dtype.itemsize
        )
        self.weight_bytes = sum(_local(p).nbytes for p in model.parameters())  # this rank's shard
        self.budget = "memory_mb" if config.memory_mb else "kv_memory_mb"  # the setting that sizes the KV cache
        kv_bytes = config.memory_mb * 2**20 - self.weight_bytes if config.memory_mb else config.kv_memory_mb * 2**20
        self.num_blocks = int(kv_bytes) // block_bytes
        self.kv_capacity_tokens = self.num_blocks * config.block_size
        if self.num_blocks < 1:
            raise ValueError(f"engine.{self.budget}={getattr(config, self.budget)} (this rank's weights: "
                             f"{self.weight_bytes / 2**20:.2f} MiB) holds no {block_bytes}-byte KV block")
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.cache: torch.Tensor | None = None
        self.resume_memory()
        self.decoder = _Decoder(model, self.tp_group, self.max_model_len)
        self.batch: _DecodeBatch | None = None
        """The decode rows and their KV workspace; None until the first decode step after
        ``resume_memory``."""
        self.rng = random.Random(config.seed)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.drafter = Drafter() if config.speculative != "off" else None
        self.spec = SpecStats()
        self.spec_cost = spec_cost
        self.calibrating = False

    # ---- the contract -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._validate(request)
        p = request.params
        out = start_output(request)
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        max_len = min(len(out.prompt_ids) + p.max_new_tokens, self.max_model_len)
        seq = _Seq(request, out, out.prompt_ids + out.token_ids, seed, stop_ids, max_len)
        self._enqueue(seq)
        if self.drafter is not None:
            self.drafter.add(request.id, out.prompt_ids, seq.tokens, request.draft_context)

    @torch.inference_mode()  # dropping a row updates the workspace, made under inference mode
    def abort(self, request_id: str) -> Output:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.req.id == request_id:
                    queue.remove(seq)
                    self._leave(seq)
                    return finish(seq.out, "abort")
        raise KeyError(f"abort: no request {request_id!r} is queued or running")

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions=self.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            spec=self.spec.plus(SpecStats()),  # a copy
        )

    @torch.inference_mode()
    def step(self) -> list[Output]:
        if self.cache is None:
            raise RuntimeError("step() after release_memory(): call resume_memory() first")
        if self.config.speculative == "auto" and self.spec_cost is None and not (self.running or self.calibrating):
            self.calibrate()
        admitted = self._admit()
        if admitted:
            return self._prefill(admitted)
        if self.running:
            return self._decode()
        return []

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        tied = self.model.args.tie_word_embeddings
        for name, tensor in named_tensors:
            name = name.removeprefix("model.")
            if tied and name == "lm_head.weight":
                continue
            if name not in params:
                raise KeyError(f"update_weights: {name!r} is not a parameter of the engine's model")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            param = params[name]
            if hasattr(param, "device_mesh"):  # a TP shard: keep this rank's slice
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(tensor)

    def release_memory(self) -> None:
        if self.has_unfinished():
            raise RuntimeError(
                f"release_memory with {len(self.running)} running and {len(self.waiting)} waiting "
                "requests: finish or abort them first"
            )
        self.cache = self.batch = None

    def resume_memory(self) -> None:
        if self.cache is None:
            args = self.model.args
            self.cache = torch.zeros(
                args.num_layers, self.kv_capacity_tokens, 2, self.num_kv_heads, args.head_dim,
                dtype=self.dtype, device=self.device,
            )

    @property
    def released(self) -> bool:
        return self.cache is None

    @property
    def workspace_bytes(self) -> int:
        """Bytes the decode workspace holds now, beside the KV pool (:class:`_DecodeBatch`)."""
        return sum(g.store.nbytes for g in self.batch.groups.values()) if self.batch is not None else 0

    def shutdown(self) -> None:
        self.cache = self.batch = None

    # ---- scheduling -----------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        p, rid = request.params, request.id
        prompt = request.prompt_ids
        done = len(request.resume_from.token_ids) if request.resume_from else 0
        problems = []
        if any(s.req.id == rid for s in (*self.running, *self.waiting)):
            problems.append("a request with this id is already queued or running")
        if not prompt:
            problems.append("the prompt is empty")
        elif any(not 0 <= t < self.model.args.vocab_size for t in prompt):
            problems.append(f"a prompt token id is outside the vocabulary [0, {self.model.args.vocab_size})")
        if len(prompt) + done >= self.max_model_len:
            problems.append(
                f"prompt ({len(prompt)} tokens, {done} resumed) leaves no room in the context "
                f"length {self.max_model_len}"
            )
        if p.max_new_tokens <= 0:
            problems.append(f"max_new_tokens={p.max_new_tokens} must be positive")
        elif done >= p.max_new_tokens:
            problems.append(f"the resumed output already has {done} >= max_new_tokens tokens")
        if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0:
            problems.append(f"bad sampling: temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}")
        problems += check_stop(self, request)
        for c in request.draft_context:
            if not c.source or c.source in ENGINE_DRAFT_SOURCES or c.source == "none":
                problems.append(f"draft_context source {c.source!r} is empty or one of the engine's own "
                                f"{ENGINE_DRAFT_SOURCES}: name it after what it is (e.g. 'partial', 'epoch')")
            elif any(not 0 <= t < self.model.args.vocab_size for t in c.token_ids):
                problems.append(f"a draft_context ({c.source}) token id is outside the vocabulary")
        longest = min(len(prompt) + p.max_new_tokens, self.max_model_len)
        if not problems and self._blocks_for(longest) > self.num_blocks:
            problems.append(
                f"it may need {longest} tokens of KV but the cache holds "
                f"{self.kv_capacity_tokens}: raise engine.{self.budget}"
            )
        if problems:
            raise ValueError(f"request {rid!r} rejected: " + "; ".join(problems))

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def _admit(self) -> list[_Seq]:
        """Move waiting requests into the running set while rows, blocks and the prefill budget allow."""
        admitted: list[_Seq] = []
        budget = self.config.max_prefill_tokens
        # Keep one free block per running request so the next decode step rarely preempts.
        reserve = len(self.running)
        while self.waiting and self.free_rows:
            seq = self.waiting[0]
            n = len(seq.tokens)
            need = self._blocks_for(n)
            if admitted and n > budget or need + reserve > len(self.free_blocks):
                break
            self.waiting.popleft()
            seq.blocks = [self.free_blocks.pop() for _ in range(need)]
            seq.row = self.free_rows.pop()
            admitted.append(seq)
            budget -= n
            reserve += 1
        self.running.extend(admitted)
        return admitted

    def _leave(self, seq: _Seq) -> None:
        """``seq`` leaves the engine for good (finished or aborted)."""
        self._free(seq)
        if self.drafter is not None:
            self.drafter.remove(seq.req.id)

    def _free(self, seq: _Seq) -> None:
        if seq.group is not None:
            self.batch.remove(seq)
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1
        self.free_blocks.extend(seq.blocks)
        seq.blocks = []

    def _enqueue(self, seq: _Seq, *, ahead: bool = False) -> None:
        """Queue ``seq`` by priority (lower first): after its equals, or ``ahead`` of them (preempted)."""
        p, i = seq.req.priority, len(self.waiting)
        while i and (self.waiting[i - 1].req.priority > p or ahead and self.waiting[i - 1].req.priority == p):
            i -= 1
        self.waiting.insert(i, seq)

    def _preempt(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        self._enqueue(seq, ahead=True)
        seq.out.num_preemptions += 1
        self.num_preemptions += 1

    # ---- forward passes ---------------------------------------------------------------------

    def _prefill(self, seqs: list[_Seq]) -> list[Output]:
        lengths = [len(s.tokens) for s in seqs]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        width = max(lengths)
        slots = _slots(seqs, torch.arange(width).expand(len(seqs), width), self.config.block_size)
        valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
        positions = torch.cat([torch.arange(n) for n in lengths])
        tokens = torch.tensor([t for s in seqs for t in s.tokens])
        dev = self.device
        attn = _PrefillAttention(self.cache, slots[valid].to(dev), length_buckets(lengths, starts, dev))
        hidden = self.decoder(tokens.to(dev), positions.to(dev), attn)
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=dev)
        self.num_prefill_tokens += len(tokens)
        logits = self.model.logits(hidden[last])
        tokens, logprobs = self._sample(seqs, logits, _Sampling.of(seqs, self.model.args.vocab_size, dev))
        return self._append(seqs, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()])

    def _decode(self, drafts: dict[str, list[int]] | None = None) -> list[Output]:
        """One decode step of every running request, verifying drafts where speculation pays (or
        ``drafts``, by request id, when given)."""
        # Every running request needs a slot for its newest token; evict the newest requests of the
        # worst priority (LIFO, as vLLM) until the others fit.
        bs = self.config.block_size
        for seq in [s for s in self.running if len(s.tokens) > len(s.blocks) * bs]:
            while seq.row >= 0 and len(seq.tokens) > len(seq.blocks) * bs:  # unless evicted by this loop
                if self.free_blocks:
                    seq.blocks.append(self.free_blocks.pop())
                else:
                    self._preempt(max(reversed(self.running), key=lambda s: s.req.priority))
        num_draft = self._propose() if drafts is None else self._force(drafts)
        if self.batch is None:
            self.batch = _DecodeBatch(self)
        batch = self.batch
        batch.update(self.running, num_draft)
        if num_draft:
            return self._verify(batch, num_draft)
        logits = self.model.logits(self.decoder(batch.tokens, batch.positions, batch))
        tokens, logprobs = self._sample(batch.seqs, logits, batch.sampling)
        batch.advance(tokens)
        return self._append(batch.seqs, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()])

    # ---- speculation ------------------------------------------------------------------------

    def _propose(self) -> int:
        """Set each running request's draft for this step; the longest draft's length (0: plain decode).

        ``on`` verifies every draft the drafter has (up to ``spec_max_tokens``); ``auto`` drafts only
        up to the cost table's ``max_rows`` running requests and cuts drafts to the length that
        maximizes expected tokens per millisecond (:meth:`SpecCost.draft_len`)."""
        mode, n, cost = self.config.speculative, len(self.running), self.spec_cost
        for seq in self.running:
            seq.draft = None
        if mode == "off" or mode == "auto" and (cost is None or n > cost.max_rows):
            return 0
        k_max = self.config.spec_max_tokens
        if mode == "auto" and not cost.worth_drafting(n, [s.acceptance.rate for s in self.running], k_max):
            for seq in self.running:  # not even full drafts would pay at their acceptance: don't draft
                seq.acceptance.fade()
            return 0
        for seq in self.running:
            room = seq.max_len - len(seq.tokens) - 1  # a verify step appends up to draft + 1 tokens
            if room > 0:
                seq.draft = self.drafter.propose(seq.req.id, min(k_max, room))
        drafted = [s for s in self.running if s.draft is not None]
        k = max((len(s.draft.tokens) for s in drafted), default=0)
        if mode == "auto" and drafted:
            k = cost.draft_len(n, [(len(s.draft.tokens), s.acceptance.rate) for s in drafted], k)
            for s in drafted:
                s.draft = Draft(s.draft.tokens[:k], s.draft.source) if k else None
        for seq in self.running:
            if seq.draft is None:
                seq.acceptance.fade()
        return k

    def _force(self, drafts: dict[str, list[int]]) -> int:
        """Set the given drafts (by request id; cut to each request's room) instead of the drafter's."""
        for seq in self.running:
            tokens = drafts.get(seq.req.id, [])[: max(0, seq.max_len - len(seq.tokens) - 1)]
            seq.draft = Draft(list(tokens), "forced") if tokens else None
        return max((len(s.draft.tokens) for s in self.running if s.draft is not None), default=0)

    def _verify(self, batch: _DecodeBatch, num_draft: int) -> list[Output]:
        """One forward over every row's newest token and draft (padded to ``num_draft``): at each
        draft position, the token the engine samples there with that position's own draw; a row
        keeps its draft while it matches, then the first sampled token that differs (or the one
        after a fully accepted draft)."""
        width, seqs, limit = num_draft + 1, batch.seqs, self.max_model_len - 1
        drafts = [s.draft.tokens if s.draft is not None else [] for s in seqs]
        tokens = [t for s, d in zip(seqs, drafts) for t in (s.tokens[-1], *d, *[0] * (num_draft - len(d)))]
        positions = [min(len(s.tokens) - 1 + j, limit) for s in seqs for j in range(width)]
        dev = self.device
        hidden = self.decoder(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev),
                              _VerifyAttention(batch, width))
        picked = [b * width + j for b, d in enumerate(drafts) for j in range(len(d) + 1)]
        rows = [s for s, d in zip(seqs, drafts) for _ in range(len(d) + 1)]
        offsets = [j for d in drafts for j in range(len(d) + 1)]
        logits = self.model.logits(hidden[torch.tensor(picked, device=dev)])
        sampled, logprobs = self._sample(rows, logits, _Sampling.of(rows, self.model.args.vocab_size, dev), offsets)
        sampled, logprobs = sampled.tolist(), logprobs.tolist()
        kept_tokens, kept_logprobs, i = [], [], 0
        for seq, draft in zip(seqs, drafts):
            accepted = 0
            while accepted < len(draft) and sampled[i + accepted] == draft[accepted]:
                accepted += 1
            kept_tokens.append(sampled[i:i + accepted + 1])
            kept_logprobs.append(logprobs[i:i + accepted + 1])
            i += len(draft) + 1
            self.spec.count(seq.draft.source if draft else "none", len(draft), accepted)
            if draft:
                seq.acceptance.update(len(draft), accepted)
        self.spec.num_verify_steps += 1
        done = self._append(seqs, kept_tokens, kept_logprobs)
        batch.resync()
        return done

    def verify_step(self, drafts: dict[str, list[int]]) -> list[Output]:
        """One decode step that verifies ``drafts`` (request id -> draft tokens) instead of the
        drafter's: how :func:`~rollpacker.rollout.probe.verify_step_ms` times verify steps."""
        with torch.inference_mode():
            if self._admit():
                raise RuntimeError("verify_step with requests waiting for their prefill: step() first")
            return self._decode(drafts)

    def calibrate(self) -> SpecCost:
        """Measure :attr:`spec_cost` (``engine.speculative=auto``'s verify-step cost) on this engine,
        with the requests in flight set aside; TP rank 0's table is every rank's. A process measures
        once per model, TP size and engine settings. Counters are left as they were."""
        key = (repr(self.model.args), dist.get_world_size(self.tp_group) if self.tp_group else 1, str(self.device),
               self.dtype, self.config.block_size, self.config.spec_max_tokens, self.config.max_num_seqs)
        if key not in _SPEC_COSTS:
            from rollpacker.rollout.probe import measure_spec_cost

            saved = (self.waiting, self.num_preemptions, self.num_generated_tokens, self.num_prefill_tokens, self.spec)
            self.waiting, self.calibrating, self.spec = deque(), True, SpecStats()
            try:
                context = min(128, self.max_model_len // 4)
                cost = measure_spec_cost(self, min(32, self.config.max_num_seqs), self.config.spec_max_tokens, context)
            finally:
                self.calibrating = False
                (self.waiting, self.num_preemptions, self.num_generated_tokens, self.num_prefill_tokens,
                 self.spec) = saved
            if self.tp_group is not None:
                box = [cost]
                dist.broadcast_object_list(box, group=self.tp_group, group_src=0)
                cost = box[0]
            _SPEC_COSTS[key] = cost
        self.spec_cost = _SPEC_COSTS[key]
        return self.spec_cost

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor, sampling: _Sampling,
                offsets: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [B, vocab] fp32 -> the next token of every row [B] (the same on every TP rank)
        and its log-prob [B]. Row ``i`` draws response position ``len(tokens) + offsets[i]`` (a
        verify step's later draft positions)."""
        if sampling.temperatures is not None:
            logits = logits / sampling.temperatures
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen, tokens = logprobs.max(dim=-1)  # greedy: the first most likely token
        if sampling.sampled:
            u = torch.tensor([_uniform(seqs[i].seed, len(seqs[i].out.token_ids) + (offsets[i] if offsets else 0))
                              for i in sampling.sampled], device=logits.device)
            idx = sampling.sampled_index
            tokens[idx] = _sample(logprobs[idx], sampling.top_k, sampling.top_p, u)
        if self.tp_group is not None:
            dist.broadcast(tokens, group=self.tp_group, group_src=0)
        if sampling.sampled or self.tp_group is not None:
            chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        return tokens, chosen

    def _append(self, seqs: list[_Seq], tokens: list[list[int]], logprobs: list[list[float]]) -> list[Output]:
        """Append each row's new tokens and their log-probs, up to a stop token or the length limit;
        finish and return the requests done."""
        now = time.time()
        done = []
        for seq, row_tokens, row_logprobs in zip(seqs, tokens, logprobs):
            out = seq.out
            for tok, lp in zip(row_tokens, row_logprobs):
                seq.tokens.append(tok)
                append_token(out, tok, lp, now)
                self.num_generated_tokens += 1
                if tok in seq.stop_ids or stop_string_hit(self.decode, out.token_ids, seq.req.params.stop):
                    out.finish_reason = "stop"
                elif len(seq.tokens) >= seq.max_len:
                    out.finish_reason = "length"
                if out.finish_reason:
                    out.finish_time = now
                    done.append(seq)
                    break
        for seq in done:
            self.running.remove(seq)
            self._leave(seq)
        return [seq.out for seq in done]


def _slots(seqs: list[_Seq], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions: [len(seqs), P] token positions of each request -> their pool slots [len(seqs), P]."""
    width = max(len(s.blocks) for s in seqs)
    table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs])
    return table.gather(1, positions // block_size) * block_size + positions % block_size


def _sample(logprobs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with top-k/top-p truncation. logprobs: [B, V];
    top_k, top_p, u (the uniform draws): [B].

    Rows are always walked in descending-probability order, truncated or not, so a row's token
    depends on its own distribution and draw only, never on which other rows share the batch.
    """
    vocab = logprobs.shape[1]
    probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    probs = probs * ((rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0)))
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    return order.gather(1, idx).squeeze(1)
