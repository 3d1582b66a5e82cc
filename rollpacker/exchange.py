"""A rollout round across the job: rank 0 decides, every rank steps its slice of an engine replica.

Rollout is an exchange repeated a few times per second over the gloo control plane:

1. rank 0 broadcasts a :class:`Command`: requests to add, ids to abort;
2. every rank applies what concerns its replica and steps its engine ``poll_steps`` times;
3. the replica leaders report finished and aborted outputs;
4. rank 0 submits each finished response for scoring and hands it to the policy, in finish order.
   The policy says what to abort, what to launch and when the round is over.

The bookkeeping is :class:`~rollpacker.schedule.round.RoundState`, which the simulator drives too.
Requests are routed per request, round-robin over the replicas, so every group is spread across
them; or a group to one replica, or longest first (``rollout.routing``, ``rollout.longest_first``).
Responses carried over from an earlier round (``RoundPlan.carried``) are resumed from their
partial output, or, when already finished, only scored again.

With speculative decoding (``engine.speculative``), each request carries what earlier rounds
generated for its prompt (:class:`~rollpacker.schedule.drafts.DraftMemory`: a deferred prompt's cut
responses, an earlier epoch's) as ``Request.draft_context``; the requests of one prompt share one
tuple, so a command pickles it once. Each replica leader reports its engine's speculation counters
for the round, summed on rank 0 (``RoundResult.spec``).

Stream training and RolloutPipe join the round through its
:class:`~rollpacker.schedule.round.RoundHooks`. When the hooks scale rollout down, the freed
replicas abort their requests (resumed on the others), leave the exchange and train:
:func:`run_round` returns :class:`Freed` there, and the caller serves
(:meth:`~rollpacker.train.stream.StreamTrainer.serve_freed`).
"""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from rollpacker.dist import Meshes
from rollpacker.rollout.engine import DraftContext, Engine, EngineStats, Output, Request, SamplingParams, SpecStats
from rollpacker.schedule.base import Group, Policy, RoundPlan
from rollpacker.schedule.drafts import DraftMemory
from rollpacker.schedule.round import Launch, RoundHooks, RoundState, Routing
from rollpacker.train.stream import StreamTrainer


@dataclass
class Command:
    add: list[tuple[int, Request]] = field(default_factory=list)
    """(replica, request) pairs to add."""
    abort: list[tuple[int, str]] = field(default_factory=list)
    """(replica, request id) pairs to abort."""
    final: bool = False
    """Apply the aborts, report, and leave the round (no more engine steps)."""
    scale_down: bool = False
    """Rollout scales down: the freed replicas apply the aborts (all their requests), report, and leave to train."""


TAIL_RUNNING = 8
"""A poll is in the round's tail when every replica ran at most this many requests (``RoundResult.tail_s``)."""


@dataclass
class Report:
    finished: list[Output]
    aborted: list[Output]
    num_running: int
    num_preemptions: int
    """Since the round began, as the next two."""
    spec: SpecStats = field(default_factory=SpecStats)
    cpu_s: float = 0.0
    """This process's CPU seconds."""


@dataclass
class RoundResult:
    """What rank 0 knows at the end of a round."""

    kind: str
    groups: list[Group]
    num_launched: int
    num_aborted: int
    generated_tokens: int
    """Response tokens generated in the round, kept or not (aborted, deferred, filtered, surplus); a response
    resumed from an earlier round (``RoundPlan.carried``) counts only its new tokens."""
    running_trace: list[tuple[float, int]]
    """(time, requests running over all replicas) at every poll: the bubble ratio's input."""
    start: float
    last_finish: float
    """When the last response the round waited for came back; ``end - last_finish`` is the exposed reward time."""
    end: float
    num_preemptions: int
    stream: dict[str, float] = field(default_factory=dict)
    """The round hooks' metrics (``stream/``, ``time/migration``); empty without a stream trainer."""
    spec: SpecStats = field(default_factory=SpecStats)
    """The engines' speculation counters over the round, summed over the replicas."""
    tail_s: float = 0.0
    """Seconds of polls that began with at most TAIL_RUNNING requests on every replica (the tail phase)."""
    cpu_s: float = 0.0
    """CPU seconds of the replica leaders' processes over the round, summed (what a loaded machine distorts least)."""
    tail_cpu_s: float = 0.0
    """The same over the tail phase's polls."""

    @property
    def reward_exposed_s(self) -> float:
        """The wait for rewards after the last response finished: reward time, not rollout."""
        return self.end - self.last_finish


