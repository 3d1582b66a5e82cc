"""SGLangEngine: SGLang's offline ``sgl.Engine`` behind the engine contract, pinned to
:data:`~rollpacker.rollout.sglang_process.SGLANG_VERSION`.

It runs on GPU and, for CI, on CPU (SGLang's CPU platform). It has never run on a GPU.

- One Engine per TP group, on its first rank. Every rank makes the same contract calls; the
  first rank serves them and broadcasts the results over the TP group.
- SGLang has no ``step()``: requests stream from a background event loop. ``step()`` returns once
  a decode step's worth of tokens came back, or a request ended.
- Log-probs follow the contract (``logprobs_truncated = False``). Seeded sampling is keyed by
  position, so a resumed request continues exactly.
- An abort that reaches a request SGLang already finished returns it whole.
- A weight push and a memory release wait until SGLang is idle.

Starting, stopping and taming SGLang's own processes inside a torchrun rank:
:mod:`~rollpacker.rollout.sglang_process`. How each call maps onto SGLang, and each fix: ``docs/sglang.md``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.dist import broadcast
from rollpacker.model.hf_decoder import checkpoint_format, decoder_facts
from rollpacker.rollout import ENGINES
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import (
    EngineStats,
    Output,
    Request,
    SamplingParams,
    append_token,
    check_request,
    finish,
    free_cached_memory,
    hf_names,
    start_output,
    stop_string_hit,
)
from rollpacker.rollout.sglang_process import (
    engine_died,
    import_sglang,
    share_with_schedulers,
    start,
    stop,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_ABORT_TIMEOUT_S = 60.0
_IDLE_TIMEOUT_S = 60.0
"""How long a release or a weight push waits for SGLang's scheduler to finish what it still runs."""
STREAM_INTERVAL = 8
"""Tokens per streamed update of a running request (SGLang's ``stream_interval``)."""


@dataclass
class Track:
    """One SGLang request feeding ``out``: how many of its tokens and retractions were applied."""
    out: Output
    seen: int = 0
    retractions: int = 0
    error: BaseException | None = None
    stop: tuple[str, ...] = ()
    """Stop strings, matched by the adapter (SGLang runs without a tokenizer)."""
    decode: Callable[[list[int]], str] | None = None
    aborted: bool = False
    """``abort()`` was called (set on the loop thread)."""


def apply_chunk(track: Track, chunk: dict, now: float) -> tuple[int, int]:
    """Apply one cumulative streamed ``chunk`` of SGLang (``output_ids``, ``meta_info`` with
    ``output_token_logprobs`` as ``(logprob, token, text)``, ``finish_reason`` None or a dict with
    ``type``, ``num_retractions``) to ``track``, finishing its output at the last one or at the
    token completing a stop string (the caller then aborts the SGLang request); returns
    (new tokens, new retractions)."""
    meta = chunk["meta_info"]
    ids, logprobs = chunk["output_ids"], meta.get("output_token_logprobs") or []
    if len(logprobs) < len(ids):
        raise RuntimeError(f"request {track.out.id!r}: SGLang sent {len(ids)} tokens but {len(logprobs)} log-probs "
                           "(was it started with return_logprob=True?)")
    added, reason = 0, meta.get("finish_reason")
    for token, (logprob, lp_token, _) in zip(ids[track.seen:], logprobs[track.seen:len(ids)], strict=True):
        if lp_token != token:
            raise RuntimeError(f"request {track.out.id!r}: log-prob of token {lp_token} for token {token}")
        append_token(track.out, token, logprob, now)
        added += 1
        if stop_string_hit(track.decode, track.out.token_ids, track.stop):
            reason = {"type": "stop"}
            break
    track.seen += added
    retracted = max(meta.get("num_retractions", track.retractions) - track.retractions, 0)
    track.retractions += retracted
    track.out.num_preemptions += retracted
    if reason is not None:
        finish(track.out, _FINISH.get(reason["type"], "stop"), now)
    return added, retracted


