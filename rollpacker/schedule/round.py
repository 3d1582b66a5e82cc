"""The round: one pure per-poll protocol that both drivers run (the exchange and the simulator).

:class:`RoundState` is the bookkeeping (slots, routing, outstanding requests, scores, complete
groups, migration). :class:`Round` is the protocol: a driver tells it what it saw since the last
poll (:class:`Seen`) and gets what to do now (:class:`Actions`). Every request is an episode run by
the round's :class:`~rollpacker.schedule.runner.EpisodeRunner`; a single-turn response is the
one-turn episode, so there is one request path. :class:`RoundHooks` is how a feature joins (stream
training, RolloutPipe): hooks hear and decide, never edit the state.

Invariants:

- The call order on the policy is fixed here, once: both drivers give a policy the same calls in
  the same order (``tests/unit/sim/test_sim.py`` checks it call by call).
- Nothing here sends, measures time or imports torch. Time comes in as ``Seen.now``.
- Only :class:`RoundState` writes ``migrating``. Every action names its replica: drivers route nothing.
"""

from __future__ import annotations

import collections
import copy
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Protocol

from rollpacker.errors import UserError
from rollpacker.schedule.base import Group, Policy, PolicyDecision, RoundPlan, request_id
from rollpacker.schedule.drafts import DraftMemory
from rollpacker.topology import kept_replicas

if TYPE_CHECKING:
    from rollpacker.env.contract import EnvCall
    from rollpacker.env.episode import TurnRequest
    from rollpacker.schedule.runner import EpisodeRunner


@dataclass
class Launch:
    """One prompt launched: slot ``slot`` holds dataset row ``row``."""

    slot: int
    row: int
    run: list[tuple[int, str, Any]] = field(default_factory=list)
    """(response, request id, partial output to resume from or None) of the responses to run, in order."""
    rescore: list[Any] = field(default_factory=list)
    """Outputs an earlier round finished (``RoundPlan.carried``): not run again, only scored again."""


@dataclass(frozen=True, kw_only=True)
class Routing:
    """Which replica runs each request. By default the next active replica, round-robin, so a group
    is spread over the replicas; an episode's turns all go to its replica. Migrated requests follow
    the same rules over the kept replicas; a group routed by group moves as one."""

    by_group: bool = False
    """Every request of a prompt on one replica (its drafter sees all the siblings)."""
    longest_first: bool = False
    """Dispatch longest first by the draft memory's estimate, each request to the least-loaded replica (LPT)."""


@dataclass
class Decided:
    """What the policy's decisions of one poll come to (:meth:`RoundState.decide`)."""

    abort: list[str] = field(default_factory=list)
    """Request ids to abort now (only outstanding ones, none migrating)."""
    launch: list[Launch] = field(default_factory=list)
    complete: list[Group] = field(default_factory=list)
    """The groups the policy completed."""
    done: bool = False
    """The round is over: ``abort`` holds everything still outstanding."""


@dataclass
class Returned:
    """The aborted outputs of one poll, sorted by what happens to them (:meth:`Round._returned`)."""

    resume: list[Any] = field(default_factory=list)
    """Migrated partial outputs: resumed on a kept replica by recomputation."""
    cut: list[Any] = field(default_factory=list)
    """Episodes the policy aborted, cut: what ``end_round`` gets."""
    moved: int = 0
    """How many of the outputs were migrating."""


