"""The engine contract's plain types: what a request asks and what comes back (torch-free).

:mod:`rollpacker.rollout.engine` states the contract; the round, the episodes and the policies read
these types without importing an engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SamplingParams:
    max_new_tokens: int
    """Most tokens to generate (a resumed request counts its partial tokens too)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 means no top-k truncation."""
    min_p: float = 0.0
    """Keep only tokens at least this share of the likeliest one's probability; 0 means off."""
    repetition_penalty: float = 1.0
    """Divides the positive logits (multiplies the negative) of tokens already in the prompt or the
    response, as Hugging Face and vLLM do; 1 means off."""
    stop_token_ids: tuple[int, ...] = ()
    """Tokens that end the response besides the model's EOS tokens."""
    stop: tuple[str, ...] = ()
    """Strings that end the response: the token completing one is the last kept.
    Its text is cut before the string (:func:`rollpacker.data.chat.cut_at_stop`), as vLLM does."""
    ignore_eos: bool = False
    """Do not stop at EOS (stop_token_ids still apply): replays a recorded length exactly."""
    seed: int | None = None
    """Seed of this request's sampling; None draws one from the engine's generator."""


@dataclass(kw_only=True)
class Output:
    id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    """"stop" (EOS or a stop token), "length" (max_new_tokens or context), "abort", or None."""
    first_token_time: float | None = None
    finish_time: float | None = None
    """``time.time()`` stamps."""
    num_preemptions: int = 0


@dataclass(frozen=True, kw_only=True)
class DraftContext:
    """Tokens the controller offers the drafter of one request: a response to the same prompt."""

    source: str
    """Its kind, the name its drafts are counted under: e.g. "partial" (aborted in an earlier round) or
    "epoch" (an earlier epoch's response). Not one of :data:`~rollpacker.rollout.engine.ENGINE_DRAFT_SOURCES`."""
    token_ids: tuple[int, ...]
    """Response tokens, without the prompt."""


@dataclass(kw_only=True)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    resume_from: Output | None = None
    """A partial output (from ``abort``) to continue by recomputation."""
    priority: int = 0
    """Admission order: lower first, FIFO among equals (the controller's frontier-group dispatch sets the
    request's slot, so the groups the trainer needs next run first)."""
    draft_context: tuple[DraftContext, ...] = ()
    """More text of this prompt for the drafter (engines that speculate; others ignore it)."""
    session: str | None = None
    """Keep the KV of this request once it finishes (stop or length) for the next request of this session,
    whose prompt extends this prompt and response (an episode's next turn); see the module docstring."""
