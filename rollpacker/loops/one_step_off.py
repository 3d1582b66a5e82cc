"""The loop of ``one_step_off`` (verl's one-step-off-policy recipe): a rollout pool generates the
next batch while a training pool trains this one.

The first ``schedule.rollout_ranks`` ranks (rank 0, the controller, among them) hold the engines;
the others hold the FSDP2 trainer, sharded over them alone (``Meshes.train``). Every rank runs
:func:`run`. Step k, from the step boundary:

1. **Boundary** (collective over all ranks): rank 0 sends batch k (generated during step k−1,
   scored, with its advantages) to the training pool (``Meshes.handoff``: the other rollout ranks
   only hear whether there is one); the training pool's first rank sends the
   metrics of its step k−1 to rank 0, which logs that step; the training pool broadcasts the
   weights of its k optimizer steps to the rollout pool over the data-plane group
   (``Meshes.weights``: NCCL on GPU, gloo on CPU), straight from its FSDP2 parameters.
2. **Both pools at once**: the rollout pool evaluates when due and generates batch k+1 with those
   weights, so batch k+1 is trained one step later than its weights (staleness 1,
   ``OneStepOffPolicy``); the training pool takes step k on batch k and then waits at the next
   boundary for batch k+1 (``time/wait_prev_gen``, verl's name).

Batch 0 is generated before the first boundary with the initial weights (staleness 0), while the
training pool waits. A step's ``time/step`` is the training pool's: its wait for the batch, the
weight broadcast and its optimizer step, which is what verl times (``step ≈ wait_prev_gen +
update_actor``); ``time/rollout`` and ``time/reward`` are those of the step's batch, spent during
the step before. Evaluation pauses the rollout pool between two batches; as in the colocated loop it
is not step time, so it is taken off the wait it causes.

How it differs from verl: one SPMD program, no Ray; the weights go out once per step at the
boundary (verl syncs before launching each generation, the same point); the loss weights each
token by the trainer's log-prob over the engine's, which sampled it (``train.rollout_correction``).

Checkpoints are taken at a boundary: the training pool's weights and optimizer after k steps, and
the policy's state from before batch k was drawn. Batch k, generated but not trained, is thrown
away; a resumed run generates it again with the checkpoint's weights (staleness 0 for that batch),
so no prompt is lost or trained twice.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rollpacker.job import Job
from rollpacker.loops.colocated import evaluate, generate
from rollpacker.metrics import Timer
from rollpacker.model import empty_model, engine_dtype, read_args


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


def run(job: Job) -> int:
    """Run ``one_step_off`` from ``job.start_step``; returns the number of steps taken (the
    engines then hold the final weights)."""
    cfg, meshes = job.config, job.meshes
    rank0, rolls = meshes.rank == 0, meshes.rank in meshes.rollout_ranks
    lead = meshes.train_ranks[0]
    step = weights_step = job.start_step
    check_weights(job)
    if job.start_step:  # resumed: the engines get the checkpoint's weights before batch start_step
        push_weights(job)
    report, idle_since, previous, pending = None, time.perf_counter(), None, None
    if rolls:
        evaluated, pending = _evaluate_and_generate(job, step, weights_step, evaluate_first=True)
        if pending:
            pending.stats |= evaluated
    while True:
        # 1. the boundary: batch `step` to the training pool, the last step's metrics to rank 0, weights out
        more = meshes.broadcast(pending is not None if rank0 else None)
        batch = None
        if more and (rank0 or not rolls):
            batch = meshes.broadcast(pending.batch if rank0 else None, meshes.handoff)
        arrived = time.perf_counter()
        report = meshes.broadcast(report, src=lead)
        if rank0 and report:
            _log(job, step - 1, previous, report)
        timer = Timer()
        with timer("weight_sync"):
            if step > weights_step:
                push_weights(job)
                weights_step = step
        if cfg.checkpoint_every and step > job.start_step and step % cfg.checkpoint_every == 0:
            job.save(step, policy_state=pending.policy_state if rank0 and pending else None)
        if not more:
            return step
        # 2. both pools at once: the rollout pool generates batch step+1, the training pool trains batch step
        if rolls:
            previous, pushed = pending, step > job.start_step  # the first boundary's weights were evaluated
            evaluated, pending = _evaluate_and_generate(job, step + 1, weights_step, evaluate_first=pushed)
            if rank0:
                previous.stats |= evaluated
        else:
            with timer("train"):
                stats = job.trainer.step(*batch)
            report = stats | timer.pop() | {"time/wait_prev_gen": arrived - idle_since}
            idle_since = time.perf_counter()
        step += 1


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
        plan = ctl.policy.start_round(step)
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
    job.controller.display.end_step(stats)


def check_weights(job: Job) -> None:
    """Collective, once: the training pool's parameters must be the engines' (names and shapes, in
    order), since :func:`push_weights` sends them by position."""
    meshes = job.meshes
    names = _parameter_shapes(job)
    theirs = meshes.broadcast(names, src=meshes.train_ranks[0])
    if theirs != names:
        raise RuntimeError(f"one_step_off: the trainer's parameters {theirs} are not the engine's {names}")


def push_weights(job: Job) -> None:
    """Collective over all ranks: every parameter of the training pool's model, gathered whole from
    its FSDP2 shards (``full_tensor``, collective over the training pool), is broadcast by the
    pool's first rank to the rollout pool over ``Meshes.weights`` in the engines' dtype, where each
    engine keeps its TP slice."""
    meshes = job.meshes
    lead, dtype = meshes.train_ranks[0], engine_dtype(job.config.model.dtype, meshes.device)
    if job.trainer is not None:
        for _, param in job.trainer.model.named_parameters():
            full = param.full_tensor()
            if meshes.rank == lead:
                dist.broadcast(full.to(dtype).contiguous(), lead, group=meshes.weights)
    else:  # one stream into the engine: vLLM reloads layer by layer, all of a layer's tensors at once
        def received():
            for name, shape in _parameter_shapes(job):
                buffer = torch.empty(shape, dtype=dtype, device=meshes.device)
                dist.broadcast(buffer, lead, group=meshes.weights)
                yield name, buffer

        job.engine.update_weights(received())


def _parameter_shapes(job: Job) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameter names and shapes, in order: the trainer's, or on the rollout pool those
    of the model directory's architecture (any engine)."""
    model = job.trainer.model if job.trainer is not None else empty_model(read_args(job.model_dir), "meta",
                                                                             torch.float32)
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]
