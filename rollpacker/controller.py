"""One RL step across the job: rank 0 decides, every rank steps its slice of an engine replica.

Rollout is an exchange repeated a few times per second over the gloo control plane:
rank 0 broadcasts a :class:`Command` (requests to add, ids to abort); every rank applies what
concerns its replica and steps its engine ``poll_steps`` times; replica leaders report finished
and aborted outputs; rank 0 submits each finished response for scoring and hands it to the
scheduling policy, in finish order, which says what to abort, what to launch and when the round is
over. Requests are routed per request, round-robin over the replicas, so every group is spread
across them. Responses the policy carries over from an earlier round (``Round.carried``) are
resumed from their partial output, or, when already finished, only scored again.

With a :class:`~rollpacker.train.stream.StreamTrainer`, rank 0 also watches the round's progress
and may scale rollout down once: the second half of the replicas abort their requests (resumed on
the others by recomputation), leave the exchange and train on the complete, scored groups that
rank 0 sends them until the round ends, a batch whenever they have trained the last one. Each
group fed to them is marked ``streamed``.

With a RolloutPipe stream trainer (``schedule.pipe``), the scale-down happens at the round's first
exchange, with nothing to migrate: requests are routed to the rollout pool (the kept replicas)
only, the train pool leaves at once and is fed complete groups all round, and its engines stay
released. Each request's ``priority`` is its slot (frontier-group dispatch): an engine with more
requests than it can run admits those of the earliest groups, the ones training needs next.
"""

from __future__ import annotations

import collections
import itertools
import random
import time
from dataclasses import dataclass, field

from rollpacker.dist import Meshes
from rollpacker.rollout.engine import Engine, Output, Request, SamplingParams
from rollpacker.schedule.base import Group, Policy, Round, request_id
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
    resumed from an earlier round (``Round.carried``) counts only its new tokens."""
    running_trace: list[tuple[float, int]]
    """(time, requests running over all replicas) at every poll: the bubble ratio's input."""
    start: float
    last_finish: float
    """When the last response the round waited for came back; ``end - last_finish`` is the exposed reward time."""
    end: float
    num_preemptions: int
    stream: dict[str, float] = field(default_factory=dict)
    """``stream/`` and ``time/migration`` metrics, with a stream trainer."""


def sampling_seed(seed: int, rid: str) -> int:
    return random.Random(f"{seed}/{rid}").getrandbits(63)


