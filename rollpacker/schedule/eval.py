"""``eval``: the held-out round. Every row once, ``num_responses`` responses each.

It is not a training policy: nothing is filtered, deferred or trained, and it keeps no state
across rounds; its episodes' environments reset alike at every evaluation (``RoundPlan.resets``), so
its curve compares the same episodes. The controller builds one per run (:meth:`Controller.build_leaders`).
:func:`eval_metrics` turns the round's rewards into ``eval/`` metrics: mean@n and unbiased
pass@k, overall and per ``data_source``. A response counts as correct as ``reward/accuracy`` counts it
(``reward.correct``: ``Controller.solved``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rollpacker.rollout.config import MIN_TEMPERATURE, TOO_COLD
from rollpacker.schedule.base import Group, PolicyDecision, RoundPlan


@dataclass(kw_only=True)
class EvalConfig:
    n: int = 1
    """Responses per held-out prompt: eval/mean@n, and eval/pass@k for k in 1 and n."""
    temperature: float = 0.0
    """Sampling temperature of the evaluation (the rest of sampling as rollout's); 0 = greedy."""

    def __post_init__(self) -> None:
        if self.n < 1 or self.temperature < 0:
            raise ValueError(f"eval.n={self.n} must be >= 1 and eval.temperature={self.temperature} >= 0")
        if 0 < self.temperature < MIN_TEMPERATURE:  # refused by the engine at the first evaluation, hours in
            raise ValueError(f"eval.temperature={self.temperature} is below {MIN_TEMPERATURE} ({TOO_COLD}): use 0 "
                             "(greedy) or more")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(f"eval.n={self.n} with eval.temperature=0: greedy gives {self.n} copies of one response; "
                             "set eval.temperature (e.g. 0.6) or eval.n=1")


def eval_rewards(group: Group) -> list[float]:
    """A held-out group's rewards to evaluate: an episode whose environment failed counts as unsolved (0, as a
    benchmark counts an item that errored, whatever its partial text scored), a missing reward as 0."""
    return [0.0 if o.finish_reason == "error" else r or 0.0 for o, r in zip(group.outputs, group.rewards)]


def eval_metrics(rewards: list[list[float]], solved: list[list[bool]], sources: list[str | None]
                 ) -> dict[str, float]:
    """``eval/`` metrics of each prompt's rewards and which responses are correct (``sources``: its data_source,
    or None).

    ``eval/accuracy`` and ``eval/reward_mean`` over every response; ``eval/mean@n`` (the mean
    reward) and ``eval/pass@k`` for k in {1, n}; the same under ``eval/SOURCE/`` per data_source.
    """
    n = len(rewards[0])
    if any(len(r) != n for r in rewards + solved):
        raise ValueError(f"eval_metrics: every prompt needs {n} rewards, got {sorted({len(r) for r in rewards})}")
    every, correct = [x for r in rewards for x in r], [c for s in solved for c in s]
    out = {"eval/accuracy": sum(correct) / len(correct), "eval/reward_mean": sum(every) / len(every)}
    groups = {"eval": list(zip(rewards, solved))}
    sources = [None if s is None else str(s) for s in sources]  # one file's 2024 and another's "2024": one key
    for source in sorted({s for s in sources if s is not None}):
        groups[f"eval/{source}"] = [g for g, s in zip(groups["eval"], sources) if s == source]
    for prefix, group in groups.items():
        out[f"{prefix}/mean@{n}"] = sum(sum(r) for r, _ in group) / (n * len(group))
        for k in sorted({1, n}):
            out[f"{prefix}/pass@{k}"] = sum(pass_at_k(n, sum(s), k) for _, s in group) / len(group)
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt (Chen et al. 2021): the chance that k of its n samples, drawn
    without replacement, hold at least one of its c correct ones: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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
                         keep=self.num_rows, resets="eval")

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

    def held_tokens(self) -> int:
        return 0

    def done(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
