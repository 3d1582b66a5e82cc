"""TorchEngine settings (no torch import here: configs parse before heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_memory_mb: float = 512.0
    """KV cache budget per rank in MiB; when it is full, requests are preempted."""
    memory_mb: float = 0.0
    """Engine memory per rank in MiB, weights included: when set, the KV cache gets what this rank's
    weight shard leaves (as GPU engines size theirs), so a larger TP leaves more; 0 = kv_memory_mb."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_prefill_tokens: int = 8192
    """Most prompt tokens prefilled in one step (a single longer prompt is still admitted)."""
    max_model_len: int = 0
    """Longest prompt + response; 0 takes the model's max_position_embeddings."""
    seed: int = 0
    """Seeds the per-request seeds of requests that bring none."""

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"engine.{name} must be positive, got {getattr(self, name)}")
        if self.kv_memory_mb <= 0 or self.memory_mb < 0:
            raise ValueError(f"engine.kv_memory_mb={self.kv_memory_mb} must be positive and "
                             f"engine.memory_mb={self.memory_mb} >= 0")
        if self.max_model_len < 0:
            raise ValueError(f"engine.max_model_len must be >= 0, got {self.max_model_len}")
