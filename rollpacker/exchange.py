"""A rollout round across the job, as transport: rank 0 decides, every rank steps its slice of an engine.

Each exchange, a few times per second over the gloo control plane: rank 0 sends every rank its
replica's part of a :class:`Command` (requests to add, ids to abort); every rank applies it and steps
its engine ``poll_steps`` times; the replica leaders report (:class:`Report`); rank 0 gives that to
the round (:class:`~rollpacker.schedule.round.Round`) and turns its actions into the next command.
:class:`RoundLeader` is rank 0's side for a run (rows, policy, scorer, environments); each round
is an :class:`ExchangeRound`.

Invariants:

- No decision is made here: what to add, abort, feed or scale down is the ``Round``'s.
- Nothing here imports the trainer: stream training joins through the round's hooks and a
  :class:`GroupSink`; the ranks a scale-down frees leave with :class:`Freed`.
- Rank 0 alone measures wall-clock: the running trace (bubble ratio), the tail phase, CPU time.
- No rank waits in one collective for longer than a poll or :data:`SCORE_WAIT_S`: rank 0 waits for
  rewards in slices, between exchanges, so a slow reward function is slow, never a timeout.
- A prompt travels once, to its replica: no rank gets another replica's requests, and reports leave
  out the prompts (rank 0 holds them). An episode's turn carries its whole conversation, so at scale
  this is most of the control plane's bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from rollpacker import watchdog
from rollpacker.env.info import info_metrics, selection_metrics
from rollpacker.env.setup import Environments
from rollpacker.metrics import Phases, bubble_ratio, length_stats
from rollpacker.rollout.engine import DraftContext, Engine, EngineStats, Output, Request, SamplingParams, SpecStats
from rollpacker.schedule.base import Group, Policy, RoundPlan, zero_variance
from rollpacker.schedule.drafts import DraftMemory
from rollpacker.schedule.round import Actions, Round, RoundHooks, RoundOutcome, RoundState, Routing, Seen
from rollpacker.schedule.runner import EpisodeRunner

if TYPE_CHECKING:
    from rollpacker.data.lengths import LengthReplay
    from rollpacker.dist import Meshes
    from rollpacker.env.episode import TurnRequest
    from rollpacker.reward.scheduler import RewardScheduler


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
    end_sessions: list[tuple[int, str]] = field(default_factory=list)
    """(replica, session) pairs to end: an episode is over, its turns' resident KV can go (after the aborts)."""

    def split(self, replicas: list[int]) -> list[Command]:
        """What each rank gets, by its replica (``replicas[i]``: rank i's): the replica's adds, aborts and
        sessions, and the flags; one object per replica. A pair for a replica none of them hosts (freed by a
        scale-down) goes nowhere."""
        fields = ("add", "abort", "end_sessions")
        parts = {r: dataclasses.replace(self, **{name: [] for name in fields}) for r in set(replicas)}
        for name in fields:
            for pair in getattr(self, name):
                if pair[0] in parts:
                    getattr(parts[pair[0]], name).append(pair)
        return [parts[r] for r in replicas]


TAIL_RUNNING = 8
"""A poll is in the round's tail when every replica ran at most this many requests (``RoundResult.tail_s``)."""
SCORE_WAIT_S = 1.0
"""Seconds rank 0 waits for scores between two exchanges, when only scores can move the round on: the other
ranks wait in a collective meanwhile, bounded by ``dist.timeout_s``, however long the scoring takes."""


@dataclass
class Report:
    finished: list[Output]
    """Without their prompts (``prompt_ids`` empty) until rank 0 gives them back (:meth:`ExchangeRound.received`)."""
    aborted: list[Output]
    num_running: int
    num_preemptions: int
    """Since the round began, as the next two."""
    spec: SpecStats = field(default_factory=SpecStats)
    cpu_s: float = 0.0
    """This process's CPU seconds."""
    reused_tokens: int = 0
    """Since the round began: prompt tokens prefilled from a resident session (an episode's earlier turns)."""
    session_evictions: int = 0
    """Since the round began: resident sessions evicted for memory."""
    resident_sessions: int = 0
    """Sessions holding KV now."""
    prefill_s: float = 0.0
    """This poll's seconds in engine steps that prefilled a request (:class:`~rollpacker.metrics.Phases`)."""
    decode_s: float = 0.0
    """This poll's seconds in the other engine steps."""