class RoundState:
    """One round of ``policy`` on ``num_replicas`` replicas. Outputs need an ``id``."""

    def __init__(self, step: int, plan: RoundPlan, policy: Policy, num_replicas: int, *,
                 routing: Routing = Routing(), memory: DraftMemory | None = None):
        self.step, self.plan, self.policy = step, plan, policy
        self.routing, self.memory = routing, memory
        """``memory``: what earlier rounds generated per row; this round's outputs go into it at :meth:`finish`."""
        self.num_replicas = self.active = num_replicas
        """``active``: replicas new requests are routed to: all, or the kept ones after a scale-down."""
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
        self.rescored: dict[str, tuple[int, int]] = {}
        """A response an earlier round finished (``RoundPlan.carried``) -> its (slot, response) here: scored again,
        and shown to the policy again with its score of this step."""
        self.scores: dict[str, float | None] = {}
        self.complete: list[Group] = []
        """Complete groups not taken by :meth:`take_complete` yet."""
        self.num_complete = 0
        self.filtered: list[Group] = []
        """The groups the policy filtered out."""
        self.outputs: list[Any] = []
        """Every finished response, in finish order."""
        self.num_finished: collections.Counter[int] = collections.Counter()
        """Slot -> its responses finished."""
        self._routed = itertools.count()
        self._load = [0] * num_replicas
        """Per replica: estimated tokens routed to it this round (longest_first, by_group)."""
        self._group_replica: dict[int, int] = {}
        """Slot -> its replica (by_group)."""

    def launch(self, rows: list[int]) -> list[Launch]:
        """Take the next slots for ``rows``: ``plan.num_responses`` requests each, routed, outstanding.
        The launches come in dispatch order: slot order, or longest first (``longest_first``)."""
        launches = []
        for row in rows:
            new = Launch(len(self.slots), row)
            self.slots.append(row)
            for k in range(self.plan.num_responses):
                rid, earlier = request_id(self.step, new.slot, k), self.plan.carried.get((new.slot, k))
                if earlier is not None and earlier.finish_reason != "abort":
                    new.rescore.append(earlier)
                    self.rescored[earlier.id] = (new.slot, k)
                    self.undecided.append(earlier)
                    continue
                self.owner[rid] = (0, new.slot, k)
                self.outstanding.add(rid)
                new.run.append((k, rid, earlier))
            launches.append(new)
        if self.routing.longest_first and self.memory is not None:
            launches.sort(key=lambda new: -self.memory.length_bound(new.row))  # stable: slot order among equals
        for new in launches:
            for _, rid, _ in new.run:
                self.route(rid)
        return launches

    def route(self, rid: str) -> int:
        """The replica request ``rid`` goes to, recorded: round-robin over the active replicas, or by
        the routing's rules (the module docstring)."""
        _, slot, _ = self.owner[rid]
        if not (self.routing.by_group or self.routing.longest_first):
            replica = next(self._routed) % self.active
        else:
            replica = self._group_replica.get(slot, self.active) if self.routing.by_group else self.active
            if replica >= self.active:  # a new group, or one moving off a freed replica
                replica = min(range(self.active), key=lambda r: (self._load[r], r))
            self._group_replica[slot] = replica
            estimate = self.memory.length_bound(self.slots[slot]) if self.routing.longest_first and self.memory else 0
            self._load[replica] += estimate + 1
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
        self.outputs += outputs
        self.num_finished.update(self.owner[out.id][1] for out in outputs)

    def turn_priority(self, slot: int, base: int) -> int:
        """An episode's next turn's admission priority (lower first): ``base`` (the hooks' for the
        slot) first, then the frontier: the fewer of the group's responses are still to finish, the sooner."""
        num = self.plan.num_responses
        return base * (num + 1) + max(0, num - self.num_finished[slot])

    def scored(self, scores) -> None:
        """``(request id, reward or None)`` pairs."""
        self.scores |= dict(scores)

    @property
    def needs_all_scores(self) -> bool:
        """The policy waits for rewards and nothing is left running: only scores can move the round on."""
        return self.policy.needs_rewards and not self.outstanding

    def decide(self, resuming: bool = False) -> Decided:
        """Show the policy what finished (in finish order; once scored if it ``needs_rewards``);
        ``resuming``: requests of the round's own go on running (migrated ones), so the round goes on."""
        out = Decided()
        needs = self.policy.needs_rewards
        while self.undecided and (not needs or self.undecided[0].id in self.scores):
            output = self.undecided.popleft()
            slot, k = self.rescored.get(output.id) or self.owner[output.id][1:]
            decision = self.policy.on_finished(slot, k, output, self.scores.get(output.id) if needs else None)
            if not isinstance(decision, PolicyDecision):
                raise UserError(f"policy {self.policy.name}: on_finished returned {type(decision).__name__}, not a "
                                "PolicyDecision (return PolicyDecision() to decide nothing: docs/extending.md, The "
                                "contract)")
            out.abort += [rid for rid in decision.abort if rid in self.outstanding and rid not in self.migrating]
            self.outstanding -= set(decision.abort)
            out.launch += self.launch(decision.launch)
            self.complete += decision.complete
            out.complete += decision.complete
            self.num_complete += len(decision.complete)
            self.filtered += decision.filtered
            out.done |= decision.round_done
        if not (self.outstanding or resuming or any(new.run for new in out.launch) or self.undecided):
            out.done = True  # nothing left to run or decide: a policy that forgot to say so still ends its round
        if out.done:
            out.abort += sorted(self.outstanding - self.migrating)
            self.outstanding.clear()
        return out

    def migrate_to(self, kept: int, unsent: list[str] = ()) -> list[str]:
        """Route to the first ``kept`` replicas from now on. ``unsent`` requests (launched, not sent
        yet) on the others are routed again; the outstanding requests there, sorted, are returned:
        they are ``migrating`` now."""
        self.active = kept
        for rid in unsent:
            if self.owner[rid][0] >= kept:
                self.route(rid)
        self.migrating = {rid for rid in self.outstanding if self.owner[rid][0] >= kept}
        return sorted(self.migrating)

    def settle(self, rid: str) -> bool:
        """Whether request ``rid`` was migrating (and outstanding); it is not migrating any more."""
        moving = rid in self.migrating and rid in self.outstanding
        self.migrating.discard(rid)
        return moving

    def scored_complete(self) -> list[Group]:
        """The complete groups whose responses are all scored, in completion order."""
        return [g for g in self.complete if all(o.id in self.scores for o in g.outputs)]

    def take_complete(self, cap: float = 0.0) -> list[Group]:
        """:meth:`scored_complete`, at most ``cap`` x ``plan.keep`` of them with a cap; their rewards set, marked
        ``streamed``."""
        ready = self.scored_complete()
        if cap:  # one group at least (a round keeping fewer than num_prompts: the last epoch's)
            ready = ready[:max(1, int(cap * self.plan.keep + 1e-9))]
        for g in ready:
            g.rewards = [self.scores[o.id] for o in g.outputs]
            g.streamed = True
            self.complete.remove(g)
        return ready

    @property
    def num_launched(self) -> int:
        return len(self.owner)

    def unscored(self, outputs: Iterable[Any]) -> list[str]:
        """The ids of ``outputs`` without a score yet."""
        return [o.id for o in outputs if o.id not in self.scores]

    def finish(self, groups: list[Group], aborted: list[Any]) -> list[Group]:
        """The policy's ``groups`` (:meth:`Policy.end_round`'s, every response scored), their rewards set;
        the memory learns what the round generated (``aborted``: the partial outputs cut)."""
        for g in groups:
            g.rewards = [self.scores[o.id] for o in g.outputs]
        if self.memory is not None:
            self.memory.end_round(((self.row(o.id), o) for o in [*self.outputs, *aborted] if o.id in self.owner),
                                  {g.prompt for g in groups})
        return groups


