"""Parallelism planner settings (no torch import here: configs parse before heavy imports).

With ``enabled``, the first step runs at the profile's best TP (or ``initial_tp``); then, per round
kind, TP doubles when a step's preemptions jump above ``raise_factor`` times the recent level and
halves after ``quiet_steps`` steps without preemption, and ``profile_guard`` vetoes a change the
profile estimates slower for the round just seen (:mod:`rollpacker.plan.planner`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class PlanConfig:
    enabled: bool = False
    """Choose the rollout TP per step from the profile and the preemptions (paper §4.2); rollout.tp is then the TP
    the engines start at, whose KV cache the prompts are fitted to (those that do not fit are left out)."""
    profile: str = ""
    """Profile file from python -m rollpacker.profile; empty: the one cached under profile_dir (made at start)."""
    profile_dir: str = "runs/profiles"
    """Where profiles are cached, one file per (model, device, world, engine settings)."""
    initial_tp: int = 0
    """TP of the first step; 0 = the profile's best TP without tail batching."""
    raise_factor: float = 1.05
    """TP doubles when a step's preemptions exceed this many times the recent level."""
    recent_steps: int = 3
    """Steps (of the same round kind) whose mean preemption count is the recent level."""
    quiet_steps: int = 4
    """TP halves after this many consecutive steps (of the same round kind) without preemption."""
    max_tp: int = 0
    """Largest TP; 0 = the ranks of one node (LOCAL_WORLD_SIZE): TP never crosses a node."""
    profile_guard: bool = True
    """Veto a TP change the profile estimates slower for the round just seen; False: the paper's heuristic alone."""
    per_kind: bool = True
    """Short and long rounds keep separate TPs (False: one TP for every round)."""
    profile_batches: tuple[int, ...] = (1, 4, 16, 64)
    """Running requests at which the profiler times decode steps."""
    profile_contexts: tuple[int, ...] = (64, 256)
    """Context lengths (tokens) at which the profiler times decode steps and prefill."""
    profile_steps: int = 5
    """Timed decode steps per point of the profile (the median is kept)."""

    def __post_init__(self) -> None:
        if self.raise_factor < 1 or self.recent_steps < 1 or self.quiet_steps < 1:
            raise ValueError(f"plan.raise_factor={self.raise_factor} must be >= 1, plan.recent_steps="
                             f"{self.recent_steps} and plan.quiet_steps={self.quiet_steps} >= 1")
        if self.initial_tp < 0 or self.max_tp < 0 or self.initial_tp > self.max_tp > 0:
            raise ValueError(f"plan.initial_tp={self.initial_tp} and plan.max_tp={self.max_tp} must be >= 0, the first "
                             "at most the second (0: none)")
        for name in ("profile_batches", "profile_contexts"):
            values = getattr(self, name)
            if not values or min(values) <= 0:
                raise ValueError(f"plan.{name}={values} must be positive numbers")
        if self.profile_steps <= 0:
            raise ValueError(f"plan.profile_steps must be positive, got {self.profile_steps}")
