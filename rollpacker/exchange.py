"""A rollout round across the job: rank 0 decides, every rank steps its slice of an engine replica.

Rollout is an exchange repeated a few times per second over the gloo control plane:
rank 0 broadcasts a :class:`Command` (requests to add, ids to abort); every rank applies what
concerns its replica and steps its engine ``poll_steps`` times; replica leaders report finished
and aborted outputs; rank 0 submits each finished response for scoring and hands it to the
scheduling policy, in finish order, which says what to abort, what to launch and when the round is
over (the bookkeeping is :class:`~rollpacker.schedule.round.RoundState`, which the simulator drives
too). Requests are routed per request, round-robin over the replicas, so every group is spread
across them. Responses the policy carries over from an earlier round (``RoundPlan.carried``) are
resumed from their partial output, or, when already finished, only scored again.

With a :class:`~rollpacker.train.stream.StreamTrainer`, rank 0 also watches the round's progress
and may scale rollout down once: the second half of the replicas abort their requests (resumed on
the others by recomputation), leave the exchange and train on the complete, scored groups that
rank 0 sends them until the round ends, a batch whenever they have trained the last one: on
those ranks :func:`run_round` returns :class:`Freed` and the caller serves
(:meth:`~rollpacker.train.stream.StreamTrainer.serve_freed`). Each group fed to them is marked ``streamed``.

With a RolloutPipe stream trainer (``schedule.pipe``), the scale-down happens at the round's first
exchange, with nothing to migrate: requests are routed to the rollout pool (the kept replicas)
only, the train pool leaves at once and is fed complete groups all round, and its engines stay
released. Each request's ``priority`` is its slot (frontier-group dispatch): an engine with more
requests than it can run admits those of the earliest groups, the ones training needs next.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from rollpacker.dist import Meshes
from rollpacker.rollout.engine import Engine, Output, Request, SamplingParams
from rollpacker.schedule.base import Group, Policy, RoundPlan
from rollpacker.schedule.round import Launch, RoundState
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
    """The stream trainer's freed replicas apply the aborts (all their requests), report, and leave to train."""


@dataclass
class Report:
    finished: list[Output]
    aborted: list[Output]
    num_running: int
    num_preemptions: int


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
    """``stream/`` and ``time/migration`` metrics, with a stream trainer."""


@dataclass(frozen=True)
class Freed:
    """What :func:`run_round` returns on the ranks a scale-down freed: they left the round to train."""


def sampling_seed(seed: int, rid: str) -> int:
    return random.Random(f"{seed}/{rid}").getrandbits(63)


class LengthReplay:
    """Forced response lengths (``--rollout.replay-lengths``), drawn from the paper's long-tailed
    mixture (the simulator's :class:`~rollpacker.sim.workload.LengthModel`: hard prompts stay long,
    longest / median ~30, scaled to ``max_new_tokens`` and cut there) and forced through the engine
    (``ignore_eos``): a random model then rolls out the tail a trained one would, and the
    simulator replays the very same lengths. A partial response resumed in a later round
    (sorted_partial) keeps the length it was first given, as in the simulator. One per run."""

    def __init__(self, seed: int, max_new_tokens: int):
        from rollpacker.sim.workload import LengthModel

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


def run_round(step: int, meshes: Meshes, engine: Engine, poll_steps: int, *, policy: Policy | None = None,
              rows=None, prompt_ids=None, rewards=None, sampling: SamplingParams | None = None, seed: int = 0,
              lengths: LengthReplay | None = None, on_progress=None,
              stream: StreamTrainer | None = None, make_samples=None,
              plan: RoundPlan | None = None) -> RoundResult | Freed | None:
    """Collective over all ranks. Rank 0 gets the :class:`RoundResult`, freed ranks :class:`Freed`,
    the others None. On rank 0: the ``policy``; the data ``rows`` and ``prompt_ids`` (row index ->
    token ids); ``rewards``, a :class:`~rollpacker.reward.scheduler.RewardScheduler` that scores
    each response as it finishes (a policy that ``needs_rewards`` hears of a response once it is
    scored); ``sampling``; ``lengths`` (:class:`LengthReplay`) forces each response's length; with a ``stream`` trainer (on every rank), ``make_samples(group)``: the
    trainer samples of a complete, scored group; ``plan``, the round when the caller already asked
    the policy for it."""
    start = time.time()
    base_preemptions = engine.stats().num_preemptions
    leader = None
    if meshes.rank == 0:
        leader = _Leader(step, plan or policy.start_round(step), policy, meshes.num_replicas, poll_steps, start,
                         rows=rows, prompt_ids=prompt_ids, rewards=rewards, sampling=sampling, seed=seed,
                         lengths=lengths, on_progress=on_progress, stream=stream, make_samples=make_samples)
    cmd = leader.first_command() if leader else None
    if stream:
        stream.start_round(leader.state.plan.kind if leader else "")
    group = meshes.rollout_control  # the ranks rolling out; after a scale-down, the kept replicas' part of them
    while True:
        cmd = meshes.broadcast(cmd, group)
        report = _apply(cmd, meshes, engine, poll_steps, base_preemptions, stream)
        reports = meshes.gather(report if meshes.is_replica_leader else None, group)
        if cmd.scale_down:
            if stream.freed:  # migrated: the caller trains on what rank 0 streams until the round ends
                return Freed()
            group = meshes.kept_control
        if cmd.final:
            return leader.finish(reports) if leader else None
        cmd = leader.on_reports(reports) if leader else None