def sglang_params(p: SamplingParams, remaining: int, eos_ids: tuple[int, ...], seed: int) -> dict:
    """SGLang's ``sampling_params`` dict for ``p`` with ``remaining`` tokens left to generate. SGLang's
    ``ignore_eos`` ignores stop tokens too, so the contract's ignore_eos + stop_token_ids is refused; its
    repetition penalty counts only the tokens it generated, so a penalty is refused too, min-p (its sampler
    asserts on min-p with a seed), and top-k with top-p (its top-p is of the whole mass)."""
    if p.ignore_eos and p.stop_token_ids:  # engine.kind=sglang with replay_lengths is refused at parse; auto on a GPU
        raise ValueError(f"{ENGINES['sglang'].no_stop_ids_with_replay}: set one of rollout.replay_lengths and "
                         "rollout.stop_token_ids, or engine.kind torch or vllm")
    if p.repetition_penalty != 1:  # engine.kind=sglang is refused at parse; auto may pick SGLang on a GPU
        raise ValueError(f"{ENGINES['sglang'].no_repetition_penalty}: set rollout.repetition_penalty=1, or "
                         "engine.kind torch or vllm")
    if p.min_p:
        raise ValueError(f"{ENGINES['sglang'].no_min_p}: set rollout.min_p=0, or engine.kind torch or vllm")
    if p.top_k and p.top_p < 1:
        raise ValueError(f"{ENGINES['sglang'].no_top_k_with_top_p}: set one of rollout.top_k and rollout.top_p, or "
                         "engine.kind torch or vllm")
    stop = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
    return {"max_new_tokens": remaining, "temperature": p.temperature, "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1, "min_p": p.min_p, "stop_token_ids": stop,
            "ignore_eos": p.ignore_eos, "sampling_seed": seed, "no_stop_trim": True}