def run_round(step: int, meshes: Meshes, engine: Engine, poll_steps: int, *, policy: Policy | None = None,
              rows=None, prompt_ids=None, rewards=None, sampling: SamplingParams | None = None, seed: int = 0,
              on_progress=None, stream: StreamTrainer | None = None, make_samples=None,
              plan: Round | None = None) -> RoundResult | None:
    """Collective over all ranks. On rank 0, which alone gets the :class:`RoundResult`: the
    ``policy``; the data ``rows`` and ``prompt_ids`` (row index -> token ids); ``rewards``, a
    :class:`~rollpacker.reward.scheduler.RewardScheduler` that scores each response as it
    finishes (a policy that ``needs_rewards`` hears of a response once it is scored); ``sampling``;
    with a ``stream`` trainer (on every rank), ``make_samples(group)``: the trainer samples of a
    complete, scored group; ``plan``, the round when the caller already asked the policy for it."""
    leader = meshes.rank == 0
    pipe = bool(stream and stream.pipe)  # RolloutPipe: fixed pools, the train pool serves from the start
    start = time.time()
    base_preemptions = engine.stats().num_preemptions
    group = meshes.rollout_control  # the ranks rolling out; after a scale-down, the kept replicas' part of them
    if leader:
        plan = plan or policy.start_round(step)
        owner: dict[str, tuple[int, int, int]] = {}  # request id -> (replica, slot, response)
        requests: dict[str, tuple[Request, int]] = {}  # request id -> (request, poll it was added at)
        slots: list[int] = []  # slot -> dataset row
        # replicas rolling out: all, or the first half after a scale-down (pipe: from the start)
        active = stream.scale_down.kept_replicas if pipe else meshes.num_replicas
        routed = itertools.count()

        def route(req: Request) -> tuple[int, Request]:
            replica = next(routed) % active
            owner[req.id] = (replica, *owner[req.id][1:])
            requests[req.id] = (req, len(trace))
            return replica, req

        def launch(new_rows: list[int]) -> list[tuple[int, Request]]:
            adds = []
            for row in new_rows:
                slot = len(slots)
                slots.append(row)
                ids = prompt_ids(row)
                for k in range(plan.num_responses):
                    rid = request_id(step, slot, k)
                    earlier = plan.carried.get((slot, k))
                    if earlier is not None and earlier.finish_reason != "abort":  # finished in an earlier round:
                        rewards.submit(earlier.id, rows[row], earlier)  # not run again; scored for this round
                        continue
                    owner[rid] = (0, slot, k)
                    params = SamplingParams(**{**vars(sampling), "seed": sampling_seed(seed, rid)})
                    adds.append(route(Request(id=rid, prompt_ids=ids, params=params, resume_from=earlier,
                                              priority=slot if pipe else 0)))
            return adds

        trace: list[tuple[float, int]] = []
        cmd = Command(add=launch(plan.prompts), scale_down=pipe)
        outstanding = set(owner)
        undecided: collections.deque[Output] = collections.deque()  # finished, not yet shown to the policy
        scores: dict[str, float | None] = {}
        last_finish = start
        tokens_done = 0
        aborted: list[Output] = []
        complete: list[Group] = []  # complete groups not streamed yet
        num_complete = 0
        migrating: set[str] = set()
        scaled_at = start if pipe else 0.0
        migration = 0.0
        migrated_tokens = 0
        fetching = pipe
        stats: dict[str, float] = {}
        preempted: dict[int, int] = {}  # rank -> preemptions this round
    else:
        cmd = None
    if stream:
        stream.start_round(plan.kind if leader else "")
    while True:
        cmd = meshes.broadcast(cmd, group)
        report = _apply(cmd, meshes, engine, poll_steps, base_preemptions, stream)
        reports = meshes.gather(report if meshes.is_replica_leader else None, group)
        if cmd.scale_down:
            if stream.freed:  # migrated: now train on what rank 0 streams until the round ends
                engine.release_memory()
                stream.serve()
                if not pipe:  # pipe: released until the engine rolls out again (evaluation)
                    engine.resume_memory()
                return None
            group = meshes.kept_control
        if cmd.final:
            if leader:
                aborted += [o for r in reports if r for o in r.aborted]
            break
        if not leader:
            cmd = None
            continue
        preempted |= {rank: r.num_preemptions for rank, r in enumerate(reports) if r}  # freed replicas: their last count
        reports = [r for r in reports if r]
        trace.append((time.time(), sum(r.num_running for r in reports)))
        if stream and len(trace) > 1:  # seconds per engine step, by requests per replica (the throughput criterion)
            stream.scale_down.step_cost.observe(trace[-2][1] / active, (trace[-1][0] - trace[-2][0]) / poll_steps)
        adds: list[tuple[int, Request]] = []
        if migration < 0 and not any(o.id in migrating for r in reports for o in r.aborted):
            migration = time.time() - scaled_at  # the migrated requests are back and prefilled
        for out in (o for r in reports for o in r.aborted):
            if out.id in migrating and out.id in outstanding:  # resumed on a kept replica by recomputation
                migrated_tokens += len(out.prompt_ids) + len(out.token_ids)
                req = requests[out.id][0]
                adds.append(route(Request(id=req.id, prompt_ids=req.prompt_ids, params=req.params, resume_from=out)))
            else:
                aborted.append(out)
            migrating.discard(out.id)
        finished = [out for r in reports for out in r.finished]
        outstanding -= {out.id for out in finished}
        for out in finished:
            tokens_done += len(out.token_ids)
            rewards.submit(out.id, rows[slots[owner[out.id][1]]], out)
            if stream:
                stream.scale_down.history.append(len(out.token_ids))
        undecided += finished
        if finished:
            last_finish = time.time()
        scores |= dict(rewards.wait() if policy.needs_rewards and not outstanding else rewards.poll())
        done = scale_now = False
        to_abort: list[str] = []
        if stream and not scaled_at and outstanding and stream.scale_down.consider(num_complete, plan.keep, lambda: [
                (len(requests[rid][0].prompt_ids), min(sampling.max_new_tokens, (len(trace) - requests[rid][1]) * poll_steps))
                for rid in outstanding]):  # generated tokens: at most the engine steps since the request was added
            scale_now, scaled_at, migration, active = True, time.time(), -1.0, stream.scale_down.kept_replicas
            migrating = {rid for rid in outstanding if owner[rid][0] >= active}
            to_abort += sorted(migrating)
            fetching = True
            stats = {"stream/scaled_down": 1.0, "stream/trigger_completed_frac": num_complete / plan.keep}
        # The policy hears of responses in the order they finished (deterministic: the engines run
        # in lockstep), once scored if it needs rewards to decide (the zero-variance filter).
        while undecided and (not policy.needs_rewards or undecided[0].id in scores):
            out = undecided.popleft()
            _, slot, k = owner[out.id]
            decision = policy.on_finished(slot, k, out, scores.get(out.id) if policy.needs_rewards else None)
            to_abort += [rid for rid in decision.abort if rid in outstanding and rid not in migrating]
            outstanding -= set(decision.abort)
            new = launch(decision.launch)
            adds += new
            outstanding |= {req.id for _, req in new}
            complete += decision.complete
            num_complete += len(decision.complete)
            done |= decision.round_done
        if fetching:
            fetching = _feed(stream, complete, scores, make_samples, plan.keep)
        if not outstanding and not adds and not undecided:
            done = True  # nothing left to run or decide: a policy that forgot to say so still ends its round
        if done:
            to_abort += sorted(outstanding - migrating)
            outstanding.clear()
        cmd = Command(add=adds, abort=[(owner[rid][0], rid) for rid in to_abort], final=done, scale_down=scale_now)
        if on_progress:
            on_progress(len(owner) - len(outstanding), tokens_done / (time.time() - start))
    if not leader:
        return None
    if stream and scaled_at:
        stream.close()
    groups = policy.end_round(aborted)
    if any(o.id not in scores for g in groups for o in g.outputs):
        scores |= dict(rewards.wait())  # the exposed reward time: scoring what finished last
    for g in groups:
        g.rewards = [scores[o.id] for o in g.outputs]
    if stream:
        stats = {"stream/scaled_down": 0.0, "stream/trigger_completed_frac": 0.0, "time/migration": 0.0} | stats
        stats |= {"stream/streamed_groups": float(sum(g.streamed for g in groups))}
        if scaled_at:
            stats["time/migration"] = max(migration, 0.0)
            stream.scale_down.learn_migration(stats["time/migration"], migrated_tokens)
        stats |= {f"stream/projected_{k}_s": v for k, v in stream.scale_down.last.items()}  # the last look's
    return RoundResult(kind=plan.kind, groups=groups, num_launched=len(owner), num_aborted=len(aborted),
                       generated_tokens=tokens_done + sum(len(o.token_ids) for o in aborted)
                       - sum(len(o.token_ids) for o in plan.carried.values() if o.finish_reason == "abort"),
                       running_trace=trace, start=start, last_finish=last_finish, end=time.time(),
                       num_preemptions=sum(preempted.values()), stream=stats)


def _feed(stream: StreamTrainer, complete: list[Group], scores: dict, make_samples, keep: int) -> bool:
    """Send the complete groups whose responses are all scored to the freed ranks once they have
    trained the last batch; False once fetching is over (a one-shot fetch, ``stream.fetch_cap``,
    happens once)."""
    if not stream.ready():
        return True
    cap = stream.config.fetch_cap
    ready = [g for g in complete if all(o.id in scores for o in g.outputs)]
    if cap:
        ready = ready[:int(cap * keep)]
    if ready:
        samples = []
        for g in ready:
            g.rewards = [scores[o.id] for o in g.outputs]
            g.streamed = True
            samples += make_samples(g)
            complete.remove(g)
        stream.feed(samples)
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

