"""``sorted`` and ``sorted_partial``: SortedRL's online length-aware scheduling (SortedRL §3).

The policy loads ``schedule.sorted_batches`` x P0 prompts into its buffer at once and launches
every unconsumed one each round. A round ends once P0 groups are complete, so updates come short
first. ``sorted`` throws away what a round cut; ``sorted_partial`` keeps it and resumes it under
the next weights.

Invariants:

- No prompt is drawn until the whole load group is consumed (trained or filtered).
- Groups complete only inside a round.
- The run's last round completes every prompt it launches (none left in the buffer).
- ``sorted`` trains only tokens of the current weights (staleness 0). ``sorted_partial`` records
  each response's segment steps (``Group.staleness``) and needs a rollout correction.
- Every prompt is in exactly one ledger state. A save mid-round replays the round.

Why: oversubscribing the engines and training the short groups first cuts the wait for the
longest responses. The mechanics and how they differ from the paper: ``docs/policies.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from rollpacker.env.episode import Response
from rollpacker.schedule.base import (
    Group,
    PolicyConfig,
    PolicyDecision,
    QueuedPolicy,
    RoundPlan,
    request_id,
    zero_variance,
)
from rollpacker.schedule.ledger import Key, Ledger


@dataclass(kw_only=True)
class _LoadGroups(PolicyConfig):
    partial: ClassVar[bool] = False
    """Partial mode: keep what a cut round generated, to resume it under newer weights."""
    sorted_batches: int = 4
    """n: update batches of P0 prompts loaded at once (a load group); no more until all are consumed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sorted_batches < 1:
            raise ValueError(f"schedule.sorted_batches must be >= 1, got {self.sorted_batches}")

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> SortedPolicy:
        return SortedPolicy(sampler, num_prompts, group_size, num_batches=self.sorted_batches,
                            partial=self.partial, filter_zero_variance=self.filter_zero_variance,
                            num_epochs=num_epochs, last_step=last_step)


@dataclass(kw_only=True)
class SortedConfig(_LoadGroups):
    """sorted: SortedRL on-policy, unfinished responses are generated afresh."""

    name: ClassVar[str] = "sorted"


@dataclass(kw_only=True)
class SortedPartialConfig(_LoadGroups):
    """sorted_partial: SortedRL resuming partial responses (off-policy: needs a train.rollout_correction)."""

    name: ClassVar[str] = "sorted_partial"
    partial: ClassVar[bool] = True
    stale_samples: ClassVar[str | None] = "partial mode resumes responses under newer weights"
    carries_responses: ClassVar[str | None] = ("partial mode keeps cut responses and finished siblings for later "
                                               "rounds")
    on_policy_alternative: ClassVar[str] = SortedConfig.name


def _finished(output: Any) -> bool:
    return output is not None and output.finish_reason != "abort"


@dataclass
class _Entry:
    """The rollout buffer's entry of one prompt."""

    key: Key
    outputs: list[Any]
    """Per response: None (nothing yet), a partial output (finish_reason "abort") or a finished one."""
    rewards: list[float | None]
    segments: list[list[tuple[int, int]]]
    """Per response: (step, index of its first token) of each stretch of tokens sampled by that step's weights."""
    state: str = "waiting"
    """waiting, running, complete or filtered."""
    group: Group | None = None


