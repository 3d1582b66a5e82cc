"""TorchEngine: continuous batching over rollpacker's own decoder, on CPU or GPU.

- **Paged KV cache.** K and V live in fixed-size blocks of one preallocated pool sized by a
  memory budget; a block table maps each running request to its blocks.
- **Continuous batching.** Each ``step()`` is one forward pass: a prefill of newly admitted
  requests when any can be admitted (prefill first, as vLLM's v0 scheduler), otherwise one decode
  token for every running request. Finished requests leave and free their blocks at once.
- **Preemption by recomputation.** When a decode needs a block and none is free, the most
  recently admitted request is evicted: its blocks are freed, its tokens kept, and it is
  re-prefilled later. Each eviction is counted (the parallelism planner's signal).
- **Ragged attention without a long-tail penalty.** Decode rows are bucketed by context length
  (power-of-two buckets), so one long request does not pad every short one to its length.
- **Sampling** is batched (temperature, top-k, top-p per request). Each request's random draw at
  response position ``i`` is a hash of ``(seed, i)``: results do not depend on batch
  composition, preemption or TP rank, and a resumed request continues its sequence exactly.
- **Tensor parallelism** over a TP sub-mesh (gloo on CPU, NCCL on GPU): every rank of the group
  runs the same schedule on its slice of heads; TP rank 0's sampled tokens are broadcast so the
  ranks can never diverge.

What it leaves out for now: prefix sharing across a prompt's group, chunked prefill, CUDA graphs.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from rollpacker.model.attention import Bucket, causal_packed_attention, length_buckets, length_groups
from rollpacker.model.parallelize import apply_rollout_tp
from rollpacker.model.transformer import Transformer
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import EngineStats, Output, Request

_MASK64 = (1 << 64) - 1


@dataclass(eq=False)
class _Seq:
    req: Request
    out: Output
    tokens: list[int]
    """Prompt followed by every generated token."""
    seed: int
    stop_ids: frozenset[int]
    blocks: list[int] = field(default_factory=list)
    row: int = -1
    """Row of the block table while running."""


def _uniform(seed: int, index: int) -> float:
    """A uniform draw in [0, 1) from (seed, index): splitmix64 of their combination."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class _StepAttention:
    """Attention backend of one forward pass: writes the new K/V into the paged cache, then attends.

    Prefill: each request attends causally over its own (all new) tokens. Decode: each request's
    single query attends over its cached context, gathered per length bucket.
    """

    def __init__(self, cache: torch.Tensor, slots: torch.Tensor, block_size: int,
                 prefill: list[Bucket] | None = None, decode: list[_DecodeBucket] | None = None):
        self.cache, self.slots, self.block_size = cache, slots, block_size
        self.prefill, self.decode = prefill, decode

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache[layer]
        k_cache.index_copy_(0, self.slots, k)
        v_cache.index_copy_(0, self.slots, v)
        if self.prefill is not None:
            return causal_packed_attention(q, k, v, self.prefill)
        num_kv = k.shape[1]
        whole = len(self.decode) == 1  # one bucket holds every row, in order: no gather/scatter of q
        out = None if whole else torch.empty_like(q)
        k_blocks = k_cache.unflatten(0, (-1, self.block_size))  # [num_blocks, block, kv_heads, head_dim]
        v_blocks = v_cache.unflatten(0, (-1, self.block_size))
        for b in self.decode:
            num_rows, width = b.valid.shape
            qb = (q if whole else q.index_select(0, b.rows)).unflatten(1, (num_kv, -1))  # [B, kv, group, dim]
            # whole blocks are gathered (index_select copies them as contiguous rows)
            kb = k_blocks.index_select(0, b.blocks.flatten()).view(num_rows, width, num_kv, -1).transpose(1, 2)
            vb = v_blocks.index_select(0, b.blocks.flatten()).view(num_rows, width, num_kv, -1).transpose(1, 2)
            ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=b.valid[:, None, None, :])
            if whole:
                return ob.flatten(1, 2)
            out.index_copy_(0, b.rows, ob.flatten(1, 2))
        return out


