"""The loop of ``one_step_off`` (verl's one-step-off-policy recipe): a rollout pool generates the
next batch while a training pool trains this one.

Every rank runs :func:`run`. Each step starts at a :func:`boundary`, collective over all ranks:
batch k goes to the training pool, its last metrics to rank 0, and its new weights to the rollout
pool. Then :func:`rollout_pool_step` generates batch k+1 while :func:`train_pool_step` trains
batch k. What crosses from one boundary to the next is a :class:`Loop`.

Invariants:

- Batch k+1 is sampled by the weights of step k: staleness 1 (batch 0: staleness 0).
- A step's ``time/step`` is the training pool's, as verl times it.
- Stops and checkpoints happen only at a boundary. The batch generated but not trained is thrown
  away and generated again on resume, so no prompt is lost or trained twice.

Why: rollout and training overlap fully, at the price of one step of staleness, which
``train.rollout_correction`` weighs out. Step by step: ``docs/architecture.md`` (one_step_off loop).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

from rollpacker import preempt, watchdog
from rollpacker.job import Job
from rollpacker.loops.colocated import evaluate, generate
from rollpacker.metrics import Timer


@dataclass
class Pending:
    """Rank 0: a batch generated and scored, waiting for its training step."""

    step: int
    batch: tuple[list, int]
    """(samples, global normalizer), as :meth:`Trainer.step` takes them."""
    stats: dict[str, Any]
    """The round's metrics and its rollout and reward times."""
    policy_state: dict[str, Any] = field(default_factory=dict)
    """The policy's state before the batch was drawn: what a checkpoint at this step saves."""
    paused: float = 0.0
    """Seconds the rollout pool evaluated before generating the batch."""


@dataclass
class Loop:
    """What one_step_off carries from one step boundary to the next, on every rank."""

    step: int
    """The step whose batch crosses the next boundary."""
    weights_step: int
    """The optimizer steps the engines' weights hold."""
    pending: Pending | None = None
    """Rank 0: batch ``step``, generated and scored (None once no batch is left)."""
    previous: Pending | None = None
    """Rank 0: the batch trained last step; the next boundary logs its metrics."""
    batch: tuple[list, int] | None = None
    """Training pool: the batch it trains this step."""
    report: dict[str, float] | None = None
    """The training pool's metrics of its last step."""
    timer: Timer = field(default_factory=Timer)
    """Training pool: this step's weight sync and training."""
    arrived: float = 0.0
    """Training pool: when this step's batch arrived."""
    idle_since: float = field(default_factory=time.perf_counter)
    """Training pool: when it finished its last step."""


def run(job: Job) -> int:
    """Run ``one_step_off`` from ``job.start_step``; returns the number of steps taken (the
    engines then hold the final weights)."""
    preempt.install()  # again (run.main did), as colocated's: the engines are up
    loop = Loop(step=job.start_step, weights_step=job.start_step)
    rolls = job.meshes.rank in job.meshes.rollout_ranks
    if rolls:
        first_batch(job, loop)
    while handoff(job, loop):
        if rolls:
            rollout_pool_step(job, loop)
        else:
            train_pool_step(job, loop)
        loop.step += 1
    return loop.step


def first_batch(job: Job, loop: Loop) -> None:
    """Collective over the rollout pool: batch ``loop.step`` from the initial weights (evaluated
    first when due), while the training pool waits at the first boundary."""
    evaluated, loop.pending = _evaluate_and_generate(job, loop.step, loop.weights_step, evaluate_first=True)
    if loop.pending:
        loop.pending.stats |= evaluated


def handoff(job: Job, loop: Loop) -> bool:
    """:func:`boundary`, once every rank reached it: one pool waits there while the other generates a batch
    or trains on one, as long as the other works (``watchdog.waiting`` without a deadline)."""
    import torch.distributed as dist

    with watchdog.waiting("handoff"):
        dist.barrier(group=job.meshes.control)
    return boundary(job, loop)


