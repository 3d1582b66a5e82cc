"""``sync``: the veRL-style synchronous baseline every speedup is measured against.

Each round draws P0 prompts from the seeded sampler, launches R0 responses each and waits for
all of them: the long tail of the slowest response sets the round's length. A group is complete
when its R0 responses are in. With ``filter_zero_variance``, a group whose rewards are all equal
is dropped then instead (counted in ``sched/filtered``), and with ``refill`` a fresh prompt is
launched in its place, so that the round keeps P0 groups while the data lasts (DAPO's dynamic
sampling, verl's ``filter_groups``); with ``num_epochs``, the last round takes what is left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rollpacker.schedule.base import Group, PolicyConfig, PolicyDecision, RoundPlan, check_refill, zero_variance


@dataclass(kw_only=True)
class SyncConfig(PolicyConfig):
    """sync: the veRL baseline, P0 prompts x R0 responses, rollout waits for the longest."""

    name: ClassVar[str] = "sync"
    pipe: bool = False
    """RolloutPipe on top: fixed rollout and train pools (see rollpacker.schedule.config)."""
    refill: bool = False
    """With filter_zero_variance: launch a fresh prompt in a dropped group's place, until P0 groups are kept or the
    data runs out (DAPO's dynamic sampling, verl's filter_groups; the round runs on meanwhile)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.refill and not self.filter_zero_variance:
            raise ValueError("schedule.refill replaces the groups schedule.filter_zero_variance drops: set both")

    @property
    def refills(self) -> bool:
        return self.refill

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> SyncPolicy:
        return SyncPolicy(sampler, num_prompts, group_size, filter_zero_variance=self.filter_zero_variance,
                          num_epochs=num_epochs, refill=self.refill, max_gen_batches=self.max_gen_batches)


class SyncPolicy:
    name = "sync"

    def __init__(self, sampler, num_prompts: int, group_size: int, *, filter_zero_variance: bool = False,
                 num_epochs: int = 0, refill: bool = False, max_gen_batches: int = 10):
        self.sampler, self.num_prompts, self.group_size = sampler, num_prompts, group_size
        self.filter_zero_variance, self.num_epochs, self.refill = filter_zero_variance, num_epochs, refill
        self.max_gen_batches = max_gen_batches
        self.groups: list[Group] = []
        self.dropped: set[int] = set()
        self.pending = 0

    @property
    def needs_rewards(self) -> bool:
        """The zero-variance filter decides on rewards; nothing else does."""
        return self.filter_zero_variance

    def done(self) -> bool:
        return self.sampler.remaining(self.num_epochs) == 0

    def start_round(self, step: int) -> RoundPlan:
        left = self.sampler.remaining(self.num_epochs)
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
        decision = PolicyDecision()
        if len(group.outputs) == self.group_size:
            if self.filter_zero_variance and zero_variance(group.outputs, group.rewards):
                self.dropped.add(slot)
                decision.filtered = [group]
                if self.refill and self.sampler.remaining(self.num_epochs) != 0:  # its slot: the next one
                    check_refill(len(self.groups), self.num_prompts, self.max_gen_batches)
                    [(epoch, row)] = self.sampler.draw(1)
                    self.groups.append(Group(prompt=row, outputs=[], rewards=[], epoch=epoch))
                    self.pending += self.group_size
                    decision.launch = [row]
            else:
                decision.complete = [group]
        decision.round_done = self.pending == 0
        return decision

    def end_round(self, aborted: list[Any]) -> list[Group]:
        assert not aborted, "a sync round ends only when every response has finished"
        return [g for slot, g in enumerate(self.groups) if slot not in self.dropped]

    def stats(self) -> dict[str, Any]:
        return {"sched/filtered": len(self.dropped), "sched/epoch": self.sampler.epoch}

    def held_tokens(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