@dataclass
class ScaledDown:
    """When and how a round moved onto the kept replicas (stream training, RolloutPipe)."""

    at: float
    """The driver's clock at the scale-down."""
    completed_frac: float | None
    """The round's prompts complete then (None: from the round's start, RolloutPipe)."""
    migration_s: float | None = None
    """Seconds until the migrated requests were back and prefilled (None: not yet)."""
    migrated_tokens: int = 0
    """Tokens the migration recomputes (prompt and generated)."""


class RoundHooks:
    """How a feature joins a round. It hears what happened and returns decisions; it never edits
    the state. The base does nothing: a round without stream training. :class:`Round` calls:

    - ``begin(state)`` before anything launches: True runs the round on the kept replicas from the start;
    - ``priority(slot)`` per request launched: engines admit lower values first;
    - per poll: ``on_poll(running, step_seconds)`` when the driver timed an engine step,
      ``on_finished(lengths)``, then, after the policy decided, ``scale_down_now(generated)`` (True:
      move onto the kept replicas now) and ``fetch(ready)`` (a cap on the groups to feed, None: none);
    - ``finish(scaled, num_fed)`` at the end: the round's metrics.
    """

    def begin(self, state: RoundState) -> bool:
        return False

    def priority(self, slot: int) -> int:
        return 0

    def on_poll(self, running: float, step_seconds: float) -> None:
        pass

    def on_finished(self, lengths: list[int]) -> None:
        pass

    def scale_down_now(self, generated: Callable[[], list[tuple[int, int]]]) -> bool:
        """``generated()``: (prompt tokens, tokens generated so far) of each outstanding request."""
        return False

    def fetch(self, ready: bool) -> float | None:
        """``ready``: the freed ranks took the last groups. Returns a cap (0: all, as
        :meth:`RoundState.take_complete`), or None to feed nothing now."""
        return None

    def finish(self, scaled: ScaledDown | None, num_fed: int) -> dict[str, float]:
        return {}