@dataclass
class RoundResult:
    """What rank 0 knows at the end of a round."""

    kind: str
    groups: list[Group]
    num_launched: int
    cut: list[Any]
    """The episodes the round cut (aborted), as they were when cut."""
    generated_tokens: int
    """Response tokens generated in the round, kept or not (aborted, deferred, filtered, surplus); a response
    resumed from an earlier round (``RoundPlan.carried``) counts only its new tokens."""
    model_tokens: int
    """Of those, the model's: ``rollout/tokens_per_s`` (an episode's observations are its environment's)."""
    wasted_tokens: int
    """Of those and the carried ones, the tokens neither trained nor held for a later round
    (:attr:`~rollpacker.schedule.round.RoundOutcome.wasted_tokens`)."""
    running_trace: list[tuple[float, int]]
    """(time, requests running over all replicas) at every poll: the bubble ratio's input."""
    start: float
    last_finish: float
    """When the last response the round waited for came back; ``end - last_finish`` is the exposed reward time."""
    rollout_end: float
    """When the round's final command (its aborts) came back: its rollout's end (the bubble ratio's and
    tokens per second's window ends there, as the simulator's; the reward wait after it is not rollout)."""
    end: float
    num_preemptions: int
    hook_metrics: dict[str, float] = field(default_factory=dict)
    """The round hooks' metrics (``stream/``, ``time/migration``); empty without a stream trainer."""
    spec: SpecStats = field(default_factory=SpecStats)
    """The engines' speculation counters over the round, summed over the replicas."""
    tail_s: float = 0.0
    """Seconds of polls that began with at most TAIL_RUNNING requests on every replica (the tail phase)."""
    cpu_s: float = 0.0
    """CPU seconds of the replica leaders' processes over the round, summed (what a loaded machine distorts least)."""
    tail_cpu_s: float = 0.0
    """The same over the tail phase's polls."""
    reused_tokens: int = 0
    """Prompt tokens the engines took from resident sessions instead of prefilling (episodes' turns)."""
    session_evictions: int = 0
    """Resident sessions the engines evicted for memory (their next turns recomputed their conversations)."""
    resident_sessions: int = 0
    """Sessions still holding KV after the round's last command (every episode ended: 0)."""
    env_errors: list[str] = field(default_factory=list)
    """What each environment error of the round said (its episode trained nothing), in order."""
    filtered: list[Group] = field(default_factory=list)
    """The groups the policy filtered out (zero reward variance), with their rewards."""
    phases: Phases = field(default_factory=Phases)
    """Where the round's polls spent their seconds."""

    @property
    def num_aborted(self) -> int:
        return len(self.cut)

    @property
    def reward_exposed_s(self) -> float:
        """The wait for rewards after the last response finished: reward time, not rollout."""
        return self.end - self.last_finish

    @property
    def trained_lengths(self) -> list[int]:
        """The length of every response the round trains, in group order."""
        return [len(o.token_ids) for g in self.groups for o in g.outputs]

    def metrics(self, trained: list[tuple[Any, float]], penalties: list[float], solved: list[bool]
                ) -> dict[str, Any]:
        """The round's ``sched/``, ``rollout/`` and ``reward/`` metrics (and ``time/reward_exposed``).
        ``trained``: the ``(output, reward)`` of every response trained in the step (streamed ones
        too); ``penalties``: the overlong punishment added to each (``reward/mean`` is without it);
        ``solved``: whether each is correct (``reward/accuracy``: ``Controller.solved``); ``reward/zero_variance_frac``:
        the share of the step's groups whose responses all scored alike (no signal for a group baseline).
        ``reward/mean``, ``reward/accuracy``, ``rollout/env_tokens`` and ``env/info/`` leave out episodes whose
        environment failed (``env/errors``), as their groups' advantages do; ``reward/mean`` and ``reward/accuracy``
        are left out of a step that trains no response (0 would read as every response wrong: its groups may have
        been filtered out for all solving their prompts), ``reward/zero_variance_frac`` of one with no group."""
        from rollpacker.rollout.engine import spec_metrics

        lengths = [len(o.token_ids) for o, _ in trained]
        working = [(o, r) for o, r in trained if o.finish_reason != "error"]  # a failed episode trains nothing
        model = sum(o.num_model_tokens for o, _ in working)
        rewards = [r for _, r in working]
        correct = [c for (o, _), c in zip(trained, solved) if o.finish_reason != "error"]
        mean = (lambda xs: sum(xs) / len(xs) if xs else 0.0)
        reward_of = {o.id: r for o, r in trained}
        flat = [zero_variance(g.outputs, [reward_of.get(o.id) for o in g.outputs]) for g in self.groups] + [
            zero_variance(g.outputs, g.rewards) for g in self.filtered]  # the filter's: flat, or the share reads 0
        trace = [(self.start, self.num_launched), *self.running_trace]
        return {
            "sched/round_kind": self.kind,
            "sched/trained_prompts": len(self.groups),
            "sched/failed_prompts": sum(all(o.finish_reason == "error" for o in g.outputs) for g in self.groups),
            "sched/aborted_responses": self.num_aborted,
            "rollout/wasted_tokens": self.wasted_tokens,
            **({"reward/mean": mean(rewards), "reward/accuracy": mean(correct)} if rewards else {}),
            **({"reward/zero_variance_frac": mean(flat)} if flat else {}),  # groups GRPO learns nothing from: 1 when
            # the filter dropped every group (the warning sign of a reward that scores every response alike)
            "reward/overlong_penalty_mean": mean(penalties),
            "time/reward_exposed": self.reward_exposed_s,
            "rollout/bubble_ratio": bubble_ratio(trace, self.num_launched, self.rollout_end),
            "rollout/tokens_per_s": self.model_tokens / (self.rollout_end - self.start),
            "rollout/preemptions": self.num_preemptions,
            "rollout/truncated": sum(o.truncated for o, _ in trained),
            "rollout/tail_seconds": self.tail_s,
            "rollout/cpu_seconds": self.cpu_s,
            "rollout/tail_cpu_seconds": self.tail_cpu_s,
            "rollout/reused_prefill_tokens": self.reused_tokens,
            "rollout/session_evictions": self.session_evictions,
            "rollout/resident_sessions": self.resident_sessions,
            **spec_metrics(self.spec),
            **self.phases.metrics(),
            "rollout/response_lengths": lengths,
            **length_stats(lengths),
            "rollout/model_tokens": model,
            "rollout/env_tokens": sum(len(o.token_ids) - o.num_model_tokens for o, _ in working),
            **info_metrics([o for o, _ in working], "env/"),  # env/info/KEY[_frac]: what the environments counted
            **selection_metrics(self.groups, self.cut),  # sched/kept/K beside sched/cut/K
        }


