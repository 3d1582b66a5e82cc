"""Rollout scheduling policies behind one small contract (``base.py``): sync, tail, sorted,
sorted_partial and one_step_off; RolloutPipe (``schedule.pipe``) runs on top of sync or tail.

:func:`build_policy` is the one registry: the run and the simulator build their policies here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from rollpacker.schedule.base import Policy
    from rollpacker.schedule.config import ScheduleConfig

PolicyName = Literal["sync", "tail", "sorted", "sorted_partial", "one_step_off"]
POLICIES = get_args(PolicyName)
"""Every policy's name (the tags of rollpacker.schedule.config.ScheduleConfig)."""


def build_policy(schedule: ScheduleConfig, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
                 last_step: int | None = None) -> Policy:
    """The policy ``schedule`` names, with its settings, over ``sampler``, P0 = ``num_prompts``, R0 =
    ``group_size``; ``num_epochs`` (0: unlimited) and ``last_step`` (tail flushes its queue there;
    None: never) bound the run."""
    from rollpacker.schedule.one_step_off import OneStepOffPolicy
    from rollpacker.schedule.sorted import SortedPolicy
    from rollpacker.schedule.sync import SyncPolicy
    from rollpacker.schedule.tail import TailPolicy

    s, name = schedule, schedule.name
    common = {"filter_zero_variance": s.filter_zero_variance, "num_epochs": num_epochs}
    if name == "tail":
        return TailPolicy(sampler, num_prompts, group_size, eta_prompts=s.eta_prompts, eta_responses=s.eta_responses,
                          last_step=last_step, **common)
    if name in ("sorted", "sorted_partial"):
        return SortedPolicy(sampler, num_prompts, group_size, num_batches=s.sorted_batches,
                            partial=name == "sorted_partial", **common)
    if name == "one_step_off":
        return OneStepOffPolicy(sampler, num_prompts, group_size, **common)
    return SyncPolicy(sampler, num_prompts, group_size, **common)