class SortedPolicy(QueuedPolicy):
    def __init__(self, sampler, num_prompts: int, group_size: int, *, num_batches: int = 4, partial: bool = False,
                 filter_zero_variance: bool = False, num_epochs: int = 0, last_step: int | None = None):
        self.name = SortedPartialConfig.name if partial else SortedConfig.name
        self.sampler, self.num_prompts, self.group_size = sampler, num_prompts, group_size
        self.num_batches, self.partial = num_batches, partial
        self.filter_zero_variance, self.num_epochs, self.last_step = filter_zero_variance, num_epochs, last_step
        self.ledger = Ledger()
        self.buffer: dict[Key, _Entry] = {}
        """The unconsumed prompts of the load group."""
        self.slots: list[_Entry] = []
        self.where: dict[str, tuple[int, int]] = {}  # request id -> (slot, response), this round
        self.saved: dict | None = None  # the buffer's trajectories at the round's start, while it runs
        self.step = self.target = 0
        self.closed = False
        self._stats: dict[str, Any] = {}

    def _entry(self, key: Key) -> _Entry:
        n = self.group_size
        return _Entry(key, [None] * n, [None] * n, [[] for _ in range(n)])

    # -- planning ----------------------------------------------------------------------------

    def start_round(self, step: int) -> RoundPlan:
        """The run's last round completes every prompt it launches, and loads only the P0 it keeps: a prompt
        left in the buffer there would never be trained (its longest, the ones a cut defers)."""
        self.step, self.closed, loaded, last = step, False, 0, step == self.last_step
        if not self.ledger.queue:  # the load group is consumed: load the next one
            left = self.sampler.remaining(self.num_epochs)
            n = self.num_prompts if last else self.num_batches * self.num_prompts
            keys = self.sampler.draw(n if left is None else min(n, left))
            if not keys:
                raise RuntimeError("sorted: no prompt left to launch; check done() before start_round")
            self.buffer |= {key: self._entry(key) for key in keys}
            loaded = len(keys)
        else:
            keys = list(self.ledger.queue)
        self.saved = self._snapshot()
        self.slots = [self.buffer[key] for key in keys]
        for e in self.slots:
            self.ledger.launch(e.key)
            e.state = "running"
        self.where = {request_id(step, s, k): (s, k) for s in range(len(keys)) for k in range(self.group_size)}
        carried = {(s, k): out for s, e in enumerate(self.slots) for k, out in enumerate(e.outputs) if out is not None}
        self.target = len(keys) if last else min(self.num_prompts, len(keys))
        self._stats = {"loaded": loaded, "filtered": 0,
                       "resumed": sum(not _finished(out) for out in carried.values())}
        return RoundPlan(kind="sorted", prompts=[key[1] for key in keys], num_responses=self.group_size,
                     keep=self.target, carried=carried)

    # -- reacting ----------------------------------------------------------------------------

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision:
        e = self.slots[slot]
        if e.outputs[response] is output:  # a response kept from an earlier round, scored again: the filter's now
            e.rewards[response] = reward
            return PolicyDecision()
        finished = sum(map(_finished, e.outputs)) + 1
        if e.state != "running" or self.closed and (not self.partial or finished == self.group_size):
            return PolicyDecision()  # after the round's cut-off (see the module docstring)
        self._record(e, response, output)
        e.rewards[response] = reward
        if finished < self.group_size:
            return PolicyDecision()
        decision = PolicyDecision()
        group = Group(prompt=e.key[1], outputs=list(e.outputs), rewards=list(e.rewards), epoch=e.key[0],
                      staleness=[self.step - (segs[0][0] if segs else self.step) for segs in e.segments])
        if self.filter_zero_variance and zero_variance(e.outputs, e.rewards):
            e.state = "filtered"
            self._stats["filtered"] += 1
            decision.filtered = [group]
        else:
            e.state, e.group = "complete", group
            decision.complete = [e.group]
        complete = sum(s.state == "complete" for s in self.slots)
        running = sum(s.state == "running" for s in self.slots)
        decision.round_done = self.closed = complete >= self.target or running == 0
        return decision

    def _record(self, e: _Entry, k: int, output: Any) -> None:
        """Response ``k``'s trajectory is now ``output``: the tokens beyond its earlier one were sampled this
        step. An abort that brought no new token (the request was still queued) changes nothing."""
        before = len(e.outputs[k].token_ids) if e.outputs[k] is not None else 0
        if len(output.token_ids) > before:
            e.segments[k].append((self.step, before))
        if len(output.token_ids) > before or _finished(output):
            e.outputs[k] = output

    def end_round(self, aborted: list[Any]) -> list[Group]:
        if self.partial:  # keep the partial trajectories of the prompts going back to the buffer
            for out in aborted:
                slot, k = self.where[out.id]
                e = self.slots[slot]
                completes = _finished(out) and sum(map(_finished, e.outputs)) + 1 == self.group_size
                # a group completes only inside a round; the filter decides on rewards, and the abort brought none
                if e.state == "running" and not completes and not (self.filter_zero_variance and _finished(out)):
                    self._record(e, k, out)
        groups, deferred = [], 0
        for e in self.slots:
            if e.state == "running":
                self.ledger.settle(e.key, "deferred")
                deferred += 1
                e.state = "waiting"
                if not self.partial:  # on-policy: generated afresh under the new weights
                    self.buffer[e.key] = self._entry(e.key)
            else:
                self.ledger.settle(e.key, "trained" if e.state == "complete" else "filtered")
                del self.buffer[e.key]
                if e.state == "complete":
                    groups.append(e.group)
        staleness = [s for g in groups for s in g.staleness]
        self._stats |= {"deferred": deferred, "buffer_len": len(self.buffer), "epoch": self.sampler.epoch,
                        "staleness_mean": sum(staleness) / max(len(staleness), 1),
                        "staleness_max": max(staleness, default=0)}
        self.slots, self.where, self.saved = [], {}, None
        return groups

    def stats(self) -> dict[str, Any]:
        return {f"sched/{k}": v for k, v in self._stats.items()}

    def held_tokens(self) -> int:
        """The buffer's tokens: the partials and finished siblings of the deferred prompts (none unless partial)."""
        return sum(len(out.token_ids) for e in self.buffer.values() for out in e.outputs if out is not None)

    # -- checkpoint --------------------------------------------------------------------------

    def _snapshot(self) -> dict[Key, tuple[list, list, list]]:
        """The buffer's trajectories; shallow, as outputs are replaced in an entry, never changed in place."""
        return {key: (list(e.outputs), list(e.rewards), [list(segs) for segs in e.segments])
                for key, e in self.buffer.items() if any(out is not None for out in e.outputs)}

    def state_dict(self) -> dict[str, Any]:
        snapshot = self.saved if self.saved is not None else self._snapshot()
        buffer = [{"key": list(key), "responses": [
            {"output": _saved(out) if out is not None else None, "reward": reward,
             "segments": [list(seg) for seg in segs]} for out, reward, segs in zip(*entry)]}
            for key, entry in snapshot.items()]
        return {"sampler": self.sampler.state_dict(), "ledger": self.ledger.state_dict(), "buffer": buffer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        self.ledger.load_state_dict(state["ledger"])
        self.ledger.check(self.sampler)
        self.buffer = {key: self._entry(key) for key in self.ledger.queue}
        for item in state["buffer"]:
            key, responses = (int(item["key"][0]), int(item["key"][1])), item["responses"]
            if key not in self.buffer or len(responses) != self.group_size:
                raise ValueError(f"sorted checkpoint: buffered prompt {key} with {len(responses)} responses does not "
                                 f"fit a waiting prompt with rollout.group_size={self.group_size}; resume with the "
                                 "group size it was saved with")
            e = self.buffer[key]
            for k, r in enumerate(responses):
                e.outputs[k] = _loaded(r["output"]) if r["output"] else None
                e.rewards[k] = r["reward"]
                e.segments[k] = [(int(step), int(start)) for step, start in r["segments"]]


def _saved(out: Response) -> dict[str, Any]:
    """A buffered response as a checkpoint keeps it (JSON): its fields, its step rewards as (position, reward)
    pairs, without its environment's copy (``env_state``: bytes, for reward functions; a resumed episode's
    next reply brings a new one)."""
    state = {f.name: getattr(out, f.name) for f in dataclasses.fields(out) if f.name != "env_state"}
    state["step_rewards"] = sorted(out.step_rewards.items())
    return state


def _loaded(state: dict[str, Any]) -> Response:
    """:func:`_saved`'s response back (a checkpoint from before it held an Output's fields, or string positions)."""
    steps = state.get("step_rewards") or []
    steps = steps.items() if isinstance(steps, dict) else steps
    return Response(**{**state, "step_rewards": {int(pos): reward for pos, reward in steps}})