@dataclass(frozen=True)
class Freed:
    """What :func:`run_round` returns on the ranks a scale-down frees: they left the round to train."""


class GroupSink(Protocol):
    """Rank 0's end of stream training (:class:`~rollpacker.train.stream.StreamTrainer`)."""

    def ready(self) -> bool:
        """Whether the freed ranks have trained the last batch sent."""
        ...

    def feed(self, samples: list) -> None:
        """Send trainer samples to the freed ranks, without waiting."""
        ...

    def close(self) -> None:
        """The round is over: nothing more will be sent."""
        ...


def run_round(meshes: Meshes, engine: Engine, poll_steps: int,
              leader: ExchangeRound | None) -> RoundResult | Freed | None:
    """One round, collective over the ranks rolling out. Rank 0 passes its :class:`ExchangeRound`,
    the others None. Rank 0 gets the :class:`RoundResult`, the ranks a scale-down frees
    :class:`Freed`, the others None."""
    base = engine.stats(), time.process_time()
    cmd = leader.begin(meshes.num_replicas, poll_steps) if leader else None
    group = meshes.rollout_control  # the ranks rolling out; after a scale-down, the kept replicas' part of them
    replicas = meshes.replicas(group) if leader else []
    while True:
        watchdog.progress()  # a rank waiting on this round (a freed one, the other pool) waits on
        cmd = meshes.scatter(cmd.split(replicas) if leader else None, group)
        report = _apply(cmd, engine, poll_steps, base, stepping=not (cmd.scale_down and meshes.freed))
        reports = meshes.gather(report if meshes.is_replica_leader else None, group)
        if cmd.scale_down:
            if meshes.freed:  # migrated: the caller trains on what rank 0 streams until the round ends
                return Freed()
            group = meshes.kept_control
            replicas = meshes.replicas(group) if leader else []
        if cmd.final:
            if leader:
                leader.end(reports)
            # rank 0 waits for the last scores a slice at a time: no rank waits long in one collective
            while meshes.broadcast(leader.scoring() if leader else None, group):
                watchdog.progress()
            return leader.finish() if leader else None
        cmd = leader.on_reports(reports) if leader else None


