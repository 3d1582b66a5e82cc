"""The colocated loop: every rank rolls out and trains, one RL step after another.

:func:`rl_step` is the paper's workflow (Fig. 1a): the policy plans a round, the engines roll it
out while each response is scored as it finishes, the trainer takes one optimizer step, and the
new weights are pushed into the engines in-process. The parallelism planner picks the round's
rollout TP first; the stream trainer (and RolloutPipe) trains under rollout on the ranks it frees
and accounts for it after the step (:meth:`~rollpacker.train.stream.StreamTrainer.after_step`).
:func:`generate` and :func:`evaluate` are shared with one_step_off's loop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from rollpacker import preempt, watchdog
from rollpacker.job import Job
from rollpacker.metrics import Timer
from rollpacker.rollout.engine import SamplingParams
from rollpacker.round import FREED, RoundResult, run_round
from rollpacker.schedule.base import Round
from rollpacker.schedule.sync import SyncPolicy


def run(job: Job) -> int:
    """Steps from ``job.start_step`` until ``num_steps`` or the data runs out; returns the step reached."""
    cfg, ctl = job.config, job.controller
    preempt.install()  # SIGUSR1/SIGTERM (Slurm): stop after the current step, saved
    step = job.start_step
    while step < cfg.num_steps:
        watchdog.at_step(step)  # dist.timeout_s once the first step is done
        done, stop = job.meshes.broadcast((ctl.policy.done(), preempt.requested()) if ctl else None)
        if done or stop:
            break
        due = cfg.eval_every and step % cfg.eval_every == 0
        rl_step(job, step, evaluate(job, step) if due else {})
        step += 1
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            job.save(step)
    return step


def rl_step(job: Job, step: int, stats: dict[str, Any]) -> None:
    """One RL step (collective); rank 0 logs its metrics, ``stats`` included."""
    timer, ctl, meshes = Timer(), job.controller, job.meshes
    plan = ctl.policy.start_round(step) if ctl else None  # the policy plans the round
    if job.config.plan.enabled:
        with timer("tp_switch"):  # at the planner's TP for this kind of round
            stats |= job.switch_tp(meshes.broadcast(ctl.planner.tp_for(plan.kind) if ctl else None))
    batch, result, round_stats = generate(job, step, plan, timer)  # roll out and score
    stats |= round_stats
    if not job.config.train.skip:
        train_step(job, timer, batch, stats, plan, result)  # train, then sync the engines' weights
    if ctl:
        times = timer.pop()
        times["time/step"] = sum(times.values())
        ctl.end_step(step, plan.kind, result.num_launched, stats | times)


def train_step(job: Job, timer: Timer, batch, stats: dict[str, Any], plan: Round | None,
               result: RoundResult | None) -> None:
    """Train on the round's batch (the freed ranks' stream training accounted for) and push the new
    weights into the engines (collective)."""
    meshes, ctl = job.meshes, job.controller
    offload = meshes.device.type == "cuda" and not job.engine.released  # a released engine stays released
    if offload:  # GPU: the engines' memory goes to the trainer while it trains
        job.engine.release_memory()
    with timer("train"):  # one optimizer step on what was not streamed, normalized by global counts
        samples, normalizer = meshes.broadcast(batch)
        stats |= job.trainer.step(samples, normalizer)
    if job.stream:  # the training the freed ranks did under rollout
        stats |= job.stream.after_step(plan.kind if ctl else "", timer.times["time/train"],
                                       time.time() - result.start if ctl else 0.0,
                                       bool(stats.get("stream/scaled_down")))
    with timer("weight_sync"):  # push the new weights into the engines, in-process
        job.engine.update_weights(job.trainer.model.named_parameters())
    if offload:
        job.engine.resume_memory()


def generate(job: Job, step: int, plan: Round | None, timer: Timer
             ) -> tuple[tuple[list, int] | None, RoundResult | None, dict[str, Any]]:
    """Roll out round ``plan`` of ``step`` and score it: collective over the ranks rolling out
    (freed ranks stream-train meanwhile). On rank 0: the batch to train
    (:meth:`~rollpacker.controller.Controller.make_batch`), the round's result and its metrics;
    ``timer`` gets the rollout time and the reward time (the wait for rewards after the last
    response finished)."""
    cfg, ctl = job.config, job.controller
    if ctl:
        ctl.display.start_step(step, cfg.rollout.num_prompts * cfg.rollout.group_size)
    with timer("rollout"):  # the engines generate the round (freed ranks stream-train)
        result = run_round(step, job.meshes, job.engine, cfg.rollout.poll_steps, stream=job.stream, **(dict(
            policy=ctl.policy, plan=plan, rows=ctl.rows, prompt_ids=lambda p: ctl.encode_prompt(ctl.rows[p]),
            rewards=ctl.rewards, sampling=sampling_params(cfg), seed=cfg.seed, on_progress=ctl.display.update,
            lengths=ctl.replay,
            make_samples=ctl.group_samples) if ctl else {}))
        if result is FREED:
            job.stream.serve_freed(job.engine)
    if not ctl:
        return None, None, {}
    with timer("reward"):  # the batch of the kept groups (responses were scored as they finished)
        batch, round_stats = ctl.make_batch(result), ctl.round_stats(result)
    # the wait for rewards after the last response finished is reward time, not rollout
    timer.times["time/rollout"] -= round_stats["time/reward_exposed"]
    timer.times["time/reward"] += round_stats["time/reward_exposed"]
    return batch, result, round_stats


def sampling_params(cfg) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def evaluate(job: Job, step: int) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts, through the same engines: one response each."""
    ctl = job.controller
    job.engine.resume_memory()  # a pipe train-pool rank's engine is released between its rounds
    kwargs = {}
    if ctl:
        rows = ctl.eval_rows
        kwargs = dict(policy=SyncPolicy(_AllRows(len(rows)), len(rows), 1), rows=rows,
                      prompt_ids=lambda p: ctl.encode_prompt(rows[p]), rewards=ctl.rewards,
                      sampling=dataclasses.replace(sampling_params(job.config), temperature=0.0))
    result = run_round(step, job.meshes, job.engine, job.config.rollout.poll_steps, **kwargs)
    if not ctl:
        return {}
    ctl.rewards.take_seconds()  # held-out scoring is not the next step's reward time
    rewards = [g.rewards[0] or 0.0 for g in result.groups]
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards)}


class _AllRows:
    """A sampler that hands out every row once, in order (evaluation)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def draw(self, n: int) -> list[tuple[int, int]]:
        return [(0, i) for i in range(n)]
