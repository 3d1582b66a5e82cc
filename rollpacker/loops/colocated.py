"""The colocated loop: every rank rolls out and trains, one RL step after another.

:func:`rl_step` is the paper's workflow (Fig. 1a): the policy plans a round, the engines roll it
out while each response is scored as it finishes, the trainer takes one optimizer step, and the
new weights are pushed into the engines in-process. The parallelism planner picks the round's
rollout TP first; the stream trainer (and RolloutPipe) joins the round through its hooks, trains
under rollout on the ranks it frees and accounts for it after the step
(:meth:`~rollpacker.train.stream.StreamTrainer.after_step`).
:func:`generate` and :func:`evaluate` are shared with one_step_off's loop.
"""

from __future__ import annotations

from typing import Any

from rollpacker import preempt, watchdog
from rollpacker.exchange import Freed, RoundResult, run_round
from rollpacker.job import Job
from rollpacker.metrics import Timer
from rollpacker.schedule.base import RoundPlan


def run(job: Job) -> int:
    """Steps from ``job.start_step`` until ``num_steps`` or the data runs out; returns the step reached."""
    cfg, ctl = job.config, job.controller
    preempt.install()  # again (run.main did): SIGUSR1/SIGTERM/SIGINT stop after the current step, saved
    step = job.start_step
    if ctl and step:  # resumed: env.warm opens the first round's environments, as the run before would have
        ctl.warm(step)
    while step < cfg.num_steps:
        watchdog.at_step(step)  # dist.timeout_s once the first step is done
        done = job.meshes.broadcast(ctl.policy.done() if ctl else None)
        if done or preempt.requested_anywhere(job.meshes):
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
    plan = ctl.plan_round(step) if ctl else None  # the policy plans the round
    if job.config.plan.enabled:
        with timer("tp_switch"):  # at the planner's TP for this kind of round
            stats |= job.switch_tp(meshes.broadcast(ctl.planner.tp_for(plan.kind) if ctl else None))
    batch, result, round_stats = generate(job, step, plan, timer)  # roll out and score
    stats |= round_stats
    if ctl:  # env.warm: the next round's environments reset while this step trains
        ctl.warm(step + 1)
    if not job.config.train.skip:
        train_step(job, timer, batch, stats)  # train, then sync the engines' weights
    if ctl:
        times = timer.pop()
        times["time/step"] = sum(times.values())
        ctl.end_step(step, result, stats | times)


def train_step(job: Job, timer: Timer, batch, stats: dict[str, Any]) -> None:
    """Train on the round's batch (the freed ranks' stream training accounted for) and push the new
    weights into the engines (collective)."""
    meshes = job.meshes
    offload = meshes.device.type == "cuda" and not job.engine.released  # a released engine stays released
    if offload:  # GPU: the engines' memory goes to the trainer while it trains
        job.engine.release_memory()
    with timer("train"):  # one optimizer step on what was not streamed, normalized by global counts
        samples, normalizer = meshes.broadcast(batch)
        stats |= job.trainer.step(samples, normalizer)
    if job.stream:  # the training the freed ranks did under rollout
        stats |= job.stream.after_step(timer.times["time/train"])
    with timer("weight_sync"):  # push the new weights into the engines, in-process
        job.push_weights()
    if offload:
        job.engine.resume_memory()


def generate(job: Job, step: int, plan: RoundPlan | None, timer: Timer
             ) -> tuple[tuple[list, int] | None, RoundResult | None, dict[str, Any]]:
    """Roll out round ``plan`` of ``step`` and score it: collective over the ranks rolling out
    (freed ranks stream-train meanwhile). On rank 0: the batch to train
    (:meth:`~rollpacker.controller.Controller.make_batch`), the round's result and its metrics
    (:meth:`~rollpacker.controller.Controller.round_stats`). ``timer`` gets the rollout time and the reward time."""
    ctl, stream = job.controller, job.stream
    leader = ctl.train_round(step, plan, stream.round_hooks() if stream else None) if ctl else None
    with timer("rollout"):  # the engines generate the round (freed ranks stream-train)
        result = run_round(job.meshes, job.engine, job.config.rollout.poll_steps, leader)
        if isinstance(result, Freed):  # it waits for rank 0's sends through the rest of the rollout
            with watchdog.waiting("serve"):
                job.stream.serve_freed(job.engine)
    if not ctl:
        return None, None, {}
    with timer("reward"):  # the batch of the kept groups (responses were scored as they finished)
        ctl.retire_solved(result)
        batch, round_stats = ctl.make_batch(result), ctl.round_stats(result)
        ctl.write_samples(step, result)
    timer.move(result.reward_exposed_s, "rollout", "reward")  # the wait for the last scores is reward time
    return batch, result, round_stats


def evaluate(job: Job, step: int) -> dict[str, float]:
    """The held-out metrics (:func:`~rollpacker.schedule.eval.eval_metrics`; an episode's step infos:
    :func:`~rollpacker.env.info.info_metrics`; with environments, ``eval/env_errors``; the reward functions'
    and the environments' counts under ``eval/``: ``eval/reward/NAME``, ``eval/reward/errors``,
    ``eval/env/close_errors``), through the same engines: ``eval.n`` responses per prompt at ``eval.temperature``
    (greedy, one each by default)."""
    from rollpacker.env.info import info_metrics
    from rollpacker.schedule.eval import eval_metrics, eval_rewards

    ctl = job.controller
    job.engine.resume_memory()  # a pipe train-pool rank's engine is released between its rounds
    result = run_round(job.meshes, job.engine, job.config.rollout.poll_steps, ctl.eval_round(step) if ctl else None)
    if not ctl:
        return {}
    solved = [[ctl.solved(o, r) for o, r in zip(g.outputs, g.rewards)] for g in result.groups]  # before write_samples
    ctl.write_samples(step, result, ctl.eval_rows, f"eval_step_{step}")
    ctl.check_environments(result, f"of the evaluation before step {step}")
    counts = ctl.rewards.take_metrics(f"the evaluation before step {step}", held_out=True) | ctl.envs.take_metrics()
    counts.pop("reward/seconds_total")  # not the next step's reward time
    counts.pop("env/warm_opens", None)  # training's opens alone are warmed
    sources = [ctl.eval_rows[g.prompt].get("data_source") for g in result.groups]
    outputs = [(o, source) for g, source in zip(result.groups, sources) for o in g.outputs]
    failed = {"eval/env_errors": result.hook_metrics["env/errors"]} if "env/errors" in result.hook_metrics else {}
    return (eval_metrics([eval_rewards(g) for g in result.groups], solved, sources) | failed
            | info_metrics([o for o, _ in outputs], "eval/", [source for _, source in outputs])
            | {f"eval/{k}": v for k, v in counts.items()})
