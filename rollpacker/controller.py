"""One RL step across the job: rank 0 decides, every rank steps its slice of an engine replica.

Rollout is an exchange repeated a few times per second over the gloo control plane:
rank 0 broadcasts a :class:`Command` (requests to add, ids to abort); every rank applies what
concerns its replica and steps its engine ``poll_steps`` times; replica leaders report finished
and aborted outputs; rank 0 submits each finished response for scoring and hands it to the
scheduling policy, in finish order, which says what to abort, what to launch and when the round is
over. Requests are routed per request, round-robin over the replicas, so every group is spread
across them.
"""

from __future__ import annotations

import collections
import random
import time
from dataclasses import dataclass, field

from rollpacker.dist import Meshes
from rollpacker.rollout.engine import Engine, Output, Request, SamplingParams
from rollpacker.schedule.base import Group, Policy, request_id


@dataclass
class Command:
    add: list[tuple[int, Request]] = field(default_factory=list)
    """(replica, request) pairs to add."""
    abort: list[tuple[int, str]] = field(default_factory=list)
    """(replica, request id) pairs to abort."""
    final: bool = False
    """Apply the aborts, report, and leave the round (no more engine steps)."""


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
    """Response tokens generated in the round, kept or not (aborted, deferred, filtered, surplus)."""
    running_trace: list[tuple[float, int]]
    """(time, requests running over all replicas) at every poll: the bubble ratio's input."""
    start: float
    last_finish: float
    """When the last response the round waited for came back; ``end - last_finish`` is the exposed reward time."""
    end: float
    num_preemptions: int


def sampling_seed(seed: int, rid: str) -> int:
    return random.Random(f"{seed}/{rid}").getrandbits(63)


def run_round(step: int, meshes: Meshes, engine: Engine, poll_steps: int, *, policy: Policy | None = None,
              rows=None, prompt_ids=None, rewards=None, sampling: SamplingParams | None = None, seed: int = 0,
              on_progress=None) -> RoundResult | None:
    """Collective over all ranks. On rank 0, which alone gets the :class:`RoundResult`: the
    ``policy``; the data ``rows`` and ``prompt_ids`` (row index -> token ids); ``rewards``, a
    :class:`~rollpacker.reward.scheduler.RewardScheduler` that scores each response as it
    finishes (a policy that ``needs_rewards`` hears of a response once it is scored); ``sampling``."""
    leader = meshes.rank == 0
    start = time.time()
    base_preemptions = engine.stats().num_preemptions
    if leader:
        plan = policy.start_round(step)
        owner: dict[str, tuple[int, int, int]] = {}  # request id -> (replica, slot, response)
        slots: list[int] = []  # slot -> dataset row

        def launch(new_rows: list[int]) -> list[tuple[int, Request]]:
            adds = []
            for row in new_rows:
                slot = len(slots)
                slots.append(row)
                ids = prompt_ids(row)
                for k in range(plan.num_responses):
                    rid = request_id(step, slot, k)
                    replica = len(owner) % meshes.num_replicas
                    owner[rid] = (replica, slot, k)
                    params = SamplingParams(**{**vars(sampling), "seed": sampling_seed(seed, rid)})
                    adds.append((replica, Request(id=rid, prompt_ids=ids, params=params)))
            return adds

        cmd = Command(add=launch(plan.prompts))
        outstanding = set(owner)
        undecided: collections.deque[Output] = collections.deque()  # finished, not yet shown to the policy
        scores: dict[str, float | None] = {}
        last_finish = start
        tokens_done = 0
        aborted: list[Output] = []
        trace: list[tuple[float, int]] = []
    else:
        cmd = None
    while True:
        cmd = meshes.broadcast(cmd)
        report = _apply(cmd, meshes, engine, poll_steps, base_preemptions)
        reports = meshes.gather(report if meshes.is_replica_leader else None)
        if cmd.final:
            if leader:
                aborted += [o for r in reports if r for o in r.aborted]
            break
        if not leader:
            cmd = None
            continue
        reports = [r for r in reports if r]
        trace.append((time.time(), sum(r.num_running for r in reports)))
        preemptions = sum(r.num_preemptions for r in reports)
        aborted += [o for r in reports for o in r.aborted]
        finished = [out for r in reports for out in r.finished]
        outstanding -= {out.id for out in finished}
        for out in finished:
            tokens_done += len(out.token_ids)
            rewards.submit(out.id, rows[slots[owner[out.id][1]]], out)
        undecided += finished
        if finished:
            last_finish = time.time()
        scores |= dict(rewards.wait() if policy.needs_rewards and not outstanding else rewards.poll())
        done = False
        to_abort: list[str] = []
        adds: list[tuple[int, Request]] = []
        # The policy hears of responses in the order they finished (deterministic: the engines run
        # in lockstep), once scored if it needs rewards to decide (the zero-variance filter).
        while undecided and (not policy.needs_rewards or undecided[0].id in scores):
            out = undecided.popleft()
            _, slot, k = owner[out.id]
            decision = policy.on_finished(slot, k, out, scores.get(out.id) if policy.needs_rewards else None)
            to_abort += [rid for rid in decision.abort if rid in outstanding]
            outstanding -= set(decision.abort)
            new = launch(decision.launch)
            adds += new
            outstanding |= {req.id for _, req in new}
            done |= decision.round_done
        if not outstanding and not adds and not undecided:
            done = True  # nothing left to run or decide: a policy that forgot to say so still ends its round
        if done:
            to_abort += sorted(outstanding)
            outstanding.clear()
        cmd = Command(add=adds, abort=[(owner[rid][0], rid) for rid in to_abort], final=done)
        if on_progress:
            on_progress(len(owner) - len(outstanding), tokens_done / (time.time() - start))
    if not leader:
        return None
    groups = policy.end_round(aborted)
    if any(o.id not in scores for g in groups for o in g.outputs):
        scores |= dict(rewards.wait())  # the exposed reward time: scoring what finished last
    for g in groups:
        g.rewards = [scores[o.id] for o in g.outputs]
    return RoundResult(kind=plan.kind, groups=groups, num_launched=len(owner), num_aborted=len(aborted),
                       generated_tokens=tokens_done + sum(len(o.token_ids) for o in aborted),
                       running_trace=trace, start=start, last_finish=last_finish, end=time.time(),
                       num_preemptions=preemptions)


def _apply(cmd: Command, meshes: Meshes, engine: Engine, poll_steps: int, base_preemptions: int) -> Report:
    mine = meshes.replica
    for replica, req in cmd.add:
        if replica == mine:
            engine.add(req)
    aborted = [engine.abort(rid) for replica, rid in cmd.abort if replica == mine]
    finished: list[Output] = []
    if not cmd.final:
        for _ in range(poll_steps):
            if not engine.has_unfinished():
                break
            finished += engine.step()
    stats = engine.stats()
    return Report(finished, aborted, stats.num_running + stats.num_waiting,
                  stats.num_preemptions - base_preemptions)