@dataclass(frozen=True)
class Freed:
    """What :func:`run_round` returns on the ranks a scale-down freed: they left the round to train."""


def sampling_seed(seed: int, rid: str) -> int:
    return random.Random(f"{seed}/{rid}").getrandbits(63)


class LengthReplay:
    """Forced response lengths (``--rollout.replay-lengths``), drawn from the paper's long-tailed
    mixture (the simulator's :class:`~rollpacker.data.lengths.LengthModel`: hard prompts stay long,
    longest / median ~30, scaled to ``max_new_tokens`` and cut there) and forced through the engine
    (``ignore_eos``): a random model then rolls out the tail a trained one would, and the
    simulator replays the very same lengths. A partial response resumed in a later round
    (sorted_partial) keeps the length it was first given, as in the simulator. One per run."""

    def __init__(self, seed: int, max_new_tokens: int):
        from rollpacker.data.lengths import LengthModel

        self.model, self.cap = LengthModel(seed=seed).for_cap(max_new_tokens), max_new_tokens
        self.given: dict[str, int] = {}
        """Request id -> its forced length, for the partials a later round resumes."""

    def draw(self, row: int, step: int, slot: int, response: int) -> int:
        """The length of response ``response`` of the prompt ``row`` launched in ``slot`` at ``step``."""
        return min(self.cap, int(self.model.lengths(row, step, slot, response + 1)[response]))

    def __call__(self, rid: str, row: int, step: int, slot: int, response: int, earlier=None) -> int:
        length = self.given.pop(earlier.id, None) if earlier is not None else None
        self.given[rid] = length = self.draw(row, step, slot, response) if length is None else length
        return length


class Scorer(Protocol):
    """Scores each response as it finishes (:class:`~rollpacker.reward.scheduler.RewardScheduler`)."""

    def submit(self, key: str, row: Any, output: Output) -> None: ...

    def poll(self) -> list[tuple[str, float | None]]:
        """The scores ready now."""
        ...

    def wait(self) -> list[tuple[str, float | None]]:
        """Every score still missing."""
        ...


def run_round(meshes: Meshes, engine: Engine, poll_steps: int, leader: RoundLeader | None,
              stream: StreamTrainer | None = None) -> RoundResult | Freed | None:
    """One round, collective over all ranks. Rank 0 passes its :class:`RoundLeader`, the others None.

    Rank 0 gets the :class:`RoundResult`, the ranks a scale-down frees :class:`Freed`, the others
    None. ``stream`` is the stream trainer (on every rank), or None."""
    base = engine.stats(), time.process_time()
    freed = bool(stream and stream.freed)
    if stream:
        stream.start_round()
    cmd = leader.begin(meshes.num_replicas, poll_steps, stream) if leader else None
    group = meshes.rollout_control  # the ranks rolling out; after a scale-down, the kept replicas' part of them
    while True:
        cmd = meshes.broadcast(cmd, group)
        report = _apply(cmd, meshes, engine, poll_steps, base, freed)
        reports = meshes.gather(report if meshes.is_replica_leader else None, group)
        if cmd.scale_down:
            if freed:  # migrated: the caller trains on what rank 0 streams until the round ends
                return Freed()
            group = meshes.kept_control
        if cmd.final:
            return leader.finish(reports) if leader else None
        cmd = leader.on_reports(reports) if leader else None