def admits(context: int, remaining: int, page_size: int, pool_tokens: int) -> bool:
    """Whether SGLang 0.5.23 ever starts a request of ``context`` tokens with ``remaining`` to generate in a KV pool
    of ``pool_tokens``: it reserves the context in whole pages, the new tokens, a page and a token more. Measured on
    CPU (a pool of 304 tokens, pages of 16): 100 + 170 ran, 100 + 176 waited forever, and so did what came after."""
    return -(-context // page_size) * page_size + remaining + page_size + 1 <= pool_tokens


def buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of ``named_tensors`` of at most ``bucket_bytes`` (a larger tensor alone),
    pulled lazily: at most one bucket (and the tensor that closed it) is gathered at a time."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def engine_args(model_path: str | Path, config: EngineConfig, args, tp: int, dtype: torch.dtype, on_cpu: bool,
                free_bytes: float = 0.0, plan_bytes: float = 0.0) -> dict:
    """SGLang's ``ServerArgs`` for this rank's engine (``args``: the model's
    :class:`~rollpacker.model.hf_decoder.DecoderFacts`). Its
    KV holds ``engine.kv_memory_mb`` per rank, as TorchEngine's and vLLM's; on CPU, SGLang's CPU
    device and torch_native attention, no memory saver (it is CUDA-only), and a static memory
    fraction of 0.9: SGLang checks it against the host's free RAM, which other processes move (it
    failed with 0.1 while another rank's engine loaded; the KV stays ``max_total_tokens``). On GPU the
    fraction is the memory plan's bytes of this engine (``plan_bytes``) over ``free_bytes``, the GPU memory
    free at its start (:func:`memory_fraction`). SGLang picks a free port for its schedulers' process group (a fixed one
    collides with another job's)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    port = 30000 + 8 * (rank % 1000)
    kv_bytes_per_token = 2 * args.num_layers * max(1, args.num_kv_heads // tp) * args.head_dim * dtype.itemsize
    return dict(
        model_path=str(model_path), tp_size=tp, base_gpu_id=int(os.environ.get("LOCAL_RANK", 0)),
        port=port, skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."),
        random_seed=config.seed, context_length=max_model_len(config, args) + SPARE_POSITIONS,
        mem_fraction_static=0.9 if on_cpu else memory_fraction(plan_bytes, free_bytes),
        max_total_tokens=int(config.kv_memory_mb * 2**20) // kv_bytes_per_token,
        max_running_requests=config.max_num_seqs, chunked_prefill_size=config.max_prefill_tokens,
        page_size=config.block_size, disable_cuda_graph=config.enforce_eager,
        enable_memory_saver=not on_cpu, enable_weights_cpu_backup=not on_cpu,
        enable_deterministic_inference=True, sampling_backend="pytorch", stream_interval=STREAM_INTERVAL,
        enable_priority_scheduling=True, schedule_low_priority_values_first=True, disable_priority_preemption=True,
        custom_sigquit_handler=engine_died,
    ) | ({"device": "cpu", "attention_backend": "torch_native"} if on_cpu else {})


def memory_fraction(plan_bytes: float, free_bytes: float) -> float:
    """SGLang's ``mem_fraction_static`` on GPU: the memory plan's bytes of this engine (weights, KV
    budget, activations, its process: :attr:`~rollpacker.plan.memory.Plan.engine_bytes`) over the GPU
    memory free when it starts. SGLang 0.5.23 sizes its KV pool as the memory free after loading its
    weights less ``(1 - fraction)`` of what was free before, capped at ``max_total_tokens`` (the KV
    budget), and refuses to start when that is not positive (``kv_cache_configurator``). So this
    fraction gives it the whole budget and leaves the rest to the trainer."""
    if plan_bytes <= 0:
        raise ValueError("SGLang on GPU sizes its memory by the memory plan: build it with "
                         "build_engine(..., plan_bytes=the plan's engine_bytes), as the job does")
    if plan_bytes >= free_bytes:
        raise ValueError(f"memory plan: SGLang needs {plan_bytes / 1e9:.1f} GB per GPU (weights, KV budget, "
                         f"activations, its process) but {free_bytes / 1e9:.1f} GB are free; set a smaller "
                         "engine.kv_memory_mb or a larger rollout.tp")
    return min(0.99, math.ceil(1000 * plan_bytes / free_bytes) / 1000)


def nccl_env(tp: int) -> dict[str, str]:
    """What SGLang 0.5.23 sets in the Engine's process, overriding any value, and so what every rank
    must export before its first communicator: deterministic inference (the adapter's, for seeded
    sampling) at TP > 1 pins NCCL's all-reduce to trees and its channel count
    (``arg_groups/attention_hook.py``, ``handle_deterministic_inference``). Its cuMem and NVLS settings
    keep a value already set (:data:`rollpacker.dist.NCCL_ENV` sets them on every rank)."""
    if tp <= 1:
        return {}
    channels = str(int(os.environ.get("SGLANG_DETERMINISTIC_NCCL_NCHANNELS", "8")))
    return {"NCCL_ALGO": "allreduce:tree", "NCCL_MIN_NCHANNELS": channels, "NCCL_MAX_NCHANNELS": channels}


SPARE_POSITIONS = 6
"""SGLang's context length beyond the engine's ``max_model_len``: its scheduler aborts an input of its context
length - 6 tokens or more (``max_req_input_len``, ``max_req_len - 5``) and caps new tokens at its context length
- 2 (``max_req_len - 1``); a prompt (or a resumed response) of up to ``max_model_len - 1`` tokens then passes both."""


def max_model_len(config: EngineConfig, args) -> int:
    """Longest prompt + response: ``engine.max_model_len``, at most the model's positions - SPARE_POSITIONS (the
    engine's context is this + SPARE_POSITIONS)."""
    positions = args.max_position_embeddings
    return min(config.max_model_len or positions, positions - SPARE_POSITIONS)


