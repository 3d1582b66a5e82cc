"""``one_step_off``: verl's one-step-off-policy recipe, as a policy of ours.

A rollout pool and a training pool (``schedule.rollout_ranks``) run at once: while the training
pool takes step k on batch k, the rollout pool generates batch k+1 with the weights of step k−1's
end; at the step boundary the training pool's new weights are broadcast to the rollout pool and
batch k+1 moves to the training pool. The loop is ``rollpacker.loops.one_step_off``; this policy plans the
rounds, which are ``sync`` rounds (P0 prompts, R0 responses each, run to completion), and says how
stale their samples are.

Staleness is counted, not assumed: before each round the loop tells the policy which optimizer
step the engines' weights come from (``weights_step``, the number of steps taken when they were
pushed); a round planned as step k trains at step k, so each of its samples has staleness
k − weights_step: 1 from the second step on, 0 on the first (and on the first after a resume,
whose engines get the checkpoint's weights). The loss corrects it with the engines' log-probs
(``train.rollout_correction``).
"""

from __future__ import annotations

from typing import Any

from rollpacker.schedule.base import Group, Round
from rollpacker.schedule.sync import SyncPolicy


class OneStepOffPolicy(SyncPolicy):
    name = "one_step_off"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weights_step = 0
        """The optimizer step whose weights the engines hold (set by the loop before each round)."""
        self.lag = 0

    def start_round(self, step: int) -> Round:
        if self.weights_step > step:
            raise ValueError(f"round of step {step} planned with the weights of step {self.weights_step}")
        self.lag = step - self.weights_step
        return super().start_round(step)

    def end_round(self, aborted: list[Any]) -> list[Group]:
        groups = super().end_round(aborted)
        for g in groups:
            g.staleness = [self.lag] * len(g.outputs)
        return groups

    def stats(self) -> dict[str, Any]:
        return super().stats() | {"sched/staleness_mean": float(self.lag), "sched/staleness_max": self.lag}