class _Leader:
    """Rank 0's side of a round: the :class:`RoundState`, the engine requests, the running trace,
    and, with a stream trainer, its scale-down, the migration and the feeding of the freed ranks."""

    def __init__(self, step: int, plan: RoundPlan, policy: Policy, num_replicas: int, poll_steps: int, start: float, *,
                 rows, prompt_ids, rewards, sampling, seed, lengths, on_progress, stream, make_samples):
        self.pipe = bool(stream and stream.pipe)  # RolloutPipe: fixed pools, the train pool serves from the start
        # replicas rolling out: all, or the first half after a scale-down (pipe: from the start)
        self.state = RoundState(step, plan, policy, stream.scale_down.kept_replicas if self.pipe else num_replicas)
        self.poll_steps, self.rows, self.prompt_ids, self.rewards = poll_steps, rows, prompt_ids, rewards
        self.sampling, self.seed, self.lengths, self.on_progress = sampling, seed, lengths, on_progress
        self.stream, self.make_samples = stream, make_samples
        self.requests: dict[str, tuple[Request, int]] = {}  # request id -> (request, poll it was added at)
        self.trace: list[tuple[float, int]] = []
        self.start = self.last_finish = start
        self.tokens_done = 0
        self.aborted: list[Output] = []
        self.preempted: dict[int, int] = {}  # rank -> preemptions this round
        # the stream trainer's side
        self.scaled_at = start if self.pipe else 0.0
        self.migration = 0.0  # -1: migrated requests not back yet
        self.migrated_tokens = 0
        self.fetching = self.pipe
        self.stats: dict[str, float] = {}

    def first_command(self) -> Command:
        return Command(add=self.launch(self.state.launch(self.state.plan.prompts)), scale_down=self.pipe)

    def launch(self, launches: list[Launch]) -> list[tuple[int, Request]]:
        adds = []
        for new in launches:
            ids = self.prompt_ids(new.row)
            for earlier in new.rescore:  # finished in an earlier round: not run again; scored for this round
                self.rewards.submit(earlier.id, self.rows[new.row], earlier)
            for k, rid, earlier in new.run:
                params = SamplingParams(**{**vars(self.sampling), "seed": sampling_seed(self.seed, rid)})
                if self.lengths:
                    length = self.lengths(rid, new.row, self.state.step, new.slot, k, earlier)
                    params.max_new_tokens = max(length, len(earlier.token_ids) + 1) if earlier else length
                    params.ignore_eos = True
                req = Request(id=rid, prompt_ids=ids, params=params, resume_from=earlier,
                              priority=new.slot if self.pipe else 0)
                self.requests[rid] = (req, len(self.trace))
                adds.append((self.state.replica(rid), req))
        return adds

    def on_reports(self, reports: list[Report | None]) -> Command:
        """The next command, from the replica leaders' reports (None from the other ranks)."""
        state, stream = self.state, self.stream
        self.preempted |= {rank: r.num_preemptions for rank, r in enumerate(reports) if r}  # freed: their last count
        reports = [r for r in reports if r]
        self.trace.append((time.time(), sum(r.num_running for r in reports)))
        if stream and len(self.trace) > 1:  # seconds per engine step, by requests per replica (throughput criterion)
            (t0, running), (t1, _) = self.trace[-2:]
            stream.scale_down.step_cost.observe(running / state.active, (t1 - t0) / self.poll_steps)
        aborted = [o for r in reports for o in r.aborted]
        if self.migration < 0 and not any(o.id in state.migrating for o in aborted):
            self.migration = time.time() - self.scaled_at  # the migrated requests are back and prefilled
        adds = [self.resume(out) for out in aborted if out.id in state.migrating and out.id in state.outstanding]
        self.aborted += [out for out in aborted if not (out.id in state.migrating and out.id in state.outstanding)]
        state.migrating -= {out.id for out in aborted}
        finished = [out for r in reports for out in r.finished]
        state.finished(finished)
        for out in finished:
            self.tokens_done += len(out.token_ids)
            self.rewards.submit(out.id, self.rows[state.row(out.id)], out)
            if stream:
                stream.scale_down.history.append(len(out.token_ids))
        if finished:
            self.last_finish = time.time()
        state.scored(self.rewards.wait() if state.needs_all_scores else self.rewards.poll())
        scale_now = bool(stream and not self.scaled_at and state.outstanding and self.consider_scale_down())
        to_abort = state.scale_down(stream.scale_down.kept_replicas) if scale_now else []
        # The policy hears of responses in the order they finished (deterministic: the engines run
        # in lockstep), once scored if it needs rewards to decide (the zero-variance filter).
        decisions = state.decide(resuming=bool(adds))
        adds += self.launch(decisions.launch)
        if self.fetching:
            self.fetching = _feed(stream, state, self.make_samples)
        if self.on_progress:
            self.on_progress(state.num_launched - len(state.outstanding), self.tokens_done / (time.time() - self.start))
        return Command(add=adds, abort=[(state.replica(rid), rid) for rid in to_abort + decisions.abort],
                       final=decisions.done, scale_down=scale_now)

    def resume(self, out: Output) -> tuple[int, Request]:
        """A migrated request, resumed on a kept replica by recomputation."""
        self.migrated_tokens += len(out.prompt_ids) + len(out.token_ids)
        old = self.requests[out.id][0]
        req = Request(id=old.id, prompt_ids=old.prompt_ids, params=old.params, resume_from=out)
        self.requests[req.id] = (req, len(self.trace))
        return self.state.route(req.id), req

    def consider_scale_down(self) -> bool:
        """Whether the stream trainer scales rollout down now; if so, the migration starts."""
        state, limit, polls = self.state, self.sampling.max_new_tokens, len(self.trace)
        if not self.stream.scale_down.consider(state.num_complete, state.plan.keep, lambda: [
                (len(self.requests[rid][0].prompt_ids), min(limit, (polls - self.requests[rid][1]) * self.poll_steps))
                for rid in state.outstanding]):  # generated tokens: at most the engine steps since the request was added
            return False
        self.scaled_at, self.migration, self.fetching = time.time(), -1.0, True
        self.stats = {"stream/scaled_down": 1.0, "stream/trigger_completed_frac": state.num_complete / state.plan.keep}
        return True

    def finish(self, reports: list[Report | None]) -> RoundResult:
        """The round's result, once the final command's aborts are reported."""
        state, stream, plan = self.state, self.stream, self.state.plan
        self.aborted += [o for r in reports if r for o in r.aborted]
        if stream and self.scaled_at:
            stream.close()
        groups = state.finish(self.aborted, wait=self.rewards.wait)  # the exposed reward time: what finished last
        stats = {}
        if stream:
            stats = {"stream/scaled_down": 0.0, "stream/trigger_completed_frac": 0.0, "time/migration": 0.0} | self.stats
            stats |= {"stream/streamed_groups": float(sum(g.streamed for g in groups))}
            if self.scaled_at:
                stats["time/migration"] = max(self.migration, 0.0)
                stream.scale_down.learn_migration(stats["time/migration"], self.migrated_tokens)
            stats |= {f"stream/projected_{k}_s": v for k, v in stream.scale_down.last.items()}  # the last look's
        return RoundResult(kind=plan.kind, groups=groups, num_launched=state.num_launched,
                           num_aborted=len(self.aborted),
                           generated_tokens=self.tokens_done + sum(len(o.token_ids) for o in self.aborted)
                           - sum(len(o.token_ids) for o in plan.carried.values() if o.finish_reason == "abort"),
                           running_trace=self.trace, start=self.start, last_finish=self.last_finish, end=time.time(),
                           num_preemptions=sum(self.preempted.values()), stream=stats)


def _feed(stream: StreamTrainer, state: RoundState, make_samples) -> bool:
    """Send the complete groups whose responses are all scored to the freed ranks once they have
    trained the last batch; False once fetching is over (a one-shot fetch, ``stream.fetch_cap``,
    happens once)."""
    if not stream.ready():
        return True
    cap = stream.config.fetch_cap
    ready = state.take_complete(cap)
    if ready:
        stream.feed([s for g in ready for s in make_samples(g)])
    return not cap


def _apply(cmd: Command, meshes: Meshes, engine: Engine, poll_steps: int, base_preemptions: int,
           stream: StreamTrainer | None) -> Report:
    mine = meshes.replica
    for replica, req in cmd.add:
        if replica == mine:
            engine.add(req)
    aborted = [engine.abort(rid) for replica, rid in cmd.abort if replica == mine]
    finished: list[Output] = []
    if not cmd.final and not (cmd.scale_down and stream.freed):
        for _ in range(poll_steps):
            if not engine.has_unfinished():
                break
            finished += engine.step()
    stats = engine.stats()
    return Report(finished, aborted, stats.num_running + stats.num_waiting,
                  stats.num_preemptions - base_preemptions)

