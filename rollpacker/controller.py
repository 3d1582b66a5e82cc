"""One RL step across the job: rank 0 decides, every rank steps its slice of an engine replica.

Rollout is an exchange repeated a few times per second over the gloo control plane:
rank 0 broadcasts a :class:`Command` (requests to add, ids to abort); every rank applies what
concerns its replica and steps its engine ``poll_steps`` times; replica leaders report finished
and aborted outputs; rank 0 hands each finished response to the scheduling policy, which says
what to abort and when the round is over. Requests are routed per request, round-robin over the
replicas, so every group is spread across them.
"""

from __future__ import annotations

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
    running_trace: list[tuple[float, int]]
    """(time, requests running over all replicas) at every poll: the bubble ratio's input."""
    start: float
    end: float
    num_preemptions: int


def sampling_seed(seed: int, rid: str) -> int:
    return random.Random(f"{seed}/{rid}").getrandbits(63)


def run_round(step: int, meshes: Meshes, engine: Engine, poll_steps: int, *, policy: Policy | None = None,
              prompt_ids=None, sampling: SamplingParams | None = None, seed: int = 0,
              on_progress=None) -> RoundResult | None:
    """Collective over all ranks; ``policy``, ``prompt_ids`` (dataset index -> token ids) and
    ``sampling`` matter on rank 0 only, which alone gets the :class:`RoundResult`."""
    leader = meshes.rank == 0
    start = time.time()
    base_preemptions = engine.stats().num_preemptions
    if leader:
        plan = policy.start_round(step)
        cmd = Command()
        owner: dict[str, tuple[int, int, int]] = {}  # request id -> (replica, prompt, response)
        for p in plan.prompts:
            ids = prompt_ids(p)
            for k in range(plan.num_responses):
                rid = request_id(step, p, k)
                replica = len(owner) % meshes.num_replicas
                owner[rid] = (replica, p, k)
                params = SamplingParams(**{**vars(sampling), "seed": sampling_seed(seed, rid)})
                cmd.add.append((replica, Request(id=rid, prompt_ids=ids, params=params)))
        outstanding = set(owner)
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
        done = False
        to_abort: list[str] = []
        for r in reports:
            for out in r.finished:
                outstanding.discard(out.id)
                tokens_done += len(out.token_ids)
                _, p, k = owner[out.id]
                decision = policy.on_finished(p, k, out)
                to_abort += decision.abort
                done |= decision.round_done
        outstanding -= set(to_abort)
        if done:
            to_abort += sorted(outstanding)
            outstanding.clear()
        cmd = Command(abort=[(owner[rid][0], rid) for rid in to_abort], final=done)
        if on_progress:
            on_progress(len(owner) - len(outstanding), tokens_done / (time.time() - start))
    if not leader:
        return None
    groups = policy.end_round(aborted)
    return RoundResult(kind=plan.kind, groups=groups, num_launched=len(owner), num_aborted=len(aborted),
                       running_trace=trace, start=start, end=time.time(),
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

