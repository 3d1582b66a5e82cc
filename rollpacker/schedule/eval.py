"""``eval``: the held-out round. Every row once, ``num_responses`` responses each.

It is not a training policy: nothing is filtered, deferred or trained, and it keeps no state
across rounds. The controller builds one per evaluation (:meth:`Controller.eval_leader`).
"""

from __future__ import annotations

from typing import Any

from rollpacker.schedule.base import Group, PolicyDecision, RoundPlan


class EvalPolicy:
    name = "eval"
    needs_rewards = False

    def __init__(self, num_rows: int, num_responses: int = 1):
        if num_rows <= 0 or num_responses <= 0:
            raise ValueError(f"eval: {num_rows} rows x {num_responses} responses: both must be positive")
        self.num_rows, self.num_responses = num_rows, num_responses
        self.groups: list[Group] = []
        self.pending = 0

    def start_round(self, step: int) -> RoundPlan:
        self.groups = [Group(prompt=row, outputs=[], rewards=[]) for row in range(self.num_rows)]
        self.pending = self.num_rows * self.num_responses
        return RoundPlan(kind="eval", prompts=list(range(self.num_rows)), num_responses=self.num_responses,
                         keep=self.num_rows)

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision:
        group = self.groups[slot]
        group.outputs.append(output)
        group.rewards.append(reward)
        self.pending -= 1
        complete = [group] if len(group.outputs) == self.num_responses else []
        return PolicyDecision(complete=complete, round_done=self.pending == 0)

    def end_round(self, aborted: list[Any]) -> list[Group]:
        assert not aborted, "an eval round ends only when every response has finished"
        return self.groups

    def stats(self) -> dict[str, Any]:
        return {}

    def done(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
