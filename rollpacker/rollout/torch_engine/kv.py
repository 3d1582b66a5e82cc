"""TorchEngine's KV memory: the paged pool that prefill writes, and the decode workspace.

- The pool is fixed-size blocks under the memory budget; each running request holds a list of
  blocks, charged for its decoded tokens too (what admission and preemption count).
- Decode steps read and append K/V in a per-row contiguous workspace (:class:`DecodeBatch`),
  grouped by power-of-two context length, so one long request does not pad the short ones.
- Decoded K/V live in the workspace only: a request that leaves the running set frees its blocks
  (a preempted one is recomputed), so nothing reads them back from the pool; except a finished
  request of a session (:mod:`.resident`), whose decoded K/V are written back (:func:`write_back`)
  for its next turn's prefill to attend over (:class:`PrefillAttention`'s ``prefixed``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rollpacker.model.attention import Bucket, causal_packed_attention
from rollpacker.rollout.torch_engine.sampling import Sampling
from rollpacker.rollout.torch_engine.seq import Seq


@dataclass
class Prefixed:
    """A prefill request whose first tokens' K/V are already in the pool (a resident session's)."""

    start: int
    stop: int
    """Its new tokens' range in the prefill's flat tokens."""
    slots: torch.Tensor
    """Pool slots of its whole context [context]; its new tokens are the last ones."""


class PrefillAttention:
    """Prefill backend: writes the new K/V into the paged pool, then each request attends causally
    over its own tokens: all new (``buckets``), or, for a request continuing a resident session
    (``prefixed``), its whole context read back from the pool."""

    def __init__(self, cache: torch.Tensor, slots: torch.Tensor, buckets: list[Bucket],
                 prefixed: list[Prefixed] = ()):
        self.cache, self.slots, self.buckets, self.prefixed = cache, slots, buckets, prefixed

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.cache[layer].index_copy_(0, self.slots, kv)
        out = causal_packed_attention(q, kv[:, 0], kv[:, 1], self.buckets)
        for p in self.prefixed:  # 4-D, K/V at every head, lower-right causal: a fused kernel on CUDA (flash)
            context = self.cache[layer].index_select(0, p.slots).permute(1, 2, 0, 3)  # [2, kv, context, d]
            context = context.repeat_interleave(q.shape[1] // context.shape[1], dim=1)  # [2, heads, context, d]
            qp = q[p.start:p.stop].transpose(0, 1)[None]  # [1, heads, new, d]
            causal = causal_lower_right(p.stop - p.start, p.slots.numel())  # the new tokens end the context
            o = F.scaled_dot_product_attention(qp, context[0][None], context[1][None], attn_mask=causal)
            out[p.start:p.stop] = o[0].transpose(0, 1)
        return out.flatten(1)


def write_back(seq: Seq, cache: torch.Tensor, block_size: int) -> None:
    """Copy the K/V ``seq`` decoded (its workspace row's columns from ``seq.prefilled`` to its
    next-to-last token) into its pool blocks: then the pool holds its whole context but the
    newest token, which no forward has run yet."""
    lo, hi = seq.prefilled, len(seq.tokens) - 1
    if seq.group is None or hi <= lo:
        return
    slots = pool_slots([seq], torch.arange(lo, hi)[None], block_size)[0].to(cache.device)
    for layer in range(len(seq.group.stores)):
        cache[layer, slots, 0] = seq.group.keys(layer)[seq.slot, :, :, lo:hi].permute(2, 0, 1)  # [columns, kv, d]
        cache[layer, slots, 1] = seq.group.values(layer)[seq.slot, :, lo:hi].transpose(0, 1)


class DecodeBatch:
    """The running requests of the decode steps, with a per-row contiguous KV workspace that
    follows the running set a row at a time.

    Rows sit in power-of-two length groups (:class:`LengthGroup`): a row of context ``L`` (cached
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
    its group's capacity (under 2x its context), plus each group's spare rows. A group that needs
    more rows grows to 1.25x the rows it needs; one left using under two thirds of its rows shrinks
    to 1.25x those it uses; an empty group is freed. So a group holds at most 1.5x the rows it uses
    (the memory plan's bound, ``plan.memory.decode_workspace``), and its stores are reallocated only
    once a sixth of its rows or more came or went.

    A step appends the K and V of a group's rows with one ``put_`` per layer (flat indices
    advanced in place), and attends over the group's longest context with an additive mask over
    each row's right padding. While a group's rows have the same length (steady batches) it
    needs neither: their newest tokens share a column, written with one strided copy each.
    Per layer, K is kept transposed, ``[rows * kv_heads, head_dim, capacity]`` (so ``q @ K^T``
    is a plain batched matmul), and V as ``[rows * kv_heads, capacity, head_dim]``. Per-step
    inputs (tokens, positions, indices, masks) are rebuilt on the host after rows change and
    advanced in place otherwise.
    """

    def __init__(self, cache: torch.Tensor, block_size: int, vocab_size: int):
        self.cache, self.block_size, self.vocab_size = cache, block_size, vocab_size
        self.scale = self.cache.shape[-1] ** -0.5
        self.groups: dict[int, LengthGroup] = {}
        """By capacity."""
        self.order: list[LengthGroup] = []
        """The groups in batch order (longest first), as of the last layout."""
        self.seqs: list[Seq] = []
        """The rows in batch order (each group's rows in turn), as of the last layout."""
        self.changed = False
        """Rows were added, dropped or moved since the last layout."""

    def remove(self, seq: Seq) -> None:
        """Drop ``seq``'s row: its request leaves the running set, and its K/V are not needed."""
        seq.group.drop([seq.slot])
        seq.group, seq.slot = None, -1
        self._free_empty()
        self.changed = True

    def _free_empty(self) -> None:
        self.groups = {capacity: g for capacity, g in self.groups.items() if g.seqs}

    def update(self, running: list[Seq], extra: int = 0) -> None:
        """Before a decode step over ``running`` that appends ``extra + 1`` tokens per row (``extra``:
        a verify step's draft length): move the rows that outgrew their group, add rows for the
        requests admitted since the last step, and lay the batch out if anything changed (a verify
        step needs the rows' places only; the next plain step builds its own state)."""
        for group in list(self.groups.values()):
            if group.seqs and group.width + extra > group.capacity:
                grown: dict[int, list[Seq]] = {}
                for s in group.seqs:
                    if len(s.tokens) + extra > group.capacity:
                        grown.setdefault(row_capacity(len(s.tokens) + extra), []).append(s)
                for capacity, seqs in grown.items():
                    self._group(capacity).take(seqs)
                self._free_empty()
                self.changed = True
        if len(running) > sum(len(g.seqs) for g in self.groups.values()):
            admitted: dict[int, list[Seq]] = {}
            for seq in running:
                if seq.group is None:
                    admitted.setdefault(row_capacity(len(seq.tokens) + extra), []).append(seq)
            for capacity, seqs in admitted.items():
                self._group(capacity).gather(seqs, self.cache, self.block_size)
            self.changed = True
        if self.changed:
            self._layout(decode=not extra)

    def _group(self, capacity: int) -> LengthGroup:
        """The group of ``capacity``, created if need be."""
        if capacity not in self.groups:
            self.groups[capacity] = LengthGroup(capacity, self.cache)
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
        self.sampling = Sampling.of(self.seqs, self.vocab_size, dev)
        self.changed = False

    def advance(self, tokens: torch.Tensor) -> None:
        """After a step that sampled ``tokens`` for every row: move every row one position on."""
        self.tokens = tokens
        self.positions += 1
        self.sampling.advance(tokens)
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


def row_capacity(context: int) -> int:
    """The workspace capacity of a row of ``context`` tokens: its power-of-two length bucket, as
    :func:`~rollpacker.model.attention.length_groups`."""
    return max(16, 1 << (context - 1).bit_length())


class LengthGroup:
    """The decode rows whose context fits ``capacity`` columns (and, above 16, exceeds half of
    it), each left-aligned in its own row of the group's workspace, one store per layer.

    ``stores[layer]`` is ``[2, rows, kv_heads, head_dim * capacity]``: per row, K^T ``[kv_heads,
    head_dim, capacity]`` then V ``[kv_heads, capacity, head_dim]``; its first ``len(seqs)`` rows are
    in use, ``seqs[i]`` in row ``i`` (and ``seqs[i].slot == i``). A store is reallocated a layer at a
    time (:meth:`_realloc`), so a resize holds one layer twice, not the group."""

    def __init__(self, capacity: int, cache: torch.Tensor):
        num_layers, _, _, kv, d = cache.shape
        self.capacity, self.num_kv_heads, self.head_dim = capacity, kv, d
        # zeros: padding is finite
        self.stores = [cache.new_zeros(2, 0, kv, d * capacity) for _ in range(num_layers)]
        self.device = cache.device
        self.seqs: list[Seq] = []
        self.changed = True
        """Rows were added or dropped since the last layout."""
        # per-step state, set by layout(): the group's rows of the batch, its longest context,
        # the flat positions of every row's newest K and V in a layer's store and the mask
        # (None while all rows have the same length), per-layer views of the rows in use
        self.start = self.stop = self.width = 0
        self.index = self.index_step = self.mask = self.mask_index = None
        self._forget_views()
        self.verify_cache: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        """A verify step's write positions for its current shape (see :meth:`verify_index`)."""

    def _forget_views(self) -> None:
        self.flat: list[torch.Tensor] = []
        self.keys_now: tuple[torch.Tensor, ...] = ()
        self.values_now: tuple[torch.Tensor, ...] = ()
        self.k_mats: tuple[torch.Tensor, ...] = ()
        self.v_mats: tuple[torch.Tensor, ...] = ()

    @property
    def rows(self) -> int:
        """Rows the stores hold, in use or spare."""
        return self.stores[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(store.nbytes for store in self.stores)

    def keys(self, layer: int) -> torch.Tensor:
        """A layer's K^T [rows, kv_heads, head_dim, capacity] (a view of its store)."""
        return self.stores[layer][0].view(self.rows, self.num_kv_heads, self.head_dim, self.capacity)

    def values(self, layer: int) -> torch.Tensor:
        """A layer's V [rows, kv_heads, capacity, head_dim] (a view of its store)."""
        return self.stores[layer][1].view(self.rows, self.num_kv_heads, self.capacity, self.head_dim)

    def _realloc(self, remake) -> None:
        """Replace each layer's store by ``remake(store)``, a layer at a time: the old one is freed
        before the next is made (no view of it is kept: the next layout makes them again)."""
        self._forget_views()
        for layer in range(len(self.stores)):
            self.stores[layer] = remake(self.stores[layer])
        self.changed = True

    def resize(self, rows: int) -> None:
        """Give the stores ``rows`` rows, keeping those in use."""
        used = len(self.seqs)

        def remake(store: torch.Tensor) -> torch.Tensor:
            new = store.new_zeros(2, rows, *store.shape[2:])
            new[:, :used].copy_(store[:, :used])
            return new

        self._realloc(remake)

    def append(self, seqs: list[Seq]) -> int:
        """Give ``seqs`` the next rows (their K/V still to be written); the first one's index."""
        first, needed = len(self.seqs), len(self.seqs) + len(seqs)
        if needed > self.rows:
            self.resize(needed + needed // 4)
        for i, seq in enumerate(seqs, first):
            seq.group, seq.slot = self, i
        self.seqs += seqs
        self.changed = True
        return first

    def gather(self, seqs: list[Seq], cache: torch.Tensor, block_size: int) -> None:
        """Append rows for ``seqs`` and fill them with their cached K/V from the paged pool."""
        first = self.append(seqs)
        cached = [len(s.tokens) - 1 for s in seqs]  # all but the token decoded this step
        width = max(cached)
        # [rows, width] positions; past a row's end, its last token again (overwritten or masked)
        position = torch.minimum(torch.arange(width)[None, :], torch.tensor(cached)[:, None] - 1)
        slots = pool_slots(seqs, position, block_size).flatten().to(cache.device)
        rows, kv, d = slice(first, first + len(seqs)), self.num_kv_heads, self.head_dim
        for layer in range(len(self.stores)):
            cached_kv = cache[layer].index_select(0, slots).view(len(seqs), width, 2, kv, d)
            self.keys(layer)[rows, ..., :width].copy_(cached_kv[:, :, 0].permute(0, 2, 3, 1))
            self.values(layer)[rows, :, :width].copy_(cached_kv[:, :, 1].permute(0, 2, 1, 3))

    def take(self, seqs: list[Seq]) -> None:
        """Move the rows of ``seqs`` here from the (one) smaller group they outgrew."""
        src, rows = seqs[0].group, [s.slot for s in seqs]
        self._copy_in(src, rows, self.append(seqs))
        src.drop(rows)

    def _copy_in(self, src: LengthGroup, rows: list[int], first: int) -> None:
        """Copy ``src``'s ``rows`` into this group's rows from ``first`` on."""
        kv, d, cap = self.num_kv_heads, self.head_dim, src.capacity
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))  # as when a whole batch grows: no gather
        index = None if contiguous else torch.tensor(rows, device=self.device)
        moved = slice(first, first + len(rows))
        for layer, store in enumerate(src.stores):
            kv_rows = store[:, rows[0]:rows[0] + len(rows)] if contiguous else store.index_select(1, index)
            self.keys(layer)[moved, ..., :cap].copy_(kv_rows[0].view(len(rows), kv, d, cap))
            self.values(layer)[moved, :, :cap].copy_(kv_rows[1].view(len(rows), kv, cap, d))

    def drop(self, rows: list[int]) -> None:
        """Free ``rows``: the last rows still in use move into those of them below the new end; the
        stores shrink to 1.25x the rows left if they hold over 1.5x those (one gather per layer)."""
        end, dropped = len(self.seqs) - len(rows), set(rows)
        holes = sorted(i for i in rows if i < end)
        movers = [i for i in range(end, len(self.seqs)) if i not in dropped]  # as many as the holes
        if 2 * self.rows > 3 * end:
            order = list(range(end))
            for i, j in zip(holes, movers):
                order[i] = j
            order += order[:1] * (end // 4)  # spare rows: copies of a row, finite as the padding is
            index = torch.tensor(order, dtype=torch.long, device=self.device)
            self._realloc(lambda store: store.index_select(1, index))
        elif holes:
            holes_at, movers_at = (torch.tensor(i, device=self.device) for i in (holes, movers))
            for store in self.stores:
                store.index_copy_(1, holes_at, store.index_select(1, movers_at))
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
        layers = range(len(self.stores))
        self.keys_now = tuple(self.keys(layer)[:n] for layer in layers)  # [rows, kv, d, capacity]
        self.values_now = tuple(self.values(layer)[:n] for layer in layers)  # [rows, kv, capacity, d]
        self.k_mats = tuple(k.flatten(0, 1) for k in self.keys_now)
        self.v_mats = tuple(v.flatten(0, 1) for v in self.values_now)
        self.flat = [store.view(-1) for store in self.stores]
        if not decode:
            return
        self.changed = False
        dev = self.device
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
            v_index = self.rows * kv * d * cap + (heads * cap + newest) * d + dims
            self.index = torch.stack((k_index, v_index), dim=1).to(dev)  # [n, 2, kv, d]: flat, in a layer's store
            self.index_step = torch.tensor([1, d], device=dev).view(1, 2, 1, 1)
            valid = torch.arange(cap)[None, :] < contexts[:, None]  # [n, capacity]
            mask = torch.where(valid, 0.0, float("-inf")).to(self.stores[0].dtype).repeat_interleave(kv, dim=0)
            self.mask = mask[:, None, :].to(dev)  # additive, over each row's right padding: [rows * kv, 1, capacity]
            self.mask_index = (torch.arange(n * kv) * cap + newest.flatten().repeat_interleave(kv)).to(dev)

    def verify_index(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat K and V positions [rows, width, 2, kv, d] of ``width`` columns from column 0 of
        every row in use, and their step per column of a row's start; cached per shape."""
        key = (len(self.seqs), width, self.rows)
        if key not in self.verify_cache:
            n, kv, d, cap = len(self.seqs), self.num_kv_heads, self.head_dim, self.capacity
            heads = torch.arange(n * kv).view(n, 1, kv, 1)
            dims, columns = torch.arange(d), torch.arange(width).view(1, width, 1, 1)
            k_index = (heads * d + dims) * cap + columns
            v_index = self.rows * kv * d * cap + (heads * cap + columns) * d + dims
            step = torch.tensor([1, d]).view(1, 1, 2, 1, 1)
            dev = self.device
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


def pool_slots(seqs: list[Seq], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions: [len(seqs), P] token positions of each request -> their pool slots [len(seqs), P]."""
    width = max(len(s.blocks) for s in seqs)
    table = torch.tensor([s.blocks + [0] * (width - len(s.blocks)) for s in seqs])
    return table.gather(1, positions // block_size) * block_size + positions % block_size