@dataclass
class _DecodeBucket:
    """Decode rows of similar context length: their cache blocks ``[B, num_blocks]`` and which
    of the ``num_blocks * block_size`` gathered slots hold real tokens."""

    rows: torch.Tensor
    blocks: torch.Tensor
    valid: torch.Tensor


class TorchEngine:
    """Continuous-batching engine over :class:`Transformer`; see the module docstring."""

    def __init__(self, model: Transformer, config: EngineConfig | None = None, tp_mesh: DeviceMesh | None = None):
        self.config = config = config or EngineConfig()
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
        self.num_blocks = int(config.kv_memory_mb * 2**20) // block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"engine.kv_memory_mb={config.kv_memory_mb} holds no {block_bytes}-byte KV block")
        self.max_blocks_per_seq = -(-self.max_model_len // config.block_size)
        self.block_table = torch.zeros(config.max_num_seqs, self.max_blocks_per_seq, dtype=torch.long)
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.cache: torch.Tensor | None = None
        self.resume_memory()
        self.rng = random.Random(config.seed)
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0

    # ---- the contract -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._validate(request)
        p = request.params
        partial = request.resume_from
        out = Output(id=request.id, prompt_ids=list(request.prompt_ids))
        if partial is not None:
            out.token_ids, out.logprobs = list(partial.token_ids), list(partial.logprobs)
            out.first_token_time, out.num_preemptions = partial.first_token_time, partial.num_preemptions
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        self.waiting.append(_Seq(request, out, out.prompt_ids + out.token_ids, seed, stop_ids))

    def abort(self, request_id: str) -> Output:
        for queue in (self.running, self.waiting):
            for seq in queue:
                if seq.req.id == request_id:
                    queue.remove(seq)
                    self._free(seq)
                    seq.out.finish_reason = "abort"
                    seq.out.finish_time = time.time()
                    return seq.out
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
        )

    @torch.inference_mode()
    def step(self) -> list[Output]:
        if self.cache is None:
            raise RuntimeError("step() after release_memory(): call resume_memory() first")
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
        self.cache = None

    def resume_memory(self) -> None:
        if self.cache is None:
            args = self.model.args
            self.cache = torch.zeros(
                args.num_layers, 2, self.num_blocks * self.config.block_size, self.num_kv_heads, args.head_dim,
                dtype=self.dtype, device=self.device,
            )

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
        longest = min(len(prompt) + p.max_new_tokens, self.max_model_len)
        if not problems and self._blocks_for(longest) > self.num_blocks:
            problems.append(
                f"it may need {longest} tokens of KV but the cache holds "
                f"{self.num_blocks * self.config.block_size}: raise engine.kv_memory_mb"
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
            self.block_table[seq.row, :need] = torch.tensor(seq.blocks)
            admitted.append(seq)
            budget -= n
            reserve += 1
        self.running.extend(admitted)
        return admitted

    def _free(self, seq: _Seq) -> None:
        self.free_blocks.extend(seq.blocks)
        seq.blocks = []
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1

    def _preempt(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        self.waiting.appendleft(seq)
        seq.out.num_preemptions += 1
        self.num_preemptions += 1

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slot of each (block-table row, token position) pair."""
        bs = self.config.block_size
        return self.block_table[rows, positions // bs] * bs + positions % bs

    # ---- forward passes ---------------------------------------------------------------------

    def _prefill(self, seqs: list[_Seq]) -> list[Output]:
        lengths = [len(s.tokens) for s in seqs]
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(n) for n in lengths])
        rows = torch.repeat_interleave(torch.tensor([s.row for s in seqs]), torch.tensor(lengths))
        tokens = torch.tensor([t for s in seqs for t in s.tokens])
        dev = self.device
        attn = _StepAttention(self.cache, self._slots(rows, positions).to(dev), self.config.block_size,
                              prefill=length_buckets(lengths, starts, dev))
        hidden = self.model(tokens.to(dev), positions.to(dev), attn)
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lengths)], device=dev)
        self.num_prefill_tokens += len(tokens)
        return self._sample_and_append(seqs, self.model.logits(hidden[last]))

    def _decode(self) -> list[Output]:
        # Every running request needs a slot for its newest token; evict the newest requests
        # (LIFO, as vLLM) until the older ones fit.
        bs = self.config.block_size
        for seq in list(self.running):
            if seq.row < 0:
                continue  # evicted by this loop already
            while len(seq.tokens) > len(seq.blocks) * bs:
                if self.free_blocks:
                    block = self.free_blocks.pop()
                    self.block_table[seq.row, len(seq.blocks)] = block
                    seq.blocks.append(block)
                else:
                    self._preempt(self.running[-1])
                    if seq.row < 0:
                        break
        seqs = self.running
        lengths = [len(s.tokens) for s in seqs]
        rows = torch.tensor([s.row for s in seqs])
        positions = torch.tensor(lengths) - 1
        dev = self.device
        decode = []
        for group in length_groups(lengths):
            members = torch.tensor(group)
            lens = positions[members] + 1
            num_blocks = -(-int(lens.max()) // bs)
            blocks = self.block_table[rows[members], :num_blocks]
            valid = torch.arange(num_blocks * bs)[None, :] < lens[:, None]
            decode.append(_DecodeBucket(members.to(dev), blocks.to(dev), valid.to(dev)))
        attn = _StepAttention(self.cache, self._slots(rows, positions).to(dev), bs, decode=decode)
        tokens = torch.tensor([s.tokens[-1] for s in seqs], device=dev)
        hidden = self.model(tokens, positions.to(dev), attn)
        return self._sample_and_append(list(seqs), self.model.logits(hidden))

    def _sample_and_append(self, seqs: list[_Seq], logits: torch.Tensor) -> list[Output]:
        """logits: [B, vocab] fp32. Samples, appends, finishes; returns finished outputs."""
        params = [s.req.params for s in seqs]
        temps = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
        logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
        tokens = logprobs.argmax(-1)
        sampled = [i for i, p in enumerate(params) if p.temperature > 0]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            u = torch.tensor([_uniform(seqs[i].seed, len(seqs[i].out.token_ids)) for i in sampled],
                             device=logits.device)
            tokens[idx] = _sample(logprobs[idx], [params[i] for i in sampled], u)
        if self.tp_group is not None:
            dist.broadcast(tokens, group=self.tp_group, group_src=0)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        now = time.time()
        finished = []
        for seq, tok, lp in zip(seqs, tokens.tolist(), chosen):
            out, p = seq.out, seq.req.params
            seq.tokens.append(tok)
            out.token_ids.append(tok)
            out.logprobs.append(lp)
            if out.first_token_time is None:
                out.first_token_time = now
            if tok in seq.stop_ids:
                out.finish_reason = "stop"
            elif len(out.token_ids) >= p.max_new_tokens or len(seq.tokens) >= self.max_model_len:
                out.finish_reason = "length"
            if out.finish_reason:
                out.finish_time = now
                self.running.remove(seq)
                self._free(seq)
                finished.append(out)
        self.num_generated_tokens += len(seqs)
        return finished


def _sample(logprobs: torch.Tensor, params: list, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row with top-k/top-p truncation. logprobs: [B, V].

    Rows are always walked in descending-probability order, truncated or not, so a row's token
    depends on its own distribution and draw only, never on which other rows share the batch.
    """
    vocab = logprobs.shape[1]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=logprobs.device)
    top_p = torch.tensor([p.top_p for p in params], device=logprobs.device)
    probs, order = logprobs.exp().sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    probs = probs * ((rank < top_k[:, None]) & ((before < top_p[:, None]) | (rank == 0)))
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
    return order.gather(1, idx).squeeze(1)