def boundary(job: Job, loop: Loop) -> bool:
    """Collective over all ranks, between two steps:

    - batch ``loop.step`` goes to the training pool (the other rollout ranks only hear whether there is one);
    - the training pool's metrics of the last step go to rank 0, which logs that step;
    - the new weights go to the rollout pool;
    - a checkpoint is taken when due.

    Returns whether there is a batch to train, and no stop was asked for (then a checkpoint is taken).
    """
    cfg, meshes, rank0 = job.config, job.meshes, job.rank0
    more, stop = meshes.broadcast(loop.pending is not None if rank0 else None), preempt.requested_anywhere(meshes)
    watchdog.at_step(loop.step)  # a stop asked from now on comes after this step (dist.timeout_s after the first)
    if more and (rank0 or meshes.rank not in meshes.rollout_ranks):
        loop.batch = meshes.broadcast(loop.pending.batch if rank0 else None, meshes.handoff)
    loop.arrived = time.perf_counter()
    loop.report = meshes.broadcast(loop.report, src=meshes.train_ranks[0])
    if rank0 and loop.report:
        _log(job, loop.step - 1, loop.previous, loop.report)
    loop.timer = Timer()
    with loop.timer("weight_sync"):
        if loop.step > loop.weights_step:
            job.push_weights()
            loop.weights_step = loop.step
    due = cfg.checkpoint_every and loop.step % cfg.checkpoint_every == 0
    if loop.step > job.start_step and (due or (more and stop)):  # a stop: batch k is drawn again on resume
        job.save(loop.step, policy_state=loop.pending.policy_state if rank0 and loop.pending else None)
    return bool(more) and not stop


def rollout_pool_step(job: Job, loop: Loop) -> None:
    """Collective over the rollout pool: evaluate the weights just pushed when due (the first
    boundary's were evaluated before the first batch), then generate and score batch ``step + 1``."""
    pushed = loop.step > job.start_step
    evaluated, pending = _evaluate_and_generate(job, loop.step + 1, loop.weights_step, evaluate_first=pushed)
    loop.previous, loop.pending = loop.pending, pending
    if loop.previous:  # rank 0: the evaluation belongs to the step of these weights
        loop.previous.stats |= evaluated


def train_pool_step(job: Job, loop: Loop) -> None:
    """The training pool: one optimizer step on batch ``step``; its metrics wait for the next boundary."""
    with loop.timer("train"):
        stats = job.trainer.step(*loop.batch)
    loop.report = stats | loop.timer.pop() | {"time/wait_prev_gen": loop.arrived - loop.idle_since}
    loop.idle_since = time.perf_counter()


def _evaluate_and_generate(job: Job, step: int, weights_step: int,
                           evaluate_first: bool) -> tuple[dict[str, float], Pending | None]:
    """Collective over the rollout pool: with ``evaluate_first``, the evaluation of the weights of
    ``weights_step`` when that step is due for one (its metrics belong to step ``weights_step``);
    then, if rank 0 says round ``step`` is due, the round generated and scored, on rank 0."""
    cfg, meshes, ctl = job.config, job.meshes, job.controller
    timer = Timer()
    with timer("paused"):
        due = evaluate_first and cfg.eval_every and weights_step % cfg.eval_every == 0
        evaluated = evaluate(job, weights_step) if due else {}
    due = step < cfg.num_steps and not ctl.policy.done() if ctl else None
    if not meshes.broadcast(due, meshes.rollout_control):
        return evaluated, None
    plan = state = None
    if ctl:
        state = copy.deepcopy(ctl.policy.state_dict())
        ctl.policy.weights_step = weights_step
        plan = ctl.plan_round(step)
    batch, _, stats = generate(job, step, plan, timer)
    if not ctl:
        return evaluated, None
    times = timer.pop()
    return evaluated, Pending(step, batch, stats | {k: times[k] for k in ("time/rollout", "time/reward")}, state,
                              times["time/paused"])


def _log(job: Job, step: int, pending: Pending, report: dict[str, float]) -> None:
    """Rank 0: step ``step``'s metrics, its batch's and the training pool's. The evaluation that
    paused the rollout pool before generating the batch is taken off the training pool's wait."""
    stats = pending.stats | report
    stats["time/wait_prev_gen"] = max(0.0, report["time/wait_prev_gen"] - pending.paused)
    stats["time/step"] = stats["time/wait_prev_gen"] + report["time/weight_sync"] + report["time/train"]
    job.controller.metrics.log(step, stats)
    job.controller.display.end_step(step, stats)
