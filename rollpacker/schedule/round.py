"""A rollout round as plain state: what rank 0's controller and the simulator both drive.

:class:`RoundState` holds one round of a scheduling policy:

- the slots (dataset rows in launch order) and which replica runs each request;
- the requests still outstanding;
- the finished responses not yet shown to the policy, and their scores;
- the groups complete so far.

It turns the policy's decisions into request ids to abort and requests to launch. It sends
nothing and measures no time. The controller (:func:`rollpacker.exchange.run_round`) drives it
with the engines' reports; the simulator (:func:`rollpacker.sim.simulate.simulate_round`) with
simulated replicas. So both make the same calls on the policy in the same order.

A round, from the driver's side:

1. ``RoundState(step, plan, policy, num_replicas)``, then :meth:`launch` of ``plan.prompts``:
   one :class:`Launch` per prompt with the responses to run, each already routed (round-robin per
   request over the active replicas, ``owner``), and the carried outputs to score again;
2. for every batch of finished responses: :meth:`finished`, :meth:`scored` as scores arrive, then
   :meth:`decide`, which shows the policy every finished response in finish order (once scored, when
   it ``needs_rewards``) and returns a :class:`RoundActions`: request ids to abort, launches, and
   whether the round is over (also when nothing is left to run or decide: a policy that forgot to
   say so still ends its round);
3. the round's :class:`RoundHooks` (stream training, RolloutPipe) hear of polls, finished and
   aborted responses; they may narrow routing to the kept replicas (:meth:`scale_down`) and take
   the complete, scored groups (:meth:`take_complete`);
4. :meth:`finish` with the aborted partial outputs: the policy's groups, with their rewards.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from rollpacker.schedule.base import Group, Policy, RoundPlan, request_id


def kept_replicas(num_replicas: int) -> int:
    """The rollout replicas that keep rolling out when stream training scales down (or RolloutPipe
    splits the pools): the first half, rounded up; the others are freed to train."""
    return num_replicas - num_replicas // 2


@dataclass
class Launch:
    """One prompt launched: slot ``slot`` holds dataset row ``row``."""

    slot: int
    row: int
    run: list[tuple[int, str, Any]] = field(default_factory=list)
    """(response, request id, partial output to resume from or None) of the responses to run, in order."""
    rescore: list[Any] = field(default_factory=list)
    """Outputs an earlier round finished (``RoundPlan.carried``): not run again, only scored again."""


@dataclass
class RoundActions:
    abort: list[str] = field(default_factory=list)
    """Request ids to abort now (only outstanding ones, none migrating)."""
    launch: list[Launch] = field(default_factory=list)
    done: bool = False
    """The round is over: ``abort`` holds everything still outstanding."""


class RoundState:
    """One round of ``policy`` (see the module docstring). Outputs need an ``id``."""

    def __init__(self, step: int, plan: RoundPlan, policy: Policy, num_replicas: int):
        self.step, self.plan, self.policy = step, plan, policy
        self.active = num_replicas
        """Replicas new requests are routed to: all, or the kept ones after a scale-down."""
        self.slots: list[int] = []
        """Slot -> dataset row."""
        self.owner: dict[str, tuple[int, int, int]] = {}
        """Request id -> (replica, slot, response), for every request launched."""
        self.outstanding: set[str] = set()
        """Requests launched and neither finished nor aborted."""
        self.migrating: set[str] = set()
        """Outstanding requests being moved off freed replicas (not aborted for the policy)."""
        self.undecided: collections.deque[Any] = collections.deque()
        """Finished responses not shown to the policy yet (waiting for their score)."""
        self.scores: dict[str, float | None] = {}
        self.complete: list[Group] = []
        """Complete groups not taken by :meth:`take_complete` yet."""
        self.num_complete = 0
        self._routed = itertools.count()

    def launch(self, rows: list[int]) -> list[Launch]:
        """Take the next slots for ``rows``: ``plan.num_responses`` requests each, routed, outstanding."""
        launches = []
        for row in rows:
            new = Launch(len(self.slots), row)
            self.slots.append(row)
            for k in range(self.plan.num_responses):
                rid, earlier = request_id(self.step, new.slot, k), self.plan.carried.get((new.slot, k))
                if earlier is not None and earlier.finish_reason != "abort":
                    new.rescore.append(earlier)
                    continue
                self.owner[rid] = (0, new.slot, k)
                self.route(rid)
                self.outstanding.add(rid)
                new.run.append((k, rid, earlier))
            launches.append(new)
        return launches

    def route(self, rid: str) -> int:
        """The replica request ``rid`` goes to (next in round-robin over the active ones), recorded."""
        replica = next(self._routed) % self.active
        self.owner[rid] = (replica, *self.owner[rid][1:])
        return replica

    def replica(self, rid: str) -> int:
        return self.owner[rid][0]

    def row(self, rid: str) -> int:
        """The dataset row of request ``rid``."""
        return self.slots[self.owner[rid][1]]

    def finished(self, outputs: list[Any]) -> None:
        """Responses that finished, in finish order."""
        self.outstanding -= {out.id for out in outputs}
        self.undecided += outputs

    def scored(self, scores) -> None:
        """``(request id, reward or None)`` pairs."""
        self.scores |= dict(scores)

    @property
    def needs_all_scores(self) -> bool:
        """The policy waits for rewards and nothing is left running: only scores can move the round on."""
        return self.policy.needs_rewards and not self.outstanding

    def decide(self, resuming: bool = False) -> RoundActions:
        """Show the policy what finished (in finish order; once scored if it ``needs_rewards``);
        ``resuming``: the driver is adding requests of its own now (migrated ones), so the round goes on."""
        out = RoundActions()
        needs = self.policy.needs_rewards
        while self.undecided and (not needs or self.undecided[0].id in self.scores):
            output = self.undecided.popleft()
            _, slot, k = self.owner[output.id]
            decision = self.policy.on_finished(slot, k, output, self.scores.get(output.id) if needs else None)
            out.abort += [rid for rid in decision.abort if rid in self.outstanding and rid not in self.migrating]
            self.outstanding -= set(decision.abort)
            out.launch += self.launch(decision.launch)
            self.complete += decision.complete
            self.num_complete += len(decision.complete)
            out.done |= decision.round_done
        if not (self.outstanding or resuming or any(new.run for new in out.launch) or self.undecided):
            out.done = True  # nothing left to run or decide: a policy that forgot to say so still ends its round
        if out.done:
            out.abort += sorted(self.outstanding - self.migrating)
            self.outstanding.clear()
        return out

    def scale_down(self, kept: int) -> list[str]:
        """Route to the first ``kept`` replicas from now on; the outstanding requests of the others,
        sorted, which are now ``migrating``."""
        self.active = kept
        self.migrating = {rid for rid in self.outstanding if self.owner[rid][0] >= kept}
        return sorted(self.migrating)

    def take_complete(self, cap: float = 0.0) -> list[Group]:
        """The complete groups whose responses are all scored, in completion order, at most
        ``cap`` x ``plan.keep`` of them with a cap; their rewards set, marked ``streamed``."""
        ready = [g for g in self.complete if all(o.id in self.scores for o in g.outputs)]
        if cap:
            ready = ready[:int(cap * self.plan.keep)]
        for g in ready:
            g.rewards = [self.scores[o.id] for o in g.outputs]
            g.streamed = True
            self.complete.remove(g)
        return ready

    @property
    def num_launched(self) -> int:
        return len(self.owner)

    def finish(self, aborted: list[Any], wait: Callable[[], Any] | None = None) -> list[Group]:
        """The policy's groups to train, given the partial outputs of the aborted requests, with
        their rewards; ``wait()`` gives the scores still missing when some response they keep has none."""
        groups = self.policy.end_round(aborted)
        if wait and any(o.id not in self.scores for g in groups for o in g.outputs):
            self.scored(wait())
        for g in groups:
            g.rewards = [self.scores[o.id] for o in g.outputs]
        return groups


class RoundHooks:
    """How a feature joins a round: what it hears and what it may change. The base does nothing:
    a round without a stream trainer. Both drivers call, on rank 0:

    - ``priority(slot)`` for each request launched: engines admit lower values first;
    - ``on_poll(running, step_seconds)`` at each poll after the first: requests running per
      active replica, and the seconds an engine step took;
    - ``on_finished(lengths)`` with the lengths of the responses that just finished;
    - ``on_aborted(state, outputs)`` with the partial outputs the replicas aborted: it returns
      those to resume on another replica (migrated);
    - ``maybe_scale_down(state, generated)`` before the policy decides: the request ids to abort
      to move rollout onto the kept replicas, or None;
    - ``feed(state)`` after the policy decided: it may take complete groups;
    - ``finish()`` when the round ends: the round's metrics.

    The stream trainer's hooks are in :mod:`rollpacker.train.stream`.
    """

    scaled_at: float | None = None
    """When rollout moved onto the kept replicas (None: it has not; RolloutPipe: at the start)."""
    completed_frac: float | None = None
    """The fraction of the round's prompts complete when :meth:`maybe_scale_down` scaled down (None: it did not)."""

    @property
    def scaled_down(self) -> bool:
        return self.scaled_at is not None

    def priority(self, slot: int) -> int:
        return 0

    def on_poll(self, running: float, step_seconds: float) -> None:
        pass

    def on_finished(self, lengths: list[int]) -> None:
        pass

    def on_aborted(self, state: RoundState, outputs: list[Any]) -> list[Any]:
        return []

    def maybe_scale_down(self, state: RoundState, generated: Callable[[], list[tuple[int, int]]]) -> list[str] | None:
        """``generated()`` gives (prompt tokens, tokens generated so far) of each outstanding request."""
        return None

    def feed(self, state: RoundState) -> None:
        pass

    def finish(self) -> dict[str, float]:
        return {}
