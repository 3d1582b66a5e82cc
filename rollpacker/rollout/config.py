"""Rollout settings: the batch and sampling of a step, and the engine (no torch import here: configs parse
before heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rollpacker.choices import check_choices
from rollpacker.rollout.types import SamplingParams


@dataclass(kw_only=True)
class RolloutConfig:
    num_prompts: int = 16
    """P0: prompts trained per step."""
    group_size: int = 8
    """R0: responses per prompt (the GRPO group)."""
    max_new_tokens: int = 400
    """Longest response."""
    temperature: float = 0.8
    """Sampling temperature (the trainer's log-probs use the same)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    min_p: float = 0.0
    """Min-p sampling: keep tokens at least this share of the likeliest one's probability (0 = off)."""
    repetition_penalty: float = 1.0
    """Penalize tokens already in the prompt or response, as Hugging Face and vLLM do (1 = off; > 1 penalizes)."""
    stop: tuple[str, ...] = ()
    """Strings that end a response; the reward sees its text cut before the first (vLLM's default)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response besides the model's EOS (kept, as EOS is)."""
    tp: int = 1
    """Rollout tensor-parallel size: each engine replica spans this many ranks, of one node (a divisor of its ranks)."""
    poll_steps: int = 8
    """Engine steps between two control-plane exchanges with the controller."""
    replay_lengths: bool = False
    """Force every response to a length from the paper's long-tailed mix (rollpacker.data.lengths.LengthReplay)."""
    routing: Literal["request", "group"] = "request"
    """Replica of each request: round-robin per request, or every request of a prompt on one replica."""
    longest_first: bool = False
    """Dispatch a deferred prompt's requests longest first (its cut responses' length), to the least-loaded replica."""

    def sampling(self, **overrides: Any) -> SamplingParams:
        """The rollout's sampling settings as an engine request's (``overrides`` replace fields)."""
        fields = dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                      top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                      stop=self.stop, stop_token_ids=self.stop_token_ids)
        return SamplingParams(**(fields | overrides))

    def __post_init__(self) -> None:
        check_choices(self, "rollout")
        for name in ("num_prompts", "group_size", "max_new_tokens", "tp", "poll_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rollout.{name} must be positive, got {getattr(self, name)}")
        if problem := sampling_problem(self):
            raise ValueError(f"rollout sampling: {problem}")
        if any(not s for s in self.stop) or any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"rollout.stop={self.stop} holds an empty string or rollout.stop_token_ids="
                             f"{self.stop_token_ids} a negative id: remove it")


MIN_TEMPERATURE = 1e-2
"""The least temperature above 0: vLLM samples at this one below it (its log-probs then at another temperature
than the trainer's), and logits divided by far less overflow fp32 (NaN log-probs). Sampling below it is greedy."""
TOO_COLD = "vLLM samples at 0.01 below it, and logits divided by far less overflow"


def sampling_problem(p: RolloutConfig | SamplingParams) -> str | None:
    """What is wrong with ``p``'s sampling settings, or None."""
    if 0 < p.temperature < MIN_TEMPERATURE:
        return f"temperature={p.temperature} is below {MIN_TEMPERATURE} ({TOO_COLD}): use 0 (greedy) or more"
    if p.temperature < 0 or not 0 < p.top_p <= 1 or p.top_k < 0 or not 0 <= p.min_p <= 1 or p.repetition_penalty <= 0:
        return (f"temperature={p.temperature} must be >= 0, top_p={p.top_p} in (0, 1], top_k={p.top_k} >= 0, "
                f"min_p={p.min_p} in [0, 1], repetition_penalty={p.repetition_penalty} > 0")
    return None


MAX_SPEC_TOKENS = 32
"""Upper bound of ``engine.spec_max_tokens``: a verify step's queries per request."""


@dataclass(kw_only=True)
class EngineConfig:
    kind: Literal["auto", "torch", "vllm", "sglang"] = "auto"
    """Rollout engine: TorchEngine, vLLM in-process, SGLang (GPU; on CPU see docs/sglang.md), or auto."""
    memory_fraction: float = 0.1
    """vllm: share of device memory (CPU: of RAM, per rank) it may take, its KV being kv_memory_mb (SGLang on GPU
    derives its own from the memory plan)."""
    enforce_eager: bool = True
    """vllm, sglang: no torch.compile/CUDA graphs (engine start in seconds instead of ~30 s on CPU)."""
    block_size: int = 16
    """torch, sglang: tokens per KV block (vLLM picks its own)."""
    kv_memory_mb: float = 256.0
    """KV cache budget per rank in MiB; when it is full, requests are preempted."""
    memory_mb: float = 0.0
    """torch: engine MiB per rank, weights included (the KV cache gets what the weight shard leaves); 0 =
    kv_memory_mb."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one step (a single longer prompt is still admitted)."""
    max_model_len: int = 0
    """Longest prompt + response; 0 takes the model's max_position_embeddings."""
    seed: int = 0
    """Seeds the per-request seeds of requests that bring none (a run's requests each bring one, from its seed: this
    seeds the engine used alone, as the benchmarks use it)."""
    speculative: Literal["off", "auto", "on"] = "off"
    """Verify model-free drafts (docs/speculative.md): auto where the engine's measured step cost says it pays."""
    spec_max_tokens: int = 8
    """Most draft tokens verified per request and step."""
    resident_sessions: bool = True
    """torch: keep an episode's KV between its turns (Request.session); off: each turn prefills all its context."""

    def __post_init__(self) -> None:
        check_choices(self, "engine")
        if not 1 <= self.spec_max_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"engine.spec_max_tokens must be in 1..{MAX_SPEC_TOKENS}, got {self.spec_max_tokens}")
        for name in ("block_size", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.kv_memory_mb <= 0 or self.memory_mb < 0:
            raise ValueError(f"engine.kv_memory_mb={self.kv_memory_mb} must be positive and "
                             f"engine.memory_mb={self.memory_mb} >= 0")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"engine.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.max_model_len < 0:
            raise ValueError(f"engine.max_model_len must be >= 0, got {self.max_model_len}")

