"""``sync``: the veRL-style synchronous baseline every speedup is measured against.

Each round draws P0 prompts from the seeded sampler, launches R0 responses each and waits for
all of them: the long tail of the slowest response sets the round's length. A group is complete
when its R0 responses are in. With ``filter_zero_variance``, a group whose rewards are all equal
is dropped then instead (counted in ``sched/filtered``); with ``num_epochs``, the last round takes
what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rollpacker.schedule.base import Group, PolicyConfig, PolicyDecision, RoundPlan, remaining, zero_variance


@dataclass(kw_only=True)
class SyncConfig(PolicyConfig):
    """sync: the veRL baseline, P0 prompts x R0 responses, rollout waits for the longest."""

    name: ClassVar[str] = "sync"
    pipe: bool = False
    """RolloutPipe on top: fixed rollout and train pools (see rollpacker.schedule.config)."""

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> SyncPolicy:
        return SyncPolicy(sampler, num_prompts, group_size, filter_zero_variance=self.filter_zero_variance,
                          num_epochs=num_epochs)


class SyncPolicy:
    name = "sync"

    def __init__(self, sampler, num_prompts: int, group_size: int, *, filter_zero_variance: bool = False,
                 num_epochs: int = 0):
        self.sampler, self.num_prompts, self.group_size = sampler, num_prompts, group_size
        self.filter_zero_variance, self.num_epochs = filter_zero_variance, num_epochs
        self.groups: list[Group] = []
        self.dropped: set[int] = set()
        self.pending = 0

    @property
    def needs_rewards(self) -> bool:
        """The zero-variance filter decides on rewards; nothing else does."""
        return self.filter_zero_variance

    def done(self) -> bool:
        return remaining(self.sampler, self.num_epochs) == 0

    def start_round(self, step: int) -> RoundPlan:
        left = remaining(self.sampler, self.num_epochs)
        keys = self.sampler.draw(self.num_prompts if left is None else min(self.num_prompts, left))
        self.groups = [Group(prompt=row, outputs=[], rewards=[], epoch=epoch) for epoch, row in keys]
        self.dropped, self.pending = set(), len(keys) * self.group_size
        return RoundPlan(kind="sync", prompts=[g.prompt for g in self.groups], num_responses=self.group_size,
                     keep=len(keys))

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision:
        group = self.groups[slot]
        group.outputs.append(output)
        group.rewards.append(reward)
        self.pending -= 1
        decision = PolicyDecision(round_done=self.pending == 0)
        if len(group.outputs) == self.group_size:
            if self.filter_zero_variance and zero_variance(group.rewards):
                self.dropped.add(slot)
            else:
                decision.complete = [group]
        return decision

    def end_round(self, aborted: list[Any]) -> list[Group]:
        assert not aborted, "a sync round ends only when every response has finished"
        return [g for slot, g in enumerate(self.groups) if slot not in self.dropped]

    def stats(self) -> dict[str, Any]:
        return {"sched/filtered": len(self.dropped), "sched/epoch": self.sampler.epoch}

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