@dataclass(kw_only=True)
class RoundLeader:
    """Rank 0's side of every round of a run (built once, by the controller): the rows, the policy,
    the scorer, the environments, where streamed groups go. It is each round's scorer over its rows."""

    policy: Policy
    rows: Sequence[Any]
    """The data rows; a launch names one by index."""
    encode: Callable[[Any], list[int]]
    """A row's own prompt token ids."""
    rewards: RewardScheduler
    """Scores a response of a row (the row itself, not its index)."""
    sampling: SamplingParams
    envs: Environments | None = None
    """How an episode starts and reaches its environment; None: responses without one (seed 0, any context)."""
    env_tag: str = ""
    """Prefixes this leader's episodes' names in the workers and engines (the held-out leader's: ``eval/``)."""
    held_out: bool = False
    """The held-out rounds' leader: its responses' rewards count in the held-out metrics (``eval/reward/*``)."""
    lengths: LengthReplay | None = None
    """Forces each response's length (``rollout.replay_lengths``)."""
    progress: Callable[[int, int, float], None] | None = None
    """Told after each poll: responses finished, responses launched (refills and sorted rounds launch more as they
    go), tokens per second."""
    make_samples: Callable[[Group], list] | None = None
    """A complete, scored group's trainer samples: what stream training feeds the freed ranks."""
    sink: GroupSink | None = None
    """The freed ranks (stream training, RolloutPipe)."""
    routing: Routing = Routing()
    """Which replica runs each request."""
    memory: DraftMemory | None = None
    """What earlier rounds generated per prompt; this round's outputs go into it."""
    draft_context: bool = False
    """Offer the memory's responses of each prompt to the engines' drafters (``Request.draft_context``)."""

    def __post_init__(self) -> None:
        if self.envs is None:
            self.envs = Environments.none(self.sampling.max_new_tokens)

    def round(self, step: int, plan: RoundPlan, hooks: RoundHooks | None = None) -> ExchangeRound:
        """Round ``plan`` of ``step``, to pass to :func:`run_round`."""
        return ExchangeRound(self, step, plan, hooks or RoundHooks())

    def submit(self, key: str, row: int, output: Any) -> None:
        self.rewards.submit(key, self.rows[row], output, self.held_out)

    def submit_group(self, keys: list[str], row: int, outputs: list[Any]) -> None:
        self.rewards.submit_group(keys, self.rows[row], outputs)

    def poll(self) -> list[tuple[str, float | None]]:
        return self.rewards.poll()

    def wait(self, keys: list[str]) -> list[tuple[str, float | None]]:
        return self.rewards.wait(keys, SCORE_WAIT_S)

    def runner(self) -> EpisodeRunner:
        """A round's runner over the rows."""
        envs = self.envs
        return EpisodeRunner(envs.maker(self.rows, self.encode), seed=envs.seed, environment=envs.enabled,
                             on_error=envs.cfg.on_error)

    def request(self, turn: TurnRequest, row: int, priority: int, drafts: tuple[DraftContext, ...]) -> Request:
        """The engine request of turn ``turn`` of dataset row ``row``: seeded by its id, its budget the
        episode's (less when replaying lengths: forced, and then read as the model's stop), its session
        tagged as its environment's."""
        params = dataclasses.replace(self.sampling, seed=turn.seed, max_new_tokens=turn.max_new_tokens)
        if self.lengths:
            params.max_new_tokens, params.ignore_eos = self.lengths.turn(turn, row), True
        return Request(id=turn.id, prompt_ids=turn.prompt_ids, params=params, resume_from=turn.resume_from,
                       priority=priority, session=turn.session and self.env_tag + turn.session, draft_context=drafts)