class SGLangEngine:
    """SGLang's ``Engine`` on the TP group's first rank; see the module docstring."""

    logprobs_truncated = False

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, *, tp_mesh=None,
                 dtype: torch.dtype = torch.bfloat16, bucket_mb: float = 512.0, plan_bytes: float = 0.0,
                 **server_args):
        """``plan_bytes``: the memory plan's bytes of this engine (on GPU, its memory fraction); ``server_args``
        override or extend SGLang's ``ServerArgs`` (e.g. ``attention_backend``)."""
        self.config = config = config or EngineConfig()
        self.on_cpu = not torch.cuda.is_available()
        sgl = import_sglang(self.on_cpu)
        if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "0") not in ("", "0", "false"):
            raise ValueError("SGLANG_RETURN_ORIGINAL_LOGPROB is set: SGLang would report T = 1 log-probs, not the "
                             "contract's log_softmax(logits / T); unset it")
        args = decoder_facts(model_path)
        self.to_checkpoint = checkpoint_format(model_path)  # a Hugging Face MoE's experts, per expert
        self.tied, self.eos_ids, self.dtype = args.tie_word_embeddings, tuple(args.eos_token_ids), dtype
        self.max_model_len, self.vocab_size = max_model_len(config, args), args.vocab_size
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.group = tp_mesh.get_group() if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.tp = tp_mesh.size() if tp_mesh is not None else 1
        self.owner = self.group is None or tp_mesh.get_local_rank() == 0
        self.src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        self.decode = None
        """Token ids -> text, for stop strings (set by the job)."""
        self.live: dict[str, Track] = {}
        self.tasks: dict[str, asyncio.Future] = {}
        self.rng = random.Random(config.seed)
        self.num_preemptions = self.num_generated_tokens = self.num_prefill_tokens = self.num_started = 0
        self.released = self.weights_awake = False
        self.lock, self.arrived = threading.Lock(), threading.Event()
        self.ahead = 0.0
        """Decode steps SGLang has streamed beyond those step() returned (the first rank's)."""
        self.advanced: set[str] = set()
        """Requests that got tokens since step() last counted progress."""
        self.counted = 0
        """``num_generated_tokens`` when step() last counted progress."""
        self.engine = None
        num_tokens = 0
        if self.on_cpu:
            share_with_schedulers(self._broadcast)
        if self.owner:
            free = 0 if self.on_cpu else torch.cuda.mem_get_info()[0]
            self.engine, num_tokens = start(sgl, engine_args(model_path, config, args, self.tp, dtype, self.on_cpu,
                                                             free, plan_bytes) | server_args)
            self.loop = self.engine.loop
            self.thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
            self.thread.start()
        self.pool_tokens, self.page_size = self._broadcast(num_tokens), config.block_size
        self.kv_capacity_tokens = max(0, self.pool_tokens - 2 * self.page_size)
        """What one request may hold (prompt and response): SGLang starts one only with pages to spare
        (:func:`admits`)."""

    # ---- plumbing -----------------------------------------------------------------------

    def _broadcast(self, obj):
        """``obj`` of the group's first rank, on every rank of the group."""
        return obj if self.group is None else broadcast(obj, self.group, self.src)

    def _call(self, coro):
        """Run a tokenizer-manager coroutine on the Engine's loop thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _consume(self, track: Track, prompt: list[int], params: dict, priority: int) -> None:
        if track.aborted:  # aborted before it was sent: SGLang ignores an abort of a request it does not know yet
            return
        try:
            stream = await self.engine.async_generate(input_ids=prompt, sampling_params=params, return_logprob=True,
                                                      rid=track.out.id, stream=True, priority=priority)
            async for chunk in stream:
                with self.lock:
                    tokens, retracted = apply_chunk(track, chunk, time.time())
                    self.num_generated_tokens += tokens
                    self.num_preemptions += retracted
                    if tokens:
                        self.advanced.add(track.out.id)
                self.arrived.set()
                if track.out.finish_reason is not None and chunk["meta_info"].get("finish_reason") is None:
                    self.engine.tokenizer_manager.abort_request(track.out.id)  # a stop string: SGLang goes on
                    break
        except Exception as e:  # surfaced by step()
            track.error = e
        finally:
            if track.out.finish_reason is None and track.error is None and not track.aborted:
                track.error = RuntimeError(f"request {track.out.id!r}: SGLang's stream ended without a finish reason")
            self.arrived.set()

    def _abort(self, track: Track) -> None:
        """On the loop thread: abort ``track``'s SGLang request, or, not sent yet, never send it."""
        track.aborted = True
        self.engine.tokenizer_manager.abort_request(track.out.id)

    # ---- the contract -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        p, rid = request.params, request.id
        remaining = check_request(self, request, self.live)
        out = start_output(request)
        prompt = out.prompt_ids + out.token_ids
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        try:
            params = sglang_params(p, remaining, self.eos_ids, seed)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        if not admits(len(prompt), remaining, self.page_size, self.pool_tokens):
            raise ValueError(f"request {rid!r} rejected: {len(prompt)} tokens with {remaining} more to generate need "
                             f"more KV than SGLang's pool of {self.pool_tokens} tokens (pages of {self.page_size}) "
                             "gives one request: SGLang would never start it (its stream waits forever); raise "
                             "engine.kv_memory_mb")
        if not self.live:
            self.ahead = 0.0  # progress made before the engine went idle covers no new request
        track = self.live[rid] = Track(out, stop=p.stop, decode=self.decode)
        self.num_prefill_tokens += len(prompt)
        if self.owner:
            coro = self._consume(track, prompt, params, request.priority)
            self.tasks[rid] = asyncio.run_coroutine_threadsafe(coro, self.loop)

    def abort(self, request_id: str) -> Output:
        if request_id not in self.live:
            raise KeyError(f"abort: no request {request_id!r} is queued or running")
        result = None
        if self.owner:  # SGLang ends the stream with the partial output; wait for it
            self.loop.call_soon_threadsafe(self._abort, self.live[request_id])
            try:
                self.tasks.pop(request_id).result(timeout=_ABORT_TIMEOUT_S)
                with self.lock:
                    result = (None, self.live[request_id].out)
            except concurrent.futures.TimeoutError:  # the builtin from 3.11; its own class on 3.10
                result = (f"abort: SGLang did not end request {request_id!r} within {_ABORT_TIMEOUT_S:.0f} s", None)
        error, out = self._broadcast(result)
        if error:
            raise RuntimeError(error)
        del self.live[request_id]
        # SGLang may have finished it before the abort arrived (its stream runs apart from step()): it stays whole
        return out if out.finish_reason in ("stop", "length") else finish(out, "abort")

    def step(self) -> list[Output]:
        if self.released:
            raise RuntimeError("step() after release_memory(): call resume_memory() first")
        if not self.live:
            return []
        result = None
        if self.owner:
            if self.ahead < 1:
                self._wait_for_a_step()
            self.ahead -= 1
            with self.lock:
                failed = [t for t in self.live.values() if t.error is not None]
                done = [t.out for t in self.live.values() if t.out.finish_reason is not None]
                result = (f"SGLang request {failed[0].out.id!r} failed: {failed[0].error!r}" if failed else None, done,
                          self.num_preemptions, self.num_generated_tokens,
                          sum(t.seen > 0 and t.out.finish_reason is None for t in self.live.values()))
        error, done, self.num_preemptions, self.num_generated_tokens, self.num_started = self._broadcast(result)
        if error:
            raise RuntimeError(error)
        for out in done:
            del self.live[out.id]
            self.tasks.pop(out.id, None)
        return done

    def _wait_for_a_step(self) -> None:
        """Wait until SGLang has streamed a decode step's worth of tokens (one per request running:
        new tokens over the requests running at the last step() or that got tokens) or a request ended."""
        while True:
            self.arrived.wait()
            with self.lock:
                self.arrived.clear()
                tokens, self.counted = self.num_generated_tokens - self.counted, self.num_generated_tokens
                self.ahead += tokens / max(len(self.advanced), self.num_started, 1)
                self.advanced.clear()
                if any(t.out.finish_reason is not None or t.error is not None for t in self.live.values()):
                    self.ahead = max(self.ahead, 1.0)
                if self.ahead >= 1:
                    return

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def stats(self) -> EngineStats:
        running = min(self.num_started, len(self.live))
        return EngineStats(num_running=running, num_waiting=len(self.live) - running,
                           num_preemptions=self.num_preemptions, num_generated_tokens=self.num_generated_tokens,
                           num_prefill_tokens=self.num_prefill_tokens)

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.managers.io_struct import (
            BeginWeightUpdateReqInput,
            EndWeightUpdateReqInput,
            ResumeMemoryOccupationReqInput,
            UpdateWeightsFromTensorReqInput,
        )
        from sglang.srt.model_executor.model_runner_components.weight_updater import LocalSerializedTensor
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        self._check_idle("update_weights")
        tm = self.engine.tokenizer_manager if self.owner else None
        if self.released and not self.weights_awake:  # verl/slime: the weights back first, then loaded, then KV
            free_cached_memory()  # every rank of the group: SGLang's process takes the memory back
            if self.owner:
                self._call(tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=["weights"]), None))
            self.weights_awake = True
        if not self.on_cpu:
            monkey_patch_torch_reductions()  # CUDA-IPC handles name devices by UUID (it breaks CPU tensors' pickling)
        if self.owner:
            self._check(self._call(tm.begin_weight_update(BeginWeightUpdateReqInput(), None)), "begin_weight_update")
        for bucket in buckets(self.to_checkpoint(hf_names(named_tensors, self.tied, self.dtype)), self.bucket_bytes):
            bucket = [(name, t.contiguous()) for name, t in bucket]  # alive until loaded
            mine = [(name, MultiprocessingSerializer.serialize(t)) for name, t in bucket]
            everyone = [mine]
            if self.group is not None:
                everyone = [None] * self.tp if self.owner else None
                dist.gather_object(mine, everyone, dst=self.src, group=self.group)
            if self.owner:
                named = [(rows[0][0], LocalSerializedTensor(values=[row[1] for row in rows]))
                         for rows in zip(*everyone, strict=True)]
                payload = [MultiprocessingSerializer.serialize(named) for _ in range(self.tp)]
                req = UpdateWeightsFromTensorReqInput(serialized_named_tensors=payload, flush_cache=False)
                self._check(self._call(tm.update_weights_from_tensor(req, None)), "update_weights_from_tensor")
            if self.group is not None:
                dist.barrier(group=self.group)  # the others' IPC-shared bucket stays alive until loaded
        if self.owner:
            self._check(self._call(tm.end_weight_update(EndWeightUpdateReqInput(), None)), "end_weight_update")
            if not self.released:  # released: the KV comes back empty
                self._flush("the weight update")

    def end_session(self, session: str) -> None:
        """Nothing to free: an episode's turns share KV through SGLang's radix cache, which evicts by itself."""

    def release_memory(self) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        self._check_idle("release_memory")
        # released already: only weights a push woke go back (SGLang's resume of a held tag kills its scheduler)
        tags = None if not self.released else ["weights"] if self.weights_awake else []
        if self.owner and tags != []:
            if not self.released:
                self._flush("release_memory")  # SGLang asserts it is idle: its scheduler dies if not
            tm = self.engine.tokenizer_manager
            self._call(tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=tags), None))
        self.released, self.weights_awake = True, False

    def resume_memory(self) -> None:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        if self.released:
            free_cached_memory()  # every rank of the group: SGLang's process takes the memory back
        if self.owner and self.released:
            tm = self.engine.tokenizer_manager
            for tags in ([] if self.weights_awake else [["weights"]]) + [["kv_cache", "cuda_graph"]]:
                self._call(tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=tags), None))
        self.released = self.weights_awake = False

    def shutdown(self) -> None:
        """Stop the loop thread and SGLang's subprocesses (the first rank of the group). SGLang's
        shutdown kills every child process of this one, not only its own."""
        if self.owner and self.engine is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            stop(self.engine)
            self.engine = None

    def _flush(self, what: str) -> None:
        """Flush SGLang's cache once its scheduler is idle. A request this adapter has finished can still
        be in SGLang's batch for an iteration or more (one aborted at a stop string, after an abort, or
        with overlap scheduling), and a flush on a busy scheduler fails."""
        result = self._call(self.engine.tokenizer_manager.flush_cache(timeout_s=_IDLE_TIMEOUT_S))
        if not result.success:
            raise RuntimeError(f"SGLang's scheduler was not idle for {what} within {_IDLE_TIMEOUT_S:.0f} s: "
                               f"{result.message}")

    def _check_idle(self, what: str) -> None:
        if self.live:
            raise RuntimeError(f"{what} with {len(self.live)} requests in flight: finish or abort them first")

    @staticmethod
    def _check(result, what: str) -> None:
        success, message = (result.success, result.message) if hasattr(result, "success") else result[:2]
        if not success:
            raise RuntimeError(f"SGLang {what} failed: {message}")


def load(config: EngineConfig, model_path, device, dtype, tp_mesh, plan_bytes: float = 0.0) -> SGLangEngine:
    """The registry's loader (:data:`rollpacker.rollout.ENGINES`): this rank's engine, sized by the memory
    plan's ``plan_bytes`` on GPU, with its speculative decoding as ``engine.speculative`` says."""
    from rollpacker.rollout import sglang_speculative_args

    return SGLangEngine(model_path, config, tp_mesh=tp_mesh, dtype=dtype, plan_bytes=plan_bytes,
                        **sglang_speculative_args(config, torch.device(device).type))
