"""``tail``: RollPacker's tail batching (paper §3).

A short round launches ⌈η_P·P0⌉ fresh prompts with ⌈η_R·R0⌉ responses each. It keeps each
prompt's first R0 responses and the first P0 prompts to complete; the rest go to the long-prompt
queue. Once the queue holds ⌈η_L·P0⌉ prompts, a long round launches the oldest of them, R0 each,
and keeps the first P0 to complete (the paper's η_L = 1: all to completion); the rest go back to
the front of the queue.

Invariants:

- On-policy: a deferred prompt's responses are thrown away, and its long round generates afresh.
- A filtered prompt (``filter_zero_variance``) does not count towards P0: a fresh one replaces it.
- Nothing waits forever: the queue is flushed at the last epoch and at the run's last step (a long
  round that holds the whole queue, or the run's last, keeps every prompt it launched); with the queue
  empty there, the last short round launches only the prompts it keeps.
- Every prompt is in exactly one state of the :class:`~rollpacker.schedule.ledger.Ledger`, saved
  with the sampler in the checkpoint.

Why: the longest responses hold a synchronous round up. Short rounds cut them off, and long
rounds batch them together. The rules in full: ``docs/policies.md`` (tail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rollpacker.schedule.base import (
    Group,
    PolicyConfig,
    PolicyDecision,
    QueuedPolicy,
    RoundPlan,
    check_refill,
    provisioned,
    request_id,
    zero_variance,
)
from rollpacker.schedule.ledger import Key, Ledger

PAPER_ETA_PROMPTS = PAPER_ETA_RESPONSES = 1.25
"""η_P and η_R (RollPacker's defaults; over episodes η_R is 1)."""


def eta_overrides(prompts: float = 0.0, responses: float = 0.0, long: float = 0.0, paper: bool = False) -> dict:
    """tail's η as the benchmarks' flags give them (0: the policy's default), as ``TailConfig`` fields;
    ``paper``: the paper's policy alone (η_P 1.25 unless given, long rounds of exactly P0)."""
    etas = {"eta_prompts": prompts, "eta_responses": responses, "eta_long": long}
    if paper:
        etas |= {"eta_prompts": prompts or PAPER_ETA_PROMPTS, "eta_long": 1.0}
    return {key: value for key, value in etas.items() if value}


@dataclass(kw_only=True)
class TailConfig(PolicyConfig):
    """tail: RollPacker's tail batching, speculative short rounds and a long-prompt queue."""

    name: ClassVar[str] = "tail"
    eta_prompts: float = PAPER_ETA_PROMPTS
    """η_P: short rounds launch ⌈η_P·P0⌉ prompts (1 = no prompt speculation; 1.25 the paper's). Over episodes 2
    is faster, and learned the slow tool later than sync (docs/policies.md, bench parity)."""
    eta_responses: float | None = None
    """η_R: short rounds launch ⌈η_R·R0⌉ responses per prompt, keep the first R0 (1 = no response speculation).
    None: 1.25 (the paper's), but 1 for episodes: keeping a group's first episodes teaches an agent to avoid
    its slow actions (docs/policies.md, bench parity)."""
    eta_long: float = 1.0
    """η_L: long rounds launch ⌈η_L·P0⌉ of the queue's prompts and keep the first P0 to complete (1: the paper's,
    all to completion)."""
    pipe: bool = False
    """RolloutPipe on top: fixed rollout and train pools (see rollpacker.schedule.config)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        etas = {"eta_prompts": self.eta_prompts, "eta_responses": self.eta_responses, "eta_long": self.eta_long}
        if bad := [f"schedule.{k}={v}" for k, v in etas.items() if v is not None and not 1 <= v < math.inf]:
            raise ValueError(f"{', '.join(bad)}: each η must be a finite number >= 1 (1: no speculation)")

    def settle(self, episodes: bool) -> None:
        if self.eta_responses is None:
            self.eta_responses = 1.0 if episodes else PAPER_ETA_RESPONSES

    @property
    def refills(self) -> bool:
        return self.filter_zero_variance  # a short round's dropped group

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> TailPolicy:
        """Tail batching; at ``last_step`` a non-empty long-prompt queue is flushed whole."""
        eta_responses = PAPER_ETA_RESPONSES if self.eta_responses is None else self.eta_responses
        return TailPolicy(sampler, num_prompts, group_size, eta_prompts=self.eta_prompts,
                          eta_responses=eta_responses, eta_long=self.eta_long,
                          filter_zero_variance=self.filter_zero_variance, max_gen_batches=self.max_gen_batches,
                          num_epochs=num_epochs, last_step=last_step)


@dataclass
class _Launched:
    key: Key
    group: Group
    finished: set[int] = field(default_factory=set)
    state: str = "running"
    """running, complete or filtered."""


class TailPolicy(QueuedPolicy):
    name = "tail"

    def __init__(self, sampler, num_prompts: int, group_size: int, *, eta_prompts: float = 1.25,
                 eta_responses: float = PAPER_ETA_RESPONSES, eta_long: float = 1.0, filter_zero_variance: bool = False,
                 max_gen_batches: int = 10, num_epochs: int = 0, last_step: int | None = None):
        self.sampler, self.num_prompts, self.group_size = sampler, num_prompts, group_size
        self.eta_prompts, self.eta_responses, self.eta_long = eta_prompts, eta_responses, eta_long
        self.filter_zero_variance, self.num_epochs, self.last_step = filter_zero_variance, num_epochs, last_step
        self.max_gen_batches = max_gen_batches
        self.ledger = Ledger()
        self.slots: list[_Launched] = []
        self.round: RoundPlan | None = None
        self.step = 0
        self.target = 0
        self.closed = False
        self._stats: dict[str, Any] = {}

    # -- planning ----------------------------------------------------------------------------

    def start_round(self, step: int) -> RoundPlan:
        left = self.sampler.remaining(self.num_epochs)
        queue = self.ledger.queue
        self.step, self.slots = step, []
        long = provisioned(self.eta_long, self.num_prompts)
        if len(queue) >= long or queue and (left == 0 or step == self.last_step):
            n = len(queue) if step == self.last_step else min(len(queue), long)
            keys = [queue[i] for i in range(n)]
            flush = step == self.last_step or n == len(queue) and left == 0
            self.target, responses, kind = n if flush else min(n, self.num_prompts), self.group_size, "long"
        else:
            # the run's last round launches only what it keeps: a prompt it deferred would never come back
            launch = self.num_prompts if step == self.last_step else provisioned(self.eta_prompts, self.num_prompts)
            keys = self.sampler.draw(launch if left is None else min(launch, left))
            if not keys:
                raise RuntimeError("tail: no prompt left to launch; check done() before start_round")
            self.target = min(self.num_prompts, len(keys))
            responses, kind = provisioned(self.eta_responses, self.group_size), "short"
        for key in keys:
            self._launch(key)
        self.round = RoundPlan(kind=kind, prompts=[k[1] for k in keys], num_responses=responses, keep=self.target)
        self._stats = {"filtered": 0}
        self.closed = False
        return self.round

    def _launch(self, key: Key) -> None:
        self.ledger.launch(key)
        self.slots.append(_Launched(key, Group(prompt=key[1], outputs=[], rewards=[], epoch=key[0])))

    # -- reacting ----------------------------------------------------------------------------

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision:
        p = self.slots[slot]
        if p.state != "running" or self.closed:
            return PolicyDecision()  # finished before its abort landed, or after the round's cut-off: thrown away
        p.group.outputs.append(output)
        p.group.rewards.append(reward)
        p.finished.add(response)
        decision = PolicyDecision()
        if len(p.group.outputs) < self.group_size:
            return decision
        decision.abort = [request_id(self.step, slot, k) for k in range(self.round.num_responses)
                          if k not in p.finished]
        if self.filter_zero_variance and zero_variance(p.group.outputs, p.group.rewards):
            p.state = "filtered"
            self._stats["filtered"] += 1
            decision.filtered = [p.group]
            if self.round.kind == "short" and self.sampler.remaining(self.num_epochs) != 0:
                check_refill(len(self.slots), self.num_prompts, self.max_gen_batches)
                key = self.sampler.draw(1)[0]  # launch a fresh prompt in its place
                self._launch(key)
                decision.launch = [key[1]]
        else:
            p.state = "complete"
            decision.complete = [p.group]
        complete = sum(s.state == "complete" for s in self.slots)
        running = sum(s.state == "running" for s in self.slots)
        decision.round_done = self.closed = complete >= self.target or running == 0
        return decision

    def end_round(self, aborted: list[Any]) -> list[Group]:
        groups, long = [], self.round.kind == "long"
        for p in self.slots:
            if p.state == "complete":
                self.ledger.settle(p.key, "trained")
                groups.append(p.group)
            elif p.state == "filtered":
                self.ledger.settle(p.key, "filtered")
        deferred = [p.key for p in self.slots if p.state == "running"]
        for key in reversed(deferred) if long else deferred:  # a long round's go back to the front, oldest first
            self.ledger.settle(key, "deferred", front=long)
        if long and len(deferred) > len(self.slots) - self.target:
            raise AssertionError("tail: a long round deferred prompts it had to keep")
        self._stats |= {"deferred": len(deferred), "long_queue_len": len(self.ledger.queue),
                        "epoch": self.sampler.epoch}
        self.slots = []
        return groups

    def stats(self) -> dict[str, Any]:
        return {f"sched/{k}": v for k, v in self._stats.items()}

    # -- checkpoint --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.ledger.load_state_dict(state["ledger"])
        self.ledger.check(self.sampler)
