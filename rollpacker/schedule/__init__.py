"""Rollout scheduling policies behind one small contract (``base.py``): sync, tail, sorted,
sorted_partial and one_step_off; RolloutPipe (``schedule.pipe``) runs on top of sync or tail.

:func:`build_policy` is the one registry: the run and the simulator build their policies here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollpacker.config import Config
    from rollpacker.schedule.base import Policy

POLICIES = ("sync", "tail", "sorted", "sorted_partial", "one_step_off")
"""Every policy's name (``Config.policy``)."""


def build_policy(cfg: Config, sampler) -> Policy:
    """The policy ``cfg.policy`` over ``sampler``, with its settings from ``cfg``."""
    from rollpacker.schedule.one_step_off import OneStepOffPolicy
    from rollpacker.schedule.sorted import SortedPolicy
    from rollpacker.schedule.sync import SyncPolicy
    from rollpacker.schedule.tail import TailPolicy

    r, s = cfg.rollout, cfg.schedule
    common = {"filter_zero_variance": s.filter_zero_variance, "num_epochs": cfg.num_epochs}
    if cfg.policy == "tail":
        return TailPolicy(sampler, r.num_prompts, r.group_size, eta_prompts=s.eta_prompts,
                          eta_responses=s.eta_responses, last_step=cfg.num_steps - 1, **common)
    if cfg.policy in ("sorted", "sorted_partial"):
        return SortedPolicy(sampler, r.num_prompts, r.group_size, num_batches=s.sorted_batches,
                            partial=cfg.policy == "sorted_partial", **common)
    if cfg.policy == "one_step_off":
        return OneStepOffPolicy(sampler, r.num_prompts, r.group_size, **common)
    return SyncPolicy(sampler, r.num_prompts, r.group_size, **common)