@dataclass(kw_only=True)
class RoundLeader:
    """Rank 0's side of a round: what the exchange needs from the controller
    (:meth:`~rollpacker.controller.Controller.leader` builds it), then the round as it runs.

    It turns the replicas' reports into the policy's :class:`RoundState` and the next command.
    Stream training and RolloutPipe join through the round's :class:`RoundHooks`."""

    step: int
    plan: RoundPlan
    policy: Policy
    rows: Sequence[Any]
    """The data rows; a launch names one by index."""
    encode: Callable[[Any], list[int]]
    """A row's prompt token ids."""
    rewards: Scorer
    sampling: SamplingParams
    seed: int = 0
    """Seeds each request's sampling (with its id)."""
    lengths: LengthReplay | None = None
    """Forces each response's length (``rollout.replay_lengths``)."""
    progress: Callable[[int, float], None] | None = None
    """Told after each poll: responses finished, tokens per second."""
    make_samples: Callable[[Group], list] | None = None
    """A complete, scored group's trainer samples: what stream training feeds the freed ranks."""
    routing: Routing = Routing()
    """Which replica runs each request."""
    memory: DraftMemory | None = None
    """What earlier rounds generated per prompt; this round's outputs go into it."""
    draft_context: bool = False
    """Offer the memory's responses of each prompt to the engines' drafters (``Request.draft_context``)."""
    # the round as it runs (set by begin)
    state: RoundState = field(init=False)
    hooks: RoundHooks = field(init=False)
    poll_steps: int = field(init=False)
    requests: dict[str, tuple[Request, int]] = field(init=False, default_factory=dict)
    """Request id -> (request, poll it was added at)."""
    trace: list[tuple[float, int]] = field(init=False, default_factory=list)
    """(time, requests running) at every poll."""
    start: float = field(init=False, default=0.0)
    last_finish: float = field(init=False, default=0.0)
    tokens_done: int = field(init=False, default=0)
    aborted: list[Output] = field(init=False, default_factory=list)
    counters: dict[int, Report] = field(init=False, default_factory=dict)
    """Rank -> its last report (a freed rank's: its last before leaving): the round's counters."""
    tail_s: float = field(init=False, default=0.0)
    tail_cpu_s: float = field(init=False, default=0.0)
    in_tail: bool = field(init=False, default=False)
    """The last report had at most TAIL_RUNNING requests on every replica: the next poll is in the tail."""

    def begin(self, num_replicas: int, poll_steps: int, stream: StreamTrainer | None) -> Command:
        """The round's state and hooks; the first command launches the plan's prompts (RolloutPipe:
        and frees the train pool at once)."""
        self.start = self.last_finish = time.time()
        self.poll_steps = poll_steps
        self.state = RoundState(self.step, self.plan, self.policy, num_replicas, routing=self.routing,
                                memory=self.memory)
        self.hooks = stream.begin_round(self.state, self.make_samples) if stream else RoundHooks()
        return Command(add=self.launch(self.state.launch(self.plan.prompts)), scale_down=self.hooks.scaled_down)

    def launch(self, launches: list[Launch]) -> list[tuple[int, Request]]:
        adds = []
        for new in launches:
            ids = self.encode(self.rows[new.row])
            for earlier in new.rescore:  # finished in an earlier round: not run again; scored for this round
                self.rewards.submit(earlier.id, self.rows[new.row], earlier)
            context = tuple(DraftContext(source=source, token_ids=tokens)  # one tuple for the whole group
                            for source, tokens in self.memory.contexts(new.row)) if self.draft_context else ()
            for k, rid, earlier in new.run:
                params = SamplingParams(**{**vars(self.sampling), "seed": sampling_seed(self.seed, rid)})
                if self.lengths:
                    length = self.lengths(rid, new.row, self.step, new.slot, k, earlier)
                    params.max_new_tokens = max(length, len(earlier.token_ids) + 1) if earlier else length
                    params.ignore_eos = True
                req = Request(id=rid, prompt_ids=ids, params=params, resume_from=earlier,
                              priority=self.hooks.priority(new.slot), draft_context=context)
                self.requests[rid] = (req, len(self.trace))
                adds.append((self.state.replica(rid), req))
        return adds

    def on_reports(self, reports: list[Report | None]) -> Command:
        """The next command, from the replica leaders' reports (None from the other ranks)."""
        state, hooks = self.state, self.hooks
        self.count(reports)
        reports = [r for r in reports if r]
        self.trace.append((time.time(), sum(r.num_running for r in reports)))
        if len(self.trace) > 1:  # seconds per engine step, by requests per replica
            (t0, running), (t1, _) = self.trace[-2:]
            hooks.on_poll(running / state.active, (t1 - t0) / self.poll_steps)
        aborted = [o for r in reports for o in r.aborted]
        resumed = hooks.on_aborted(state, aborted)  # migrated: resumed on a kept replica
        adds = [self.resume(out) for out in resumed]
        # a migrating request its engine finished before the abort reached it (SGLang's) finished: whole, not cut
        whole = [o for o in aborted if o.finish_reason != "abort" and o.id in state.outstanding]
        taken = {o.id for o in [*resumed, *whole]}
        self.aborted += [out for out in aborted if out.id not in taken]
        finished = [out for r in reports for out in r.finished] + whole
        state.finished(finished)
        for out in finished:
            self.tokens_done += len(out.token_ids)
            self.rewards.submit(out.id, self.rows[state.row(out.id)], out)
        hooks.on_finished([len(out.token_ids) for out in finished])
        if finished:
            self.last_finish = time.time()
        state.scored(self.rewards.wait() if state.needs_all_scores else self.rewards.poll())
        to_abort = hooks.maybe_scale_down(state, self.generated)
        # The policy hears of responses in the order they finished (deterministic: the engines run
        # in lockstep), once scored if it needs rewards to decide (the zero-variance filter).
        actions = state.decide(resuming=bool(adds))
        adds += self.launch(actions.launch)
        hooks.feed(state)
        if self.progress:
            self.progress(state.num_launched - len(state.outstanding), self.tokens_done / (time.time() - self.start))
        return Command(add=adds, abort=[(state.replica(rid), rid) for rid in (to_abort or []) + actions.abort],
                       final=actions.done, scale_down=to_abort is not None)

    def count(self, reports: list[Report | None]) -> None:
        """Keep each replica leader's counters (a freed one's stay at its last); add the poll that just
        ended to the tail phase if it began there."""
        now, cpu = time.time(), sum(r.cpu_s for r in self.counters.values())
        self.counters |= {rank: r for rank, r in enumerate(reports) if r}
        if self.in_tail:
            self.tail_s += now - self.trace[-1][0] if self.trace else 0.0
            self.tail_cpu_s += sum(r.cpu_s for r in self.counters.values()) - cpu
        self.in_tail = max((r.num_running for r in reports if r), default=0) <= TAIL_RUNNING

    def resume(self, out: Output) -> tuple[int, Request]:
        """A migrated request, resumed on a kept replica by recomputation."""
        old = self.requests[out.id][0]
        req = Request(id=old.id, prompt_ids=old.prompt_ids, params=old.params, resume_from=out)
        self.requests[req.id] = (req, len(self.trace))
        return self.state.route(req.id), req

    def generated(self) -> list[tuple[int, int]]:
        """(prompt tokens, tokens generated) of each outstanding request: at most the engine steps
        since it was added."""
        limit, polls = self.sampling.max_new_tokens, len(self.trace)
        return [(len(self.requests[rid][0].prompt_ids), min(limit, (polls - self.requests[rid][1]) * self.poll_steps))
                for rid in self.state.outstanding]

    def finish(self, reports: list[Report | None]) -> RoundResult:
        """The round's result, once the final command's aborts are reported."""
        state, plan = self.state, self.plan
        self.count(reports)
        self.aborted += [o for r in reports if r for o in r.aborted]
        stats = self.hooks.finish()
        groups = state.finish(self.aborted, wait=self.rewards.wait)  # the exposed reward time: what finished last
        return RoundResult(kind=plan.kind, groups=groups, num_launched=state.num_launched,
                           num_aborted=len(self.aborted),
                           generated_tokens=self.tokens_done + sum(len(o.token_ids) for o in self.aborted)
                           - sum(len(o.token_ids) for o in plan.carried.values() if o.finish_reason == "abort"),
                           running_trace=self.trace, start=self.start, last_finish=self.last_finish, end=time.time(),
                           num_preemptions=sum(r.num_preemptions for r in self.counters.values()), stream=stats,
                           spec=functools.reduce(SpecStats.plus, (r.spec for r in self.counters.values()), SpecStats()),
                           tail_s=self.tail_s, cpu_s=sum(r.cpu_s for r in self.counters.values()),
                           tail_cpu_s=self.tail_cpu_s)


def _apply(cmd: Command, meshes: Meshes, engine: Engine, poll_steps: int, base: tuple[EngineStats, float],
           freed: bool) -> Report:
    mine = meshes.replica
    for replica, req in cmd.add:
        if replica == mine:
            engine.add(req)
    aborted = [engine.abort(rid) for replica, rid in cmd.abort if replica == mine]
    finished: list[Output] = []
    if not cmd.final and not (cmd.scale_down and freed):
        for _ in range(poll_steps):
            if not engine.has_unfinished():
                break
            finished += engine.step()
    stats = engine.stats()
    return Report(finished, aborted, stats.num_running + stats.num_waiting,
                  stats.num_preemptions - base[0].num_preemptions, stats.spec.since(base[0].spec),
                  time.process_time() - base[1])