class ExchangeRound:
    """One round on rank 0: the :class:`~rollpacker.schedule.round.Round` over the replicas'
    reports, and what only rank 0 measures (the running trace, the tail phase, the counters)."""

    def __init__(self, leader: RoundLeader, step: int, plan: RoundPlan, hooks: RoundHooks):
        self.leader, self.step, self.plan, self.hooks = leader, step, plan, hooks
        self.requests: dict[str, tuple[Request, int]] = {}
        """Request id -> (request, poll it was added at)."""
        self.trace: list[tuple[float, int]] = []
        """(time, requests running) at every poll."""
        self.counters: dict[int, Report] = {}
        """Rank -> its last report (a freed rank's: its last before leaving): the round's counters."""
        self.tail_s = self.tail_cpu_s = 0.0
        self.phases = Phases()
        self.in_tail = False
        """The last report had at most TAIL_RUNNING requests on every replica: the next poll is in the tail."""
        self.freed_left = False
        """A scale-down went out: the freed ranks serve the sink until the round ends."""
        self.final: list[Report] = []
        """The replica leaders' reports of the final command (its aborts)."""
        self.rollout_end = 0.0
        """When they came back."""
        self.drafts: dict[int, tuple[DraftContext, ...]] = {}
        """Row -> its drafts this round (:meth:`contexts`): one tuple for all its turns, so a command pickles
        it once. The memory changes only when a round ends."""

    def begin(self, num_replicas: int, poll_steps: int) -> Command:
        """The round's protocol; the first command launches the plan's prompts."""
        leader = self.leader
        self.start, self.poll_steps = time.time(), poll_steps
        state = RoundState(self.step, self.plan, leader.policy, num_replicas, routing=leader.routing,
                           memory=leader.memory)
        self.round = Round(state, leader, leader.runner(), self.hooks)
        return self.command(self.round.start(self.start))

    def on_reports(self, reports: list[Report | None]) -> Command:
        """The next command, from the replica leaders' reports (None from the other ranks)."""
        self.received(reports)
        self.count(reports)
        reports = [r for r in reports if r]
        now, leader = time.time(), self.leader
        self.trace.append((now, sum(r.num_running for r in reports)))
        seen = Seen(now=now, finished=[o for r in reports for o in r.finished],
                    aborted=[o for r in reports for o in r.aborted],
                    sink_ready=leader.sink.ready() if leader.sink else True,
                    env=leader.envs.poll(leader.env_tag, idle=not self.trace[-1][1]))
        if len(self.trace) > 1:  # seconds per engine step, by requests per replica
            (t0, running), (t1, _) = self.trace[-2:]
            seen.running, seen.step_seconds = running / self.round.state.active, (t1 - t0) / self.poll_steps
        actions = self.round.poll(seen, self.generated)
        if leader.progress:
            state = self.round.state
            leader.progress(state.num_launched - len(state.outstanding), state.num_launched,
                            self.round.model_tokens_done / (time.time() - self.start))
        return self.command(actions)

    def command(self, actions: Actions) -> Command:
        """The engine requests, aborts and calls that ``actions`` say."""
        leader = self.leader
        adds = [(replica, self.resume(out)) for replica, out in actions.resume]
        for replica, priority, turn in actions.add:
            row = self.round.state.row(self.round.runner.key(turn.id))
            adds.append((replica, self.add(leader.request(turn, row, priority, self.contexts(row)))))
        leader.envs.send(actions.env, leader.rows, leader.env_tag)
        if actions.feed:
            leader.sink.feed([s for g in actions.feed for s in leader.make_samples(g)])
        self.freed_left |= actions.scale_down
        return Command(add=adds, abort=actions.abort, final=actions.done, scale_down=actions.scale_down,
                       end_sessions=[(replica, leader.env_tag + key) for replica, key in actions.end_sessions])

    def contexts(self, row: int) -> tuple[DraftContext, ...]:
        """What earlier rounds generated for ``row``, for the drafters."""
        if not self.leader.draft_context:
            return ()
        if row not in self.drafts:
            self.drafts[row] = tuple(DraftContext(source=source, token_ids=tokens)
                                     for source, tokens in self.leader.memory.contexts(row))
        return self.drafts[row]

    def add(self, req: Request) -> Request:
        self.requests[req.id] = (req, len(self.trace))
        return req

    def resume(self, out: Output) -> Request:
        """A migrated request, resumed on a kept replica by recomputation (its priority and drafts kept)."""
        old = self.requests[out.id][0]
        return self.add(dataclasses.replace(old, resume_from=out))

    def received(self, reports: list[Report | None]) -> None:
        """Give each output of ``reports`` back the prompt it left out on the way."""
        for output in (o for r in reports if r for o in (*r.finished, *r.aborted)):
            output.prompt_ids = self.requests[output.id][0].prompt_ids

    def count(self, reports: list[Report | None]) -> None:
        """Keep each replica leader's counters (a freed one's stay at its last); add the poll that just
        ended to the phases, and to the tail phase if it began there."""
        now, cpu = time.time(), sum(r.cpu_s for r in self.counters.values())
        self.phases.add(now - (self.trace[-1][0] if self.trace else self.start),
                        [(r.prefill_s, r.decode_s) for r in reports if r])
        self.counters |= {rank: r for rank, r in enumerate(reports) if r}
        if self.in_tail:
            self.tail_s += now - self.trace[-1][0] if self.trace else 0.0
            self.tail_cpu_s += sum(r.cpu_s for r in self.counters.values()) - cpu
        self.in_tail = max((r.num_running for r in reports if r), default=0) <= TAIL_RUNNING

    def generated(self) -> list[tuple[int, int]]:
        """(prompt tokens, tokens generated) of each running turn: at most the engine steps since it was added."""
        limit, polls = self.leader.sampling.max_new_tokens, len(self.trace)
        return [(len(self.requests[rid][0].prompt_ids), min(limit, (polls - self.requests[rid][1]) * self.poll_steps))
                for _, rid in self.round.running()]

    def end(self, reports: list[Report | None]) -> None:
        """The policy ends the round, once the final command's aborts are reported (:meth:`scoring`
        then says when the responses it keeps are scored)."""
        self.received(reports)
        self.count(reports)
        self.final, self.rollout_end = [r for r in reports if r], time.time()
        self.round.end([o for r in self.final for o in r.aborted])

    def scoring(self) -> bool:
        """Whether a response the round keeps is still being scored, after waiting :data:`SCORE_WAIT_S` at most."""
        return not self.round.settle()

    def finish(self) -> RoundResult:
        """The round's result, every response it keeps scored."""
        if self.freed_left:  # the freed ranks stop serving
            self.leader.sink.close()
        outcome: RoundOutcome = self.round.finish()
        self.leader.envs.send(outcome.env, self.leader.rows, self.leader.env_tag)
        counters = self.counters.values()  # the exposed reward time: what finished last
        return RoundResult(kind=self.plan.kind, groups=outcome.groups, num_launched=outcome.num_launched,
                           cut=outcome.aborted, generated_tokens=outcome.generated_tokens,
                           model_tokens=outcome.model_tokens,
                           wasted_tokens=outcome.wasted_tokens,
                           running_trace=self.trace, start=self.start, last_finish=outcome.last_finish,
                           rollout_end=self.rollout_end, end=time.time(),
                           num_preemptions=sum(r.num_preemptions for r in counters), hook_metrics=outcome.hook_metrics,
                           spec=functools.reduce(SpecStats.plus, (r.spec for r in counters), SpecStats()),
                           tail_s=self.tail_s, cpu_s=sum(r.cpu_s for r in counters), tail_cpu_s=self.tail_cpu_s,
                           reused_tokens=sum(r.reused_tokens for r in counters),
                           session_evictions=sum(r.session_evictions for r in counters),
                           resident_sessions=sum(r.resident_sessions for r in self.final),
                           env_errors=outcome.env_errors, phases=self.phases, filtered=outcome.filtered)


