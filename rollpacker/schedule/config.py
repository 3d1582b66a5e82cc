"""Scheduling-policy settings (no torch import here: configs parse before heavy imports).

``pipe``: RolloutPipe on top of sync or tail: a fixed rollout pool (the first half of the replicas)
and train pool (the rest); each complete, scored group goes FIFO to the train pool as it
materializes (complete-group pipelining), and engines admit the requests of the earliest groups
first (frontier-group dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class ScheduleConfig:
    eta_prompts: float = 1.25
    """tail: η_P, short rounds launch ⌈η_P·P0⌉ prompts (1 = no prompt speculation)."""
    eta_responses: float = 1.25
    """tail: η_R, short rounds launch ⌈η_R·R0⌉ responses per prompt (1 = no response speculation)."""
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): do not train or queue prompts whose group rewards are all equal."""
    sorted_batches: int = 4
    """sorted: n, update batches of P0 prompts loaded at once (a load group); no more until all are consumed."""
    rollout_ranks: int = 0
    """one_step_off: the ranks that roll out (the first ones; rank 0, the controller, is one of them); the others
    train. 0 = half of the world."""
    pipe: bool = False
    """RolloutPipe on top of sync or tail: fixed rollout and train pools (see this module's docstring)."""

    def __post_init__(self) -> None:
        if self.eta_prompts < 1 or self.eta_responses < 1:
            raise ValueError(f"schedule.eta_prompts={self.eta_prompts} and schedule.eta_responses="
                             f"{self.eta_responses} must be >= 1")
        if self.rollout_ranks < 0:
            raise ValueError(f"schedule.rollout_ranks must be >= 0, got {self.rollout_ranks}")
        if self.sorted_batches < 1:
            raise ValueError(f"schedule.sorted_batches must be >= 1, got {self.sorted_batches}")