class Scorer(Protocol):
    """Scores each response as it finishes; ``row`` is its dataset row (the reward side composes the reward)."""

    def submit(self, key: str, row: int, output: Any) -> None: ...

    def submit_group(self, keys: list[str], row: int, outputs: list[Any]) -> None:
        """A group the policy completed, its responses submitted already: the group functions' call
        (``reward.group_funcs``); the scores of its responses include their values."""
        ...

    def poll(self) -> list[tuple[str, float | None]]:
        """The scores ready now."""
        ...

    def wait(self, keys: list[str]) -> list[tuple[str, float | None]]:
        """The scores ready, after a wait for those of ``keys``: until they are in, or a while (the driver's
        choice: the exchange's waits a second at most, then the round polls again)."""
        ...


@dataclass
class Seen:
    """What a driver observed since its last poll."""

    now: float = 0.0
    """The driver's clock (wall or simulated seconds)."""
    finished: list[Any] = field(default_factory=list)
    """Turns that finished at the engines, in finish order."""
    aborted: list[Any] = field(default_factory=list)
    """Partial outputs of the turns the last actions aborted."""
    env: list[Any] = field(default_factory=list)
    """The environment workers' replies (:class:`~rollpacker.env.contract.EnvReply`)."""
    running: float = 0.0
    """Requests running per active replica during the last poll."""
    step_seconds: float = 0.0
    """Seconds an engine step took during the last poll (0: not measured)."""
    sink_ready: bool = True
    """The freed ranks have taken the last groups fed."""


@dataclass
class Actions:
    """What a driver must do now, in this order: add and resume, abort, end sessions, call the
    environments, feed; then step on the kept replicas (after ``scale_down``, the freed ones leave)
    unless ``done``."""

    add: list[tuple[int, int, TurnRequest]] = field(default_factory=list)
    """(replica, priority, turn) of each engine request to add."""
    resume: list[tuple[int, Any]] = field(default_factory=list)
    """(replica, partial output) of each migrated turn, continued on a kept replica by recomputation."""
    abort: list[tuple[int, str]] = field(default_factory=list)
    """(replica, turn id) of each engine request to abort now."""
    end_sessions: list[tuple[int, str]] = field(default_factory=list)
    """(replica, episode) of each episode whose engine session (resident KV) can go, after the aborts."""
    env: list[EnvCall] = field(default_factory=list)
    """The calls for the environment workers, in order."""
    feed: list[Group] = field(default_factory=list)
    """Complete, scored groups for the freed ranks to train."""
    scale_down: bool = False
    """Move onto the kept replicas: the freed replicas abort everything and leave to train."""
    done: bool = False
    """The round is over once ``abort`` is applied: :meth:`Round.end` with what comes back."""