def _apply(cmd: Command, engine: Engine, poll_steps: int, base: tuple[EngineStats, float], stepping: bool) -> Report:
    """This replica's part of a command (:meth:`Command.split`), then ``poll_steps`` engine steps unless it is the
    last (final, or this rank freed): the replica's report, its outputs without their prompts."""
    for _, req in cmd.add:
        engine.add(req)
    aborted = [engine.abort(rid) for _, rid in cmd.abort]
    for _, session in cmd.end_sessions:
        engine.end_session(session)
    finished: list[Output] = []
    seconds = [0.0, 0.0]  # (prefill, decode): a step prefilled if it is the poll's first after adds or its counter grew
    if stepping and not cmd.final:
        added = bool(cmd.add)
        for _ in range(poll_steps):
            if not engine.has_unfinished():
                break
            prefilled, begin = engine.num_prefill_tokens, time.perf_counter()
            finished += engine.step()
            prefill = added or engine.num_prefill_tokens != prefilled
            seconds[not prefill] += time.perf_counter() - begin
            added = False
    stats, start = engine.stats(), base[0]
    finished, aborted = ([dataclasses.replace(o, prompt_ids=[]) for o in outs] for outs in (finished, aborted))
    return Report(finished, aborted, stats.num_running + stats.num_waiting,
                  stats.num_preemptions - start.num_preemptions, stats.spec.since(start.spec),
                  time.process_time() - base[1], stats.num_reused_prefill_tokens - start.num_reused_prefill_tokens,
                  stats.num_session_evictions - start.num_session_evictions, stats.num_resident_sessions, *seconds)
