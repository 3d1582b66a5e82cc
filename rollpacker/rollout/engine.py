"""The engine contract: what every rollout engine (TorchEngine, VLLMEngine, SGLangEngine) offers the controller.

An engine queues requests (``add``), steps them (``step`` returns what finished) and aborts them.
It also loads weights in place, releases and resumes its memory, ends sessions and shuts down.

Invariants:

- Every rank of a replica (its TP group) makes the same calls in the same order.
- A bad request raises one ``ValueError`` naming it; the engine serves the others.
- An abort returns the tokens and log-probs so far. ``Request.resume_from`` continues them by
  recomputation: exactly where sampling is seeded per position (TorchEngine, SGLang).
- Log-probs are those of ``softmax(logits / temperature)`` before a repetition penalty and
  min-p/top-k/top-p. An engine that reports them after these sets ``logprobs_truncated``.
- Drafts (``Request.draft_context``) and sessions (``Request.session``) never change a token.

Why: the engine never knows which policy drives it, so any policy runs on any engine. Each call
in detail, and the helpers every engine shares (:func:`check_request`, ...): ``docs/engines.md``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from rollpacker.rollout.types import DraftContext, Output, Request, SamplingParams  # noqa: F401  (the contract's types)

ENGINE_DRAFT_SOURCES = ("prompt", "self", "sibling")
"""Draft sources the engine's drafter indexes itself: the request's prompt, its own tokens, and the
tokens of the other requests of the same prompt on this engine replica."""


@dataclass(kw_only=True)
class SpecStats:
    """Cumulative speculation counters of one engine; the by-source dicts are keyed by draft source."""

    num_verify_steps: int = 0
    """Forward passes that verified drafts."""
    num_drafts: dict[str, int] = field(default_factory=dict)
    """Rows verified (one request in one verify step), by the source of their draft ("none": no draft)."""
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    """Draft tokens verified."""
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    """Draft tokens accepted (each row also emits one token of its own)."""
    num_trials: dict[str, int] = field(default_factory=dict)
    """Draft tokens verified up to and including a row's first rejected one (accepted, plus one where a token was
    rejected): the per-token acceptance rate's denominator. TorchEngine counts them; vLLM's counters do not."""
    num_asked: int = 0
    """Drafts asked of the drafter (one request in one step), whatever came of them (TorchEngine)."""
    draft_seconds: float = 0.0
    """Seconds spent asking: matching, and indexing what was generated since (TorchEngine)."""

    def count(self, source: str, drafted: int, accepted: int) -> None:
        """Record one verified row."""
        for counts, n in ((self.num_drafts, 1), (self.num_draft_tokens, drafted), (self.num_accepted_tokens, accepted),
                          (self.num_trials, accepted + (accepted < drafted))):
            counts[source] = counts.get(source, 0) + n

    def since(self, before: SpecStats) -> SpecStats:
        """The counts added after ``before`` (an earlier copy of these stats)."""
        def minus(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)}

        return SpecStats(num_verify_steps=self.num_verify_steps - before.num_verify_steps,
                         num_drafts=minus(self.num_drafts, before.num_drafts),
                         num_draft_tokens=minus(self.num_draft_tokens, before.num_draft_tokens),
                         num_accepted_tokens=minus(self.num_accepted_tokens, before.num_accepted_tokens),
                         num_trials=minus(self.num_trials, before.num_trials),
                         num_asked=self.num_asked - before.num_asked,
                         draft_seconds=self.draft_seconds - before.draft_seconds)

    def plus(self, other: SpecStats) -> SpecStats:
        """The sum of two engines' (or two periods') counts."""
        def add(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
            return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}

        return SpecStats(num_verify_steps=self.num_verify_steps + other.num_verify_steps,
                         num_drafts=add(self.num_drafts, other.num_drafts),
                         num_draft_tokens=add(self.num_draft_tokens, other.num_draft_tokens),
                         num_accepted_tokens=add(self.num_accepted_tokens, other.num_accepted_tokens),
                         num_trials=add(self.num_trials, other.num_trials),
                         num_asked=self.num_asked + other.num_asked,
                         draft_seconds=self.draft_seconds + other.draft_seconds)


@dataclass(kw_only=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    """Cumulative count of requests evicted for lack of KV memory (recomputed later)."""
    num_generated_tokens: int
    num_prefill_tokens: int
    spec: SpecStats = field(default_factory=SpecStats)
    """Speculation counters (all zero when the engine does not speculate)."""
    num_reused_prefill_tokens: int = 0
    """Cumulative prompt tokens whose KV a prefill took from a resident session instead of computing it."""
    num_session_evictions: int = 0
    """Cumulative resident sessions freed for memory (their next turn recomputes its prefix)."""
    num_resident_sessions: int = 0
    """Sessions holding KV now (``end_session`` frees one)."""


class Engine(Protocol):
    logprobs_truncated: bool
    """True when log-probs are renormalized over the top-k/top-p set (see the module docstring)."""
    max_model_len: int
    kv_capacity_tokens: int
    vocab_size: int
    """Token ids a prompt may hold: ``[0, vocab_size)`` (the model's embedding rows)."""
    released: bool
    """Between ``release_memory()`` and ``resume_memory()``."""
    decode: Callable[[list[int]], str] | None
    """Response token ids -> text, for stop strings (:func:`text_decoder`); None refuses them."""
    num_prefill_tokens: int
    """Prompt tokens prefilled so far (``stats()``'s; vLLM and SGLang count a request's at ``add``)."""

    def add(self, request: Request) -> None: ...

    def abort(self, request_id: str) -> Output: ...

    def step(self) -> list[Output]: ...

    def has_unfinished(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def end_session(self, session: str) -> None: ...

    def release_memory(self) -> None: ...

    def resume_memory(self) -> None: ...

    def shutdown(self) -> None: ...


def start_output(request: Request) -> Output:
    """The output ``request`` accumulates into: empty, or a copy of its ``resume_from`` partial
    output (tokens, log-probs, first-token time and preemptions carry over)."""
    out = Output(id=request.id, prompt_ids=list(request.prompt_ids))
    partial = request.resume_from
    if partial is not None:
        out.token_ids, out.logprobs = list(partial.token_ids), list(partial.logprobs)
        out.first_token_time, out.num_preemptions = partial.first_token_time, partial.num_preemptions
    return out


def append_token(out: Output, token: int, logprob: float, now: float) -> None:
    out.token_ids.append(token)
    out.logprobs.append(logprob)
    if out.first_token_time is None:
        out.first_token_time = now


def finish(out: Output, reason: str, now: float | None = None) -> Output:
    out.finish_reason = reason
    out.finish_time = time.time() if now is None else now
    return out


def text_decoder(model_dir) -> Callable[[list[int]], str]:
    """The tokenizer of ``model_dir`` as token ids -> text (special tokens skipped), for stop strings."""
    from transformers import AutoTokenizer

    return functools.partial(AutoTokenizer.from_pretrained(model_dir).decode, skip_special_tokens=True)


def stop_string_hit(decode: Callable[[list[int]], str] | None, token_ids: list[int], stop: tuple[str, ...]) -> bool:
    """Whether the last tokens of a response spell one of ``stop``.

    Called after each new token, so the token completing a stop string ends the response.
    Only a short tail is decoded: a token is at least one byte (byte-level BPE splits a rare character,
    ``答`` or an emoji, into several tokens; the toy tokenizer has one a byte), except a special token
    the decoder skips: a tail that spells too few characters is widened.
    """
    if not stop:
        return False
    n, longest = max(len(s.encode("utf-8")) for s in stop) + 2, max(map(len, stop))
    while len(text := decode(token_ids[-n:])) <= longest and n < len(token_ids):
        n *= 2
    return any(s in text for s in stop)


def check_request(engine: Engine, request: Request, live: Container[str], *problems: str) -> int:
    """The tokens ``request`` may still generate on ``engine``, or one ValueError naming the request
    and every problem: an id already queued or running (in ``live``), an empty prompt, a token id outside
    the vocabulary (on a GPU an embedding lookup past its rows kills the engine's process), no room left
    in the context or under ``max_new_tokens``, stop strings without a decoder, and the engine's own
    ``problems``. What the production engines (vLLM, SGLang) check in ``add``."""
    p, done = request.params, len(request.resume_from.token_ids) if request.resume_from else 0
    context = len(request.prompt_ids) + done
    remaining = min(p.max_new_tokens - done, engine.max_model_len - context)
    found = []
    if request.id in live:
        found.append("its id is already queued or running")
    if not request.prompt_ids:
        found.append("the prompt is empty")
    elif min(request.prompt_ids) < 0 or max(request.prompt_ids) >= engine.vocab_size:
        found.append(f"a prompt token id is outside the vocabulary [0, {engine.vocab_size}): was it tokenized by "
                     "another model's tokenizer?")
    if context >= engine.max_model_len:
        found.append(f"prompt (+ partial) of {context} tokens leaves no room in max_model_len {engine.max_model_len}")
    elif remaining <= 0:
        found.append(f"max_new_tokens={p.max_new_tokens} leaves nothing to generate")
    found += [*problems, *check_stop(engine, request)]
    if found:
        raise ValueError(f"request {request.id!r}: " + "; ".join(found))
    return remaining


def check_stop(engine: Engine, request: Request) -> list[str]:
    """The problem with ``request``'s stop strings on ``engine``: none, or that it has no decoder."""
    if request.params.stop and engine.decode is None:
        return ["stop strings need the engine's decoder (engine.decode = text_decoder(model_dir))"]
    return []


def hf_names(named_tensors: Iterable[tuple[str, torch.Tensor]], tied: bool, dtype: torch.dtype | None = None
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """rollpacker parameter names (HF minus ``model.``) -> HF checkpoint names, DTensors gathered
    one at a time (``full_tensor()``: a collective of their mesh), the tied head skipped; with
    ``dtype``, each tensor in the engine's dtype (the trainer's masters are fp32)."""
    for name, tensor in named_tensors:
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and tied:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        tensor = tensor.detach() if dtype is None else tensor.detach().to(dtype)
        yield (name if name == "lm_head.weight" else f"model.{name}"), tensor


def free_cached_memory() -> bool:
    """Hand the CUDA caching allocator's unused blocks back to the driver (cycles collected first), for
    an engine about to take memory back outside PyTorch's allocator: vLLM's wake-up (its cuMem pool)
    or SGLang's resume (another process). TRL and verl do this before every wake-up; without it the
    trainer's freed activations stay reserved. Returns whether there was a CUDA allocator to empty."""
    import gc

    if not torch.cuda.is_initialized():
        return False
    gc.collect()
    torch.cuda.empty_cache()
    return True


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams,
                       truncated: bool = False) -> torch.Tensor:
    """Log-probs of ``tokens`` [N] under ``logits`` [N, vocab] by the contract's convention:
    ``log_softmax(logits / T)`` (T = 1 when greedy); ``truncated`` renormalizes over the min-p, top-k
    (then top-p) set first, as vLLM's ``processed_logprobs`` does (a repetition penalty aside)."""
    logits = logits.float()
    if params.temperature > 0:
        logits = logits / params.temperature
    if truncated and params.temperature > 0:
        if params.min_p > 0:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
        if 0 < params.top_k < logits.shape[-1]:
            kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if params.top_p < 1:
            probs, order = logits.softmax(-1).sort(dim=-1, descending=False)
            drop_sorted = probs.cumsum(-1) <= 1 - params.top_p
            drop_sorted[..., -1] = False
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def spec_metrics(stats: SpecStats) -> dict[str, float]:
    """``rollout/spec_acceptance`` (accepted / drafted tokens), ``rollout/spec_tokens_per_step``
    (tokens a verified row emits: accepted + 1) and, where the engine counts trials,
    ``rollout/spec_accept_rate`` (a draft token's chance to be kept once every one before it was:
    accepted / trials, the rate ``auto`` and the simulator model), overall and
    ``/<source>``, and ``rollout/spec_drafted_frac`` (verified rows that had a draft: the rest emitted one
    token each) and ``rollout/spec_draft_len`` (draft tokens per row that had a draft);
    ``rollout/spec_verify_steps``; ``rollout/spec_draft_ms`` (ms a draft asked of the drafter cost,
    where any was). Empty when nothing was asked or verified."""
    out: dict[str, float] = {"rollout/spec_draft_ms": 1e3 * stats.draft_seconds / stats.num_asked} \
        if stats.num_asked else {}
    if not stats.num_verify_steps:
        return out
    out["rollout/spec_verify_steps"] = float(stats.num_verify_steps)
    sources = sorted(stats.num_drafts)
    for suffix, names in (("", sources), *((f"/{s}", [s]) for s in sources)):
        rows = sum(stats.num_drafts.get(s, 0) for s in names)
        drafted = sum(stats.num_draft_tokens.get(s, 0) for s in names)
        accepted = sum(stats.num_accepted_tokens.get(s, 0) for s in names)
        if not rows:
            continue
        if drafted:
            out[f"rollout/spec_acceptance{suffix}"] = accepted / drafted
            trials = sum(stats.num_trials.get(s, 0) for s in names)
            if trials:
                out[f"rollout/spec_accept_rate{suffix}"] = accepted / trials
                with_draft = rows - stats.num_drafts.get("none", 0)
                if not suffix and with_draft:  # the engines that count trials count the rows without a draft too
                    out["rollout/spec_drafted_frac"] = with_draft / rows
                    out["rollout/spec_draft_len"] = drafted / with_draft
        out[f"rollout/spec_tokens_per_step{suffix}"] = (accepted + rows) / rows
    return out


def generate(engine: Engine, requests: Iterable[Request]) -> dict[str, Output]:
    """Add ``requests`` and step until all finish; outputs by request id."""
    for r in requests:
        engine.add(r)
    done: dict[str, Output] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.id] = out
    return done