@dataclass
class RoundOutcome:
    """The round, as the policy ended it."""

    groups: list[Group]
    """The groups to train, with their rewards."""
    num_launched: int
    aborted: list[Any]
    """Every episode cut."""
    generated_tokens: int
    """Response tokens generated in the round, kept or not; a resumed carried response counts its new tokens."""
    model_tokens: int
    """Of those, the model's (an episode's observations are its environment's)."""
    wasted_tokens: int
    """Generated tokens neither trained nor held for a later round (aborted, surplus, filtered, of an episode whose
    environment failed), and tokens carried in from an earlier round and dropped here:
    ``generated + carried = trained + held + wasted``."""
    last_finish: float
    """When the last response the round waited for came back."""
    scaled: ScaledDown | None
    num_fed: int
    """Groups fed to the freed ranks."""
    hook_metrics: dict[str, float]
    """The hooks' metrics and the episodes' (``env/``, with an environment)."""
    env: list[EnvCall] = field(default_factory=list)
    """The last environment calls (the closes of the episodes cut at the end): the driver sends them."""
    env_errors: list[str] = field(default_factory=list)
    """What each environment error of the round said, in order."""
    filtered: list[Group] = field(default_factory=list)
    """The groups the policy filtered out, with their rewards."""


class Round:
    """One round of ``state``'s policy, its requests run as episodes by ``runner``, scored by
    ``scorer``, with ``hooks`` (the module docstring)."""

    def __init__(self, state: RoundState, scorer: Scorer, runner: EpisodeRunner, hooks: RoundHooks | None = None):
        self.state, self.scorer, self.runner, self.hooks = state, scorer, runner, hooks or RoundHooks()
        self.cut: list[Any] = []
        self.tokens_done = self.model_tokens_done = 0
        """Tokens of the responses finished so far."""
        self.last_finish = 0.0
        self.scaled: ScaledDown | None = None
        self.num_fed = 0
        self.grouped: set[tuple[str, ...]] = set()
        """The groups given to the scorer, by their responses' ids."""
        self.groups: list[Group] = []
        """The groups the policy keeps, once the round ended (:meth:`end`)."""

    def start(self, now: float = 0.0) -> Actions:
        """Launch the plan's prompts (on the kept replicas when the hooks begin scaled down)."""
        self.last_finish = now
        scaled = self.hooks.begin(self.state)
        if scaled:
            self.state.migrate_to(kept_replicas(self.state.num_replicas))  # nothing launched yet: nothing migrates
            self.scaled = ScaledDown(at=now, completed_frac=None, migration_s=0.0)
        self._open(self.state.launch(self.state.plan.prompts))
        return self._actions(Actions(scale_down=scaled))

    def poll(self, seen: Seen, generated: Callable[[], list[tuple[int, int]]] = list) -> Actions:
        """What to do after ``seen``. ``generated()``: (prompt tokens, tokens generated) of each
        running turn (:meth:`running`), asked only when a scale-down is considered."""
        state, hooks = self.state, self.hooks
        if seen.step_seconds:
            hooks.on_poll(seen.running, seen.step_seconds)
        back, finished = self._returned(seen)
        self._migrated(back, seen.now)
        resume = [(state.replica(self.runner.key(out.id)), out) for out in back.resume]
        self.cut += back.cut
        self._finished(finished, seen.now)
        waits = state.needs_all_scores  # only scores can move the round on
        state.scored(self.scorer.wait(state.unscored(state.undecided)) if waits else self.scorer.poll())
        # The policy hears of responses in finish order, once scored if it needs rewards to decide.
        decided = state.decide(resuming=bool(resume))
        self._group(decided.complete)
        self._open(decided.launch)
        out = Actions(resume=resume, abort=self._abort(decided.abort), done=decided.done)
        if not out.done and self.scaled is None and state.outstanding and hooks.scale_down_now(generated):
            out.abort = self._abort(state.migrate_to(kept_replicas(state.num_replicas), self.runner.idle)) + out.abort
            out.scale_down = True
            self.scaled = ScaledDown(at=seen.now, completed_frac=state.num_complete / state.plan.keep)
        out.feed = self.feed(seen.sink_ready)
        return self._actions(out)

    def running(self) -> list[tuple[int, str]]:
        """(replica, turn id) of every turn at an engine."""
        return [(self.state.replica(key), tid) for tid, key in self.runner.running.items()]

    def feed(self, ready: bool) -> list[Group]:
        """The complete, scored groups the hooks feed the freed ranks now (``ready``: they took the last)."""
        cap = self.hooks.fetch(ready)
        groups = self.state.take_complete(cap) if cap is not None else []
        self.num_fed += len(groups)
        return groups

    def end(self, aborted: list[Any]) -> None:
        """The policy ends the round, given the partial outputs of the final aborts (their episodes are
        cut, and every episode still open); the scorer gets its groups. Then :meth:`settle` until it
        says so, then :meth:`finish`."""
        runner = self.runner
        self.cut += [c for c in map(runner.cut, aborted) if c is not None] + runner.close_all()
        self.groups = checked_groups(self.state.policy, self.state.policy.end_round(self.cut))
        self._group(self.groups)

    def settle(self) -> bool:
        """Whether every response the round keeps is scored, after one wait of the scorer's for those missing."""
        missing = self.state.unscored(o for g in self.groups for o in g.outputs)
        if missing:
            self.state.scored(self.scorer.wait(missing))
        return not self.state.unscored(o for g in self.groups for o in g.outputs)

    def finish(self) -> RoundOutcome:
        """The round's outcome, once :meth:`settle` said every response it keeps is scored."""
        runner = self.runner
        metrics = self.hooks.finish(self.scaled, self.num_fed) | runner.stats.metrics()
        groups = self.state.finish(self.groups, self.cut)
        carried = self.state.plan.carried.values()
        resumed = sum(len(o.token_ids) for o in carried if o.finish_reason == "abort")
        generated = self.tokens_done + sum(len(o.token_ids) for o in self.cut) - resumed
        model = self.model_tokens_done + sum(o.num_model_tokens for o in self.cut) - resumed  # carried: no episodes
        trained = sum(len(o.token_ids) for g in groups for o in g.outputs if o.finish_reason != "error")
        wasted = generated + sum(len(o.token_ids) for o in carried) - trained - self.state.policy.held_tokens()
        return RoundOutcome(groups=groups, num_launched=self.state.num_launched, aborted=self.cut,
                            generated_tokens=generated, model_tokens=model, wasted_tokens=wasted,
                            last_finish=self.last_finish, scaled=self.scaled, num_fed=self.num_fed,
                            hook_metrics=metrics, env=runner.take_calls(), env_errors=runner.stats.causes,
                            filtered=self.state.filtered)

    def _group(self, groups: list[Group]) -> None:
        """Give the scorer each of ``groups`` it has not had."""
        for g in groups:
            ids = tuple(o.id for o in g.outputs)
            if ids and ids not in self.grouped:
                self.grouped.add(ids)
                self.scorer.submit_group(list(ids), g.prompt, g.outputs)

    def _open(self, launches: list[Launch]) -> None:
        """Open the episodes of ``launches``; responses an earlier round finished are only scored again."""
        for new in launches:
            for earlier in new.rescore:
                self.scorer.submit(earlier.id, new.row, earlier)
            for _, rid, earlier in new.run:
                self.runner.open(rid, new.row, self.state.plan.group(self.state.step, new.slot), resume=earlier)

    def _returned(self, seen: Seen) -> tuple[Returned, list[Any]]:
        """What ``seen`` brings back: the responses that finished (environment replies and finished
        turns move their episodes on), and the aborted turns sorted: one migrating resumes (or, a whole
        turn before the abort reached it, goes on), any other cuts its episode."""
        runner, back = self.runner, Returned()
        finished = runner.on_env(seen.env, seen.now) + runner.on_turns(seen.finished)
        for out in seen.aborted:
            migrating = self.state.settle(runner.key(out.id))
            if not migrating:  # the policy's abort: its episode is cut (None: it had ended already)
                back.cut += filter(None, [runner.cut(out)])
                continue
            back.moved += 1
            self.state.route(runner.key(out.id))  # to a kept replica: its resume, or its episode's next turn
            whole = runner.migrated(out)  # None: it resumes; a whole turn goes on
            if whole is None:
                back.resume.append(out)
            else:
                finished += whole
        return back, finished

    def _abort(self, keys: list[str]) -> list[tuple[int, str]]:
        """The engine requests to abort for the round's requests ``keys``; episodes between turns are cut at once."""
        turns, cut = self.runner.abort(keys)
        self.cut += cut
        return [(self.state.replica(self.runner.key(tid)), tid) for tid in turns]

    def _actions(self, out: Actions) -> Actions:
        """The turns to add, the sessions to end and the environment calls of this poll, into ``out``."""
        state, runner = self.state, self.runner
        for key, turn in runner.take_turns():
            slot = state.owner[key][1]
            out.add.append((state.replica(key), state.turn_priority(slot, self.hooks.priority(slot)), turn))
        ended = runner.take_ended([tid for _, tid in out.abort] if out.done else [])
        out.end_sessions = [(state.replica(key), key) for key in ended]
        out.env = runner.take_calls()
        return out

    def _finished(self, outputs: list[Any], now: float) -> None:
        self.state.finished(outputs)
        for out in outputs:
            self.tokens_done += len(out.token_ids)
            self.model_tokens_done += out.num_model_tokens
            self.scorer.submit(out.id, self.state.row(out.id), out)
        self.hooks.on_finished([len(out.token_ids) for out in outputs])
        if outputs:
            self.last_finish = now

    def _migrated(self, back: Returned, now: float) -> None:
        """Time the migration: it ends at the first poll that brings none of the migrating requests
        (they are back and prefilled)."""
        scaled = self.scaled
        if scaled is None:
            return
        if scaled.migration_s is None and not back.moved:
            scaled.migration_s = now - scaled.at
        scaled.migrated_tokens += sum(len(o.prompt_ids) + len(o.token_ids) for o in back.resume)


