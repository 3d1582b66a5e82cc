"""TorchEngine: continuous batching over rollpacker's own decoder, on CPU or GPU (the scheduler).

Each ``step()`` is one forward pass: a prefill of newly admitted requests if any fit, else one
decode token for every running request.

Invariants:

- Waiting requests are admitted lowest ``Request.priority`` first, FIFO among equals.
- Without a free block, the newest request of the worst priority is preempted and recomputed
  later. Each preemption is counted.
- Resident sessions are evicted before any running request is preempted.
- Every rank of a TP group runs the same schedule on its slice of heads.

Why our own engine: it runs the native decoder on CPU, where it is the fastest we have, and its
sampling makes exact resume and speculation possible. Its design: ``docs/engines.md``.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import deque
from collections.abc import Callable, Container, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rollpacker.errors import UserError
from rollpacker.model.attention import length_buckets
from rollpacker.model.parallelize import apply_rollout_tp
from rollpacker.model.transformer import Transformer
from rollpacker.rollout.config import EngineConfig, sampling_problem
from rollpacker.rollout.drafter import Drafter
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
from rollpacker.rollout.probe import spec_probe
from rollpacker.rollout.spec_cost import Realized, SpecCost
from rollpacker.rollout.torch_engine.kv import DecodeBatch, PrefillAttention, Prefixed, pool_slots, write_back
from rollpacker.rollout.torch_engine.layout import Decoder, local
from rollpacker.rollout.torch_engine.resident import Sessions
from rollpacker.rollout.torch_engine.sampling import Sampling, sample_tokens
from rollpacker.rollout.torch_engine.seq import Seq
from rollpacker.rollout.torch_engine.verify import Speculation


class TorchEngine(Speculation):
    """Continuous-batching engine over :class:`Transformer`; see the module docstring."""

    logprobs_truncated = False

    def __init__(self, model: Transformer, config: EngineConfig | None = None, tp_mesh: DeviceMesh | None = None,
                 spec_cost: SpecCost | None = None, decode: Callable[[list[int]], str] | None = None,
                 clock: Callable[[], float] | None = None):
        """``spec_cost``: the verify-step cost ``engine.speculative=auto`` decides by; None measures it
        at the first step that finds the engine idle (see :meth:`calibrate`). ``decode``: for stop strings.
        ``clock``: times decode steps for ``auto``'s realized payoff (:class:`Realized`); None: CPU time
        on CPU, synchronized wall time on a GPU (:func:`~rollpacker.rollout.probe.step_clock`)."""
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
        self.vocab_size = args.vocab_size
        self.eos_ids = frozenset(args.eos_token_ids)
        block_bytes = (
            config.block_size * 2 * args.num_layers * self.num_kv_heads * args.head_dim * self.dtype.itemsize
        )
        self.weight_bytes = sum(local(p).nbytes for p in model.parameters())  # this rank's shard
        self.budget = "memory_mb" if config.memory_mb else "kv_memory_mb"  # the setting that sizes the KV cache
        kv_bytes = config.memory_mb * 2**20 - self.weight_bytes if config.memory_mb else config.kv_memory_mb * 2**20
        self.num_blocks = int(kv_bytes) // block_bytes
        self.kv_capacity_tokens = self.num_blocks * config.block_size
        if self.num_blocks < 1:  # the config's: said once, no traceback
            raise UserError(f"engine.{self.budget}={getattr(config, self.budget)} (this rank's weights: "
                            f"{self.weight_bytes / 2**20:.2f} MiB) holds no {block_bytes}-byte KV block: raise "
                            f"engine.{self.budget}")
        self.free_rows = list(range(config.max_num_seqs - 1, -1, -1))
        self.free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.cache: torch.Tensor | None = None
        self.resume_memory()
        self.decoder = Decoder(model, self.tp_group, self.max_model_len)
        self.batch: DecodeBatch | None = None
        """The decode rows and their KV workspace; None until the first decode step after
        ``resume_memory``."""
        self.rng = random.Random(config.seed)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.sessions = Sessions(config.block_size)
        self.num_reused_prefill_tokens = 0
        self.weights = 0
        """Weight pushes so far: a session's KV computed before one is never reused after."""
        self.num_session_evictions = 0
        self.drafter = Drafter() if config.speculative != "off" else None
        if config.speculative == "auto" and spec_cost is None:
            spec_probe(self.max_model_len, config.spec_max_tokens, kv_tokens=self.kv_capacity_tokens)  # fits, or says
        self.spec = SpecStats()
        self.spec_cost = spec_cost
        self.calibrating = False
        self.realized = Realized(agree=self._tp_rank0 if self.tp_group is not None else None)
        self.num_proposing_steps = 0
        """Decode steps that asked the drafter for drafts (:meth:`_propose`), verified or not."""
        if clock is None:
            from rollpacker.rollout.probe import step_clock

            clock = step_clock(self.device)
        self.clock = clock

    # ---- the contract -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._validate(request)
        if request.session is not None and not self.config.resident_sessions:
            request = dataclasses.replace(request, session=None)
        p = request.params
        out = start_output(request)
        stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_ids)
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        max_len = min(len(out.prompt_ids) + p.max_new_tokens, self.max_model_len)
        seq = Seq(request, out, out.prompt_ids + out.token_ids, seed, stop_ids, max_len)
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
            num_reused_prefill_tokens=self.num_reused_prefill_tokens,
            num_session_evictions=self.num_session_evictions,
            num_resident_sessions=len(self.sessions),
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
            return self._timed_decode() if self.config.speculative == "auto" else self._decode()
        return []

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        tied, missing = self.model.args.tie_word_embeddings, set(params)
        for name, tensor in named_tensors:
            name = name.removeprefix("model.")
            if tied and name == "lm_head.weight":
                continue
            if name not in params:
                raise KeyError(f"update_weights: {name!r} is not a parameter of the engine's model")
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            param = params[name]
            if tensor.shape != param.shape:  # copy_ broadcasts: a row would fill the whole matrix
                raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's "
                                 f"{tuple(param.shape)}")
            missing.discard(name)
            if hasattr(param, "device_mesh"):  # a TP shard: keep this rank's slice
                from torch.distributed.tensor import distribute_tensor

                local = distribute_tensor(tensor, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(local.to_local())
            else:
                param.copy_(tensor)
        if missing:  # kept the old weights (after a TP switch: uninitialized memory)
            raise KeyError(f"update_weights: no tensor for {len(missing)} of the engine's parameters, e.g. "
                           f"{', '.join(sorted(missing)[:3])}: a push holds them all")
        self.free_blocks.extend(self.sessions.clear())  # their K/V are the old weights'
        self.weights += 1  # and those of the requests running now

    def end_session(self, session: str) -> None:
        """Free ``session``'s resident KV, if it is still resident."""
        self.free_blocks.extend(self.sessions.drop(session))

    def release_memory(self) -> None:
        if self.has_unfinished():
            raise RuntimeError(
                f"release_memory with {len(self.running)} running and {len(self.waiting)} waiting "
                "requests: finish or abort them first"
            )
        self.free_blocks.extend(self.sessions.clear())
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
        """Bytes the decode workspace holds now, beside the KV pool (:class:`~.kv.DecodeBatch`)."""
        return sum(g.nbytes for g in self.batch.groups.values()) if self.batch is not None else 0

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
        elif min(prompt) < 0 or max(prompt) >= self.vocab_size:
            problems.append(f"a prompt token id is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) + done >= self.max_model_len:
            problems.append(
                f"prompt ({len(prompt)} tokens, {done} resumed) leaves no room in the context "
                f"length {self.max_model_len}"
            )
        if p.max_new_tokens <= 0:
            problems.append(f"max_new_tokens={p.max_new_tokens} must be positive")
        elif done >= p.max_new_tokens:
            problems.append(f"the resumed output already has {done} >= max_new_tokens tokens")
        if problem := sampling_problem(p):
            problems.append(f"bad sampling: {problem}")
        problems += check_stop(self, request)
        for c in request.draft_context:
            if not c.source or c.source in ENGINE_DRAFT_SOURCES or c.source == "none":
                problems.append(f"draft_context source {c.source!r} is empty or one of the engine's own "
                                f"{ENGINE_DRAFT_SOURCES}: name it after what it is (e.g. 'partial', 'epoch')")
            elif c.token_ids and (min(c.token_ids) < 0 or max(c.token_ids) >= self.vocab_size):
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

    def _admit(self) -> list[Seq]:
        """Move waiting requests into the running set while rows, blocks and the prefill budget allow
        (evicting resident sessions for blocks); a request of a resident session takes its blocks over."""
        admitted: list[Seq] = []
        budget = self.config.max_prefill_tokens
        # Keep one free block per running request so the next decode step rarely preempts.
        reserve = len(self.running)
        queued = self._queued_sessions()
        while self.waiting and self.free_rows:
            seq = self.waiting[0]
            n, session = len(seq.tokens), seq.req.session
            cached, held = self.sessions.match(session, seq.tokens)
            # while requests run, a queued turn's session is not evicted for another: blocks come back
            spare = queued if self.running or admitted else {session}
            if admitted and n - cached > budget or not self._make_room(self._blocks_for(n) - held + reserve, spare):
                break
            self.waiting.popleft()
            seq.blocks, freed = self.sessions.take(session, cached)
            self.free_blocks.extend(freed)
            seq.blocks += [self.free_blocks.pop() for _ in range(self._blocks_for(n) - len(seq.blocks))]
            seq.cached, seq.row, seq.weights = cached, self.free_rows.pop(), self.weights
            admitted.append(seq)
            budget -= n - cached
            reserve += 1
        self.running.extend(admitted)
        return admitted

    def _queued_sessions(self) -> set[str]:
        """The sessions of the waiting requests (whose resident KV is about to be reused)."""
        return {s.req.session for s in self.waiting if s.req.session is not None} if len(self.sessions) else set()

    def _make_room(self, num_blocks: int, spare: Container[str] = ()) -> bool:
        """Evict resident sessions not in ``spare``, least recently kept first, until ``num_blocks``
        blocks are free; whether they are."""
        while len(self.free_blocks) < num_blocks:
            freed = self.sessions.evict(spare)
            if freed is None:
                return False
            self.free_blocks.extend(freed)
            self.num_session_evictions += 1
        return True

    def _leave(self, seq: Seq, finished: bool = False) -> None:
        """``seq`` leaves the engine for good (finished or aborted); a finished request of a session
        leaves its KV resident, unless the weights changed since its admission."""
        if finished and seq.req.session is not None and seq.weights == self.weights:
            self._keep_resident(seq)
        self._free(seq)
        if self.drafter is not None:
            self.drafter.remove(seq.req.id)

    def _keep_resident(self, seq: Seq) -> None:
        """Keep a finished request's KV for its session: blocks for all its tokens but the last (a verify
        step's last tokens are not charged yet: charged now, or nothing is kept if no block is left),
        the decoded K/V written back to them."""
        keep = self._blocks_for(len(seq.tokens) - 1)
        while len(seq.blocks) < keep:
            if not self._make_room(1):
                return
            seq.blocks.append(self.free_blocks.pop())
        write_back(seq, self.cache, self.config.block_size)
        self.free_blocks.extend(self.sessions.keep(seq.req.session, seq.tokens[:-1], seq.blocks[:keep]))
        seq.blocks = seq.blocks[keep:]

    def _free(self, seq: Seq) -> None:
        if seq.group is not None:
            self.batch.remove(seq)
        if seq.row >= 0:
            self.free_rows.append(seq.row)
            seq.row = -1
        self.free_blocks.extend(seq.blocks)
        seq.blocks = []

    def _enqueue(self, seq: Seq, *, ahead: bool = False) -> None:
        """Queue ``seq`` by priority (lower first): after its equals, or ``ahead`` of them (preempted)."""
        p, i = seq.req.priority, len(self.waiting)
        while i and (self.waiting[i - 1].req.priority > p or ahead and self.waiting[i - 1].req.priority == p):
            i -= 1
        self.waiting.insert(i, seq)

    def _preempt(self, seq: Seq) -> None:
        self.running.remove(seq)
        self._free(seq)
        self._enqueue(seq, ahead=True)
        seq.out.num_preemptions += 1
        self.num_preemptions += 1

    # ---- forward passes ---------------------------------------------------------------------

    def _prefill(self, seqs: list[Seq]) -> list[Output]:
        """One forward over the admitted requests' tokens past their reused prefix (all, mostly)."""
        new = [len(s.tokens) - s.cached for s in seqs]
        starts = [0]
        for n in new[:-1]:
            starts.append(starts[-1] + n)
        positions = torch.cat([torch.arange(s.cached, len(s.tokens)) for s in seqs])
        tokens = torch.tensor([t for s in seqs for t in s.tokens[s.cached:]])
        dev = self.device
        hidden = self.decoder(tokens.to(dev), positions.to(dev), self._prefill_attention(seqs, new, starts))
        last = torch.tensor([s + n - 1 for s, n in zip(starts, new)], device=dev)
        self.num_prefill_tokens += len(tokens)
        self.num_reused_prefill_tokens += sum(s.cached for s in seqs)
        for seq in seqs:
            seq.prefilled, seq.cached = len(seq.tokens), 0
        logits = self.model.logits(hidden[last])
        tokens, logprobs = self._sample(seqs, logits, Sampling.of(seqs, self.model.args.vocab_size, dev))
        return self._append(seqs, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()])

    def _prefill_attention(self, seqs: list[Seq], new: list[int], starts: list[int]) -> PrefillAttention:
        """The prefill's attention: the new tokens' pool slots; requests without a reused prefix
        attend within their new tokens (length buckets), the others over their context in the pool."""
        dev, bs, width = self.device, self.config.block_size, max(new)
        last = torch.tensor([len(s.tokens) - 1 for s in seqs])[:, None]
        offsets = torch.arange(width)[None, :]
        slots = pool_slots(seqs, torch.minimum(torch.tensor([s.cached for s in seqs])[:, None] + offsets, last), bs)
        fresh = [i for i, s in enumerate(seqs) if not s.cached]
        buckets = length_buckets([new[i] for i in fresh], [starts[i] for i in fresh], dev) if fresh else []
        prefixed = []
        for s, n, start in zip(seqs, new, starts):
            if s.cached:
                context = torch.arange(len(s.tokens))[None]
                prefixed.append(Prefixed(start, start + n, pool_slots([s], context, bs)[0].to(dev)))
        valid = offsets < torch.tensor(new)[:, None]
        return PrefillAttention(self.cache, slots[valid].to(dev), buckets, prefixed)

    def _decode(self, drafts: dict[str, list[int]] | None = None) -> list[Output]:
        """One decode step of every running request, verifying drafts where speculation pays (or
        ``drafts``, by request id, when given)."""
        # Every running request needs a slot for its newest token; evict the newest requests of the
        # worst priority (LIFO, as vLLM) until the others fit.
        bs = self.config.block_size
        for seq in [s for s in self.running if len(s.tokens) > len(s.blocks) * bs]:
            while seq.row >= 0 and len(seq.tokens) > len(seq.blocks) * bs:  # unless evicted by this loop
                if self.free_blocks or self._make_room(1, self._queued_sessions()) or self._make_room(1):
                    seq.blocks.append(self.free_blocks.pop())
                else:
                    self._preempt(max(reversed(self.running), key=lambda s: s.req.priority))
        num_draft = self._propose() if drafts is None else self._force(drafts)
        if self.batch is None:
            self.batch = DecodeBatch(self.cache, self.config.block_size, self.model.args.vocab_size)
        batch = self.batch
        batch.update(self.running, num_draft)
        if num_draft:
            return self._verify(batch, num_draft)
        logits = self.model.logits(self.decoder(batch.tokens, batch.positions, batch))
        tokens, logprobs = self._sample(batch.seqs, logits, batch.sampling)
        batch.advance(tokens)
        return self._append(batch.seqs, [[t] for t in tokens.tolist()], [[lp] for lp in logprobs.tolist()])

    def _timed_decode(self) -> list[Output]:
        """A decode step whose tokens and time ``auto``'s realized payoff records (once there is a cost table).
        A step that asked for drafts counts as drafted even if none came: the asking is drafting's cost."""
        if self.spec_cost is None:
            return self._decode()
        n, proposing, generated = len(self.running), self.num_proposing_steps, self.num_generated_tokens
        start = self.clock()
        done = self._decode()
        self.realized.record(n, self.num_proposing_steps > proposing, self.num_generated_tokens - generated,
                             self.clock() - start, self.spec_cost.plain_ms(n))
        return done

    def _tp_rank0(self, value: bool) -> bool:
        """TP rank 0's ``value``, on every rank of the TP group (``auto``'s decisions must line up)."""
        box = torch.tensor([int(value)], device=self.device)
        dist.broadcast(box, group=self.tp_group, group_src=0)
        return bool(box.item())

    def _sample(self, seqs: list[Seq], logits: torch.Tensor, sampling: Sampling,
                offsets: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every row and its log-prob (:func:`~.sampling.sample_tokens`)."""
        return sample_tokens(seqs, logits, sampling, offsets, self.tp_group)

    def _append(self, seqs: list[Seq], tokens: list[list[int]], logprobs: list[list[float]]) -> list[Output]:
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
            self._leave(seq, finished=True)
        return [seq.out for seq in done]
