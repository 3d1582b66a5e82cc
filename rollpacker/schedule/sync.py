"""``sync``: the veRL-style synchronous baseline every speedup is measured against.

Each round draws P0 prompts from the seeded sampler, launches R0 responses each and waits for
all of them: the long tail of the slowest response sets the round's length.
"""

from __future__ import annotations

from typing import Any

from rollpacker.schedule.base import Decision, Group, Round


class SyncPolicy:
    name = "sync"

    def __init__(self, sampler, num_prompts: int, group_size: int):
        self.sampler, self.num_prompts, self.group_size = sampler, num_prompts, group_size
        self.groups: dict[int, list[Any]] = {}
        self.pending = 0

    def start_round(self, step: int) -> Round:
        prompts = self.sampler.next_batch(self.num_prompts)
        self.groups = {p: [] for p in prompts}
        self.pending = len(prompts) * self.group_size
        return Round(kind="sync", prompts=prompts, num_responses=self.group_size)

    def on_finished(self, prompt: int, response: int, output: Any) -> Decision:
        self.groups[prompt].append(output)
        self.pending -= 1
        return Decision(round_done=self.pending == 0)

    def end_round(self, aborted: list[Any]) -> list[Group]:
        assert not aborted, "a sync round ends only when every response has finished"
        return [Group(prompt=p, outputs=outs) for p, outs in self.groups.items()]

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