def opens_ahead(policy: Policy, step: int, seed: int) -> list[EnvCall]:
    """The environment opens of the episodes ``step``'s round will launch first, as ``policy`` will plan it
    (planned on a copy) and :meth:`RoundState.launch` number them, seeded as the round's runner opens them
    (``env.warm``); none once it is done."""
    from rollpacker.env.contract import EnvCall
    from rollpacker.env.episode import reset_seed

    ahead = copy.deepcopy(policy)
    if ahead.done():
        return []
    plan = ahead.start_round(step)
    return [EnvCall("open", rid, row=new.row, seed=reset_seed(seed, plan.group(step, new.slot)))
            for new in RoundState(step, plan, ahead, 1).launch(plan.prompts) for _, rid, _ in new.run]


def checked_groups(policy: Policy, groups: Any) -> list[Group]:
    """What ``policy.end_round`` returned, refused unless a list of distinct groups: one trained twice, or not a
    group, is a policy's bug said where it is, not data trained wrong."""
    if not isinstance(groups, list) or not all(isinstance(g, Group) for g in groups):
        kinds = sorted({type(g).__name__ for g in groups}) if isinstance(groups, list) else [type(groups).__name__]
        raise UserError(f"policy {policy.name}: end_round returned {', '.join(kinds)}, not a list of Group (the "
                        "groups its decisions reported complete: docs/extending.md, The contract)")
    if twice := len(groups) - len({id(g) for g in groups}):
        raise UserError(f"policy {policy.name}: end_round returned {twice} group(s) twice, which would train twice: "
                        "return each complete group once")
    return groups
