"""Entry point: ``torchrun --nproc_per_node=N -m rollpacker.run [--preset NAME] [--section.field value …]``.

``python -m rollpacker.run`` is the same program at world size 1. The config is parsed before
torch is imported, so ``--help`` and config errors come back at once.

Each step is the paper's workflow (Fig. 1a): the policy plans a round, the engines roll it out,
responses are scored, the trainer takes one optimizer step, and the new weights are pushed into
the engines in-process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollpacker.config import Config, parse

logger = logging.getLogger("rollpacker")


@dataclass
class Job:
    config: Config
    meshes: Any
    engine: Any
    trainer: Any
    policy: Any = None
    """Rank 0 only, like everything below."""
    rows: list[dict] | None = None
    eval_rows: list[dict] | None = None
    tokenizer: Any = None
    rewards: Any = None
    """The reward scheduler (rollpacker.reward.scheduler)."""
    metrics: Any = None
    display: Any = None
    start_step: int = 0
    stream: Any = None
    """The stream trainer (rollpacker.train.stream), on every rank, when stream.enabled or schedule.pipe."""
    planner: Any = None
    """The parallelism planner (rollpacker.plan.planner), rank 0 only, when plan.enabled, with the
    profile it reads and the mean prompt length of the data."""
    profile: dict | None = None
    prompt_len: int = 0


def rl_step(job: Job, step: int, stats: dict[str, Any]) -> None:
    from rollpacker.metrics import Timer

    timer, rank0, cfg = Timer(), job.meshes.rank == 0, job.config
    plan = job.policy.start_round(step) if rank0 else None  # the policy plans the round
    if cfg.plan.enabled:
        with timer("tp_switch"):  # the planner's TP for this kind of round
            stats |= switch_tp(job, job.meshes.broadcast(job.planner.tp_for(plan.kind) if rank0 else None))
    batch, result, round_stats = generate(job, step, plan, timer)
    stats |= round_stats
    if rank0 and job.planner:  # the preemption heuristic picks the next TP of this kind of round
        observe_preemptions(job, step, plan.kind, result.num_launched, round_stats)
    with timer("train"):  # one optimizer step on what was not streamed, normalized by global counts
        samples, normalizer = job.meshes.broadcast(batch)
        stats |= job.trainer.step(samples, normalizer)
    if job.stream:
        hidden = job.meshes.gather(job.stream.seconds)
        if rank0:
            stats["stream/train_seconds"] = max(hidden)  # train time hidden under rollout
            saved = max(hidden) * len(job.stream.ranks) / job.meshes.world_size  # taken off the final step
            job.stream.scale_down.learn(plan.kind, timer.times["time/train"] + saved,
                                        saved if stats.get("stream/scaled_down") else None)
            if cfg.schedule.pipe:
                stats |= pipe_stats(time.time() - result.start, max(hidden), timer.times["time/train"])
    with timer("weight_sync"):  # push the new weights into the engines, in-process
        job.engine.update_weights(job.trainer.model.named_parameters())
    if rank0:
        times = timer.pop()
        times["time/step"] = sum(times.values())
        stats |= times
        job.metrics.log(step, stats)
        job.display.end_step(stats)


def generate(job: Job, step: int, plan, timer) -> tuple[Any, Any, dict[str, Any]]:
    """Roll out round ``plan`` of ``step`` and score it: collective over the ranks rolling out
    (freed ranks stream-train meanwhile). On rank 0: the batch to train (:func:`score`), the
    :class:`~rollpacker.controller.RoundResult` and the round's metrics; ``timer`` gets the
    rollout time and the reward time (the wait for rewards after the last response finished)."""
    from rollpacker.controller import run_round

    cfg, rank0 = job.config, job.meshes.rank == 0
    if rank0:
        job.display.start_step(step, cfg.rollout.num_prompts * cfg.rollout.group_size)
    with timer("rollout"):  # the engines generate the round (freed ranks stream-train)
        result = run_round(step, job.meshes, job.engine, cfg.rollout.poll_steps, policy=job.policy,
                           rows=job.rows, prompt_ids=lambda p: encode_prompt(job, job.rows[p]), rewards=job.rewards,
                           sampling=sampling_params(cfg), seed=cfg.seed,
                           on_progress=job.display.update if rank0 else None, stream=job.stream,
                           make_samples=lambda g: group_samples(job, g), plan=plan)
    with timer("reward"):  # advantages of the kept groups (rank 0; responses were scored as they finished)
        batch, round_stats = score(job, result) if rank0 else (None, {})
    if rank0:  # the wait for rewards after the last response finished is reward time, not rollout
        timer.times["time/rollout"] -= round_stats["time/reward_exposed"]
        timer.times["time/reward"] += round_stats["time/reward_exposed"]
    return batch, result, round_stats


def pipe_stats(rollout_to_train_end: float, hidden: float, final_train: float) -> dict[str, float]:
    """RolloutPipe's metrics: ``pipe/rollout_to_train_end``, seconds from the round's start (rollout
    start) to the end of the optimizer step; ``pipe/trainer_wait_ratio``, the fraction of that span
    the train pool was not training: neither on streamed groups (``hidden``, its busiest rank) nor in
    the final step (``final_train``, which every rank joins)."""
    busy = min(hidden + final_train, rollout_to_train_end)
    return {"pipe/rollout_to_train_end": rollout_to_train_end,
            "pipe/trainer_wait_ratio": 1.0 - busy / rollout_to_train_end if rollout_to_train_end > 0 else 0.0}


def sampling_params(cfg: Config):
    from rollpacker.rollout.engine import SamplingParams

    r = cfg.rollout
    return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def evaluate(job: Job, step: int) -> dict[str, float]:
    """Greedy accuracy on the held-out prompts, through the same engines: one response each."""
    from rollpacker.controller import run_round
    from rollpacker.schedule.sync import SyncPolicy

    cfg, rank0 = job.config, job.meshes.rank == 0
    policy = SyncPolicy(_AllRows(len(job.eval_rows)), len(job.eval_rows), 1) if rank0 else None
    greedy = dataclasses.replace(sampling_params(cfg), temperature=0.0)
    job.engine.resume_memory()  # a pipe train-pool rank's engine is released between its rounds
    result = run_round(step, job.meshes, job.engine, cfg.rollout.poll_steps, policy=policy,
                       rows=job.eval_rows, prompt_ids=lambda p: encode_prompt(job, job.eval_rows[p]),
                       rewards=job.rewards, sampling=greedy)
    if not rank0:
        return {}
    job.rewards.take_seconds()  # held-out scoring is not the next step's reward time
    rewards = [g.rewards[0] or 0.0 for g in result.groups]
    return {"eval/accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
            "eval/reward_mean": sum(rewards) / len(rewards)}


class _AllRows:
    """A sampler that hands out every row once, in order (evaluation)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows

    def draw(self, n: int) -> list[tuple[int, int]]:
        return [(0, i) for i in range(n)]


def encode_prompt(job: Job, row: dict, check: bool = True) -> list[int]:
    tok = job.tokenizer
    if job.config.model.chat_template:
        ids = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                      tokenize=True)
    else:
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
    limit = job.engine.max_model_len
    if check and (not ids or len(ids) >= limit):
        raise ValueError(f"data row {row['id']!r}: its prompt is {len(ids)} tokens; the context length is {limit}")
    return ids


def trained_rewards(job: Job, group) -> list[tuple[Any, float]]:
    """A scored group's ``(output, reward)`` pairs to train on: a reward_error sample is trained
    with reward 0 or dropped (``reward.on_error``)."""
    zero = job.config.reward.on_error == "zero"
    return [(o, r or 0.0) for o, r in zip(group.outputs, group.rewards) if r is not None or zero]


def group_samples(job: Job, group) -> list:
    """The trainer samples of a scored group (:func:`trained_rewards`), with their GRPO advantages."""
    import torch

    from rollpacker.train.losses import group_advantages
    from rollpacker.train.trainer import Sample

    pairs = trained_rewards(job, group)
    if not pairs:
        return []
    adv = group_advantages(torch.tensor([r for _, r in pairs])[None], job.config.train.scale_adv_by_std)[0]
    return [Sample(o.prompt_ids, o.token_ids, float(a), o.logprobs) for (o, _), a in zip(pairs, adv.tolist())]


def score(job: Job, result) -> tuple[tuple[list, int], dict[str, Any]]:
    """The samples left to train (those the stream trainer has not taken), the step's global
    normalizer (over every trained sample), and the round's metrics."""
    import torch

    from rollpacker.metrics import bubble_ratio, length_stats

    cfg = job.config
    errors = sum(r is None for g in result.groups for r in g.rewards)
    per_group = [(g, group_samples(job, g)) for g in result.groups]
    every = [s for _, group in per_group for s in group]
    samples = [s for g, group in per_group if not g.streamed for s in group]
    if cfg.train.advantage_norm == "batch" and len(samples) > 1:  # REINFORCE++: whiten over the batch
        adv = torch.tensor([s.advantage for s in samples])
        for s, a in zip(samples, ((adv - adv.mean()) / (adv.std() + 1e-6)).tolist()):
            s.advantage = a
    normalizer = sum(len(s.response_ids) for s in every) if cfg.train.aggregation == "token" else len(every)
    reward_t = torch.tensor([r for g in result.groups for _, r in trained_rewards(job, g)])
    lengths = [len(s.response_ids) for s in every]
    rollout_time = result.end - result.start
    trace = [(result.start, result.num_launched), *result.running_trace]
    return (samples, normalizer), {
        "sched/round_kind": result.kind,
        "sched/trained_prompts": len(result.groups),
        "sched/aborted_responses": result.num_aborted,
        "rollout/wasted_tokens": result.generated_tokens - sum(lengths),
        **job.policy.stats(),
        **result.stream,
        "reward/mean": reward_t.mean().item() if every else 0.0,
        "reward/accuracy": (reward_t >= 1.0).float().mean().item() if every else 0.0,
        "reward/errors": errors,
        "reward/seconds_total": job.rewards.take_seconds(),
        "time/reward_exposed": result.end - result.last_finish,
        "rollout/bubble_ratio": bubble_ratio(trace, result.num_launched, result.end),
        "rollout/tokens_per_s": result.generated_tokens / rollout_time,
        "rollout/preemptions": result.num_preemptions,
        "rollout/response_lengths": lengths,
        **length_stats(lengths),
    }


def build(config: Config) -> Job:
    import torch

    from rollpacker import checkpoint, watchdog
    from rollpacker.dist import build_meshes, init_distributed
    from rollpacker.model import load_model
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.train.trainer import Trainer

    init_distributed()
    world = torch.distributed.get_world_size()
    config.check_world(world)
    streaming = config.stream.enabled or config.schedule.pipe
    meshes = build_meshes(config.rollout.tp, config.train.train_shard_size, stream=streaming,
                          rollout_ranks=config.rollout_ranks(world))
    watchdog.start(config.dist)  # faults: collective timeouts, heartbeats, a timeout names the silent ranks
    torch.manual_seed(config.seed)
    path = model_path(config)
    engine = trainer = None  # disaggregated pools (one_step_off): engines on the rollout pool, the trainer on the rest
    if meshes.rank in meshes.rollout_ranks:
        engine = TorchEngine(load_model(path, meshes.device, engine_dtype(config, meshes.device)), config.engine,
                             meshes.rollout_tp)
    if meshes.rank in meshes.train_ranks:
        reference = load_model(path, meshes.device, torch.float32) if config.train.kl_coef else None
        trainer = Trainer(load_model(path, meshes.device, torch.float32), config.train, meshes.train,
                          temperature=config.rollout.temperature or 1.0, reference=reference,
                          group=meshes.train_group)
    job = Job(config=config, meshes=meshes, engine=engine, trainer=trainer)
    if streaming:
        job.stream = make_stream(job)
    if meshes.rank == 0:
        build_controller(job, path)
    if config.plan.enabled:
        build_planner(job, path)
    if config.resume:
        state = checkpoint.load(Path(config.resume), trainer)
        job.start_step = state["step"]
        if job.meshes.rank == 0:
            job.policy.load_state_dict({k: v for k, v in state["policy"].items() if k != "name"})
            job.rewards.load_state_dict(state["rewards"])
            if job.planner and "planner" in state:  # a checkpoint saved without the planner: start afresh
                job.planner.load_state_dict(state["planner"])
        if not meshes.disaggregated:  # else the training pool pushes them (rollpacker.overlap)
            job.engine.update_weights(trainer.model.named_parameters())
    return job


def engine_dtype(config: Config, device):
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(
        config.model.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)


def make_stream(job: Job):
    from rollpacker.train.stream import StreamTrainer

    cfg = job.config
    return StreamTrainer(cfg.stream, job.trainer, job.meshes, max_new_tokens=cfg.rollout.max_new_tokens,
                         kv_capacity_tokens=job.engine.num_blocks * cfg.engine.block_size, pipe=cfg.schedule.pipe)


def build_planner(job: Job, path: Path) -> None:
    """The profile (measured now if none is cached for this setup), the planner on rank 0, and the
    engines rebuilt at its initial TP (collective)."""
    from rollpacker.plan.planner import Planner, best_tp, candidate_tps
    from rollpacker.plan.profile import obtain

    cfg, meshes = job.config, job.meshes
    profile = obtain(cfg, meshes, path, engine_dtype(cfg, meshes.device))
    if meshes.rank == 0:
        node = int(os.environ.get("LOCAL_WORLD_SIZE", meshes.world_size))
        candidates = candidate_tps(meshes.world_size, job.trainer.model.args.num_kv_heads, cfg.plan.max_tp or node)
        job.profile = profile
        job.prompt_len = round(sum(len(encode_prompt(job, r)) for r in job.rows[:64]) / len(job.rows[:64]))
        initial, estimates = best_tp(profile, candidates, cfg.rollout.num_prompts * cfg.rollout.group_size,
                                     job.prompt_len, cfg.rollout.max_new_tokens)
        initial = cfg.plan.initial_tp or initial
        logger.info("plan: estimated round without tail batching (s) by TP: %s; starting at TP %d (usable: %s)",
                    {t: round(v, 3) for t, v in estimates.items()}, initial, candidates)
        job.planner = Planner(cfg.plan, candidates, initial)
    switch_tp(job, meshes.broadcast(job.planner.initial if job.planner else None))


def observe_preemptions(job: Job, step: int, kind: str, num_requests: int, round_stats: dict[str, Any]) -> None:
    """Rank 0: the planner takes the round's preemptions, with the profile's estimate of the same
    round (its requests, the data's prompt length, its mean response length) at each TP."""
    from rollpacker.plan.planner import round_seconds

    lengths = round_stats["rollout/response_lengths"] or [1]
    why = job.planner.observe(kind, round_stats["rollout/preemptions"], lambda tp: round_seconds(
        job.profile["tp"][str(tp)], job.meshes.world_size, tp, num_requests, job.prompt_len,
        round(sum(lengths) / len(lengths))))
    if why:
        logger.info("plan: after step %d: %s", step, why)


def switch_tp(job: Job, tp: int) -> dict[str, float]:
    """Rebuild the rollout engines on TP-``tp`` sub-meshes, at a step boundary (collective), when
    ``tp`` is not the current TP: the old engine's memory is freed first; the new one is loaded from
    the trainer's live parameters (resharded in memory, not read from disk)."""
    import gc

    import torch

    from rollpacker.model import empty_model
    from rollpacker.rollout.torch_engine import TorchEngine

    stats = {"plan/rollout_tp": tp, "plan/switched": float(tp != job.meshes.rollout_tp.size())}
    if not stats["plan/switched"]:
        return stats
    job.engine.release_memory()
    job.engine = None
    gc.collect()
    if job.meshes.device.type == "cuda":
        torch.cuda.empty_cache()
    job.meshes.set_rollout_tp(tp)
    model = empty_model(job.trainer.model.args, job.meshes.device, engine_dtype(job.config, job.meshes.device))
    job.engine = TorchEngine(model, job.config.engine, job.meshes.rollout_tp)
    job.engine.update_weights(job.trainer.model.named_parameters())
    if job.stream:  # its replicas changed; the length histories carry over
        histories, job.stream = job.stream.scale_down.histories, make_stream(job)
        job.stream.scale_down.histories = histories
    return stats


def build_controller(job: Job, path: Path) -> None:
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import PromptSampler, fit_rows, load_eval_rows, load_rows
    from rollpacker.metrics import LiveDisplay, MetricsLogger
    from rollpacker.reward.scheduler import RewardScheduler
    cfg = job.config
    job.rows = load_rows(cfg.data)
    job.eval_rows = load_eval_rows(cfg.data) if cfg.eval_every else None
    job.tokenizer = AutoTokenizer.from_pretrained(path)
    if job.engine is not None:  # faults: prompts the engines would reject are left out and counted
        fit = dict(encode=lambda r: encode_prompt(job, r, check=False), max_model_len=job.engine.max_model_len,
                   kv_tokens=job.engine.num_blocks * cfg.engine.block_size, max_new_tokens=cfg.rollout.max_new_tokens)
        job.rows = fit_rows(job.rows, **fit)
        job.eval_rows = job.eval_rows and fit_rows(job.eval_rows, **fit)
    job.rewards = RewardScheduler(cfg.reward, cfg.data.reward,
                                  lambda ids: job.tokenizer.decode(ids, skip_special_tokens=True), job.meshes.device)
    job.policy = make_policy(cfg, PromptSampler(len(job.rows), cfg.data.shuffle_seed))
    job.metrics = MetricsLogger(Path(cfg.run_dir), cfg.metrics, dataclasses.asdict(cfg))
    job.display = LiveDisplay(cfg.metrics.live)


def make_policy(cfg: Config, sampler):
    from rollpacker.schedule.one_step_off import OneStepOffPolicy
    from rollpacker.schedule.sorted import SortedPolicy
    from rollpacker.schedule.sync import SyncPolicy
    from rollpacker.schedule.tail import TailPolicy

    r, s = cfg.rollout, cfg.schedule
    common = {"filter_zero_variance": s.filter_zero_variance, "num_epochs": cfg.num_epochs}
    if cfg.policy == "tail":
        return TailPolicy(sampler, r.num_prompts, r.group_size, eta_prompts=s.eta_prompts,
                          eta_responses=s.eta_responses, last_step=cfg.num_steps - 1, **common)
    if cfg.policy in ("sorted", "sorted_partial"):
        return SortedPolicy(sampler, r.num_prompts, r.group_size, num_batches=s.sorted_batches,
                            partial=cfg.policy == "sorted_partial", **common)
    if cfg.policy == "one_step_off":
        return OneStepOffPolicy(sampler, r.num_prompts, r.group_size, **common)
    return SyncPolicy(sampler, r.num_prompts, r.group_size, **common)


def model_path(config: Config) -> Path:
    if config.model.path:
        return Path(config.model.path)
    from rollpacker.data.toy_model import toy_model_dir

    return toy_model_dir()


def train(config: Config) -> None:
    job = build(config)
    rank0, stop = job.meshes.rank == 0, None
    if job.meshes.disaggregated:  # one_step_off: the rollout pool generates the next batch while this one trains
        from rollpacker import overlap

        step = overlap.train(job)
    else:
        from rollpacker import preempt, watchdog

        preempt.install()  # SIGUSR1/SIGTERM (Slurm): save after the current step and exit
        step = job.start_step
        while step < config.num_steps:
            watchdog.at_step(step)  # faults: dist.timeout_s once the first step is done
            done, stop = job.meshes.broadcast((job.policy.done(), preempt.requested()) if rank0 else None)
            if done or stop:
                break
            due = config.eval_every and step % config.eval_every == 0
            rl_step(job, step, evaluate(job, step) if due else {})
            step += 1
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                save(job, step)
    if step > job.start_step and not (config.checkpoint_every and step % config.checkpoint_every == 0):
        save(job, step)  # the final state, also when the data ran out before num_steps (num_epochs) or on a stop
    if stop and rank0:
        logger.info("stopped on %s after %d steps: checkpoint saved, resume with --resume auto", stop, step)
    if config.eval_every and job.engine is not None and not stop:
        final = evaluate(job, step)
        if rank0:
            job.metrics.log(step, final)
            logger.info("final eval: %s", final)
    if rank0:
        job.rewards.close()
        job.metrics.close()
        job.display.close()
        logger.info("done after %d steps: metrics in %s", step, Path(config.run_dir) / "metrics.jsonl")
    import torch.distributed as dist

    dist.destroy_process_group()


def save(job: Job, step: int, policy_state: dict[str, Any] | None = None) -> None:
    """Collective: the checkpoint of ``step``, with the policy's current state or ``policy_state``."""
    from rollpacker import checkpoint

    path = Path(job.config.run_dir) / "checkpoints" / f"step_{step}"
    state = None
    if job.meshes.rank == 0:
        state = {"policy": {"name": job.policy.name, **(policy_state or job.policy.state_dict())},
                 "rewards": job.rewards.state_dict()}
        if job.planner:
            state["planner"] = job.planner.state_dict()
    checkpoint.save(path, job.trainer, step, state, trainer_rank=job.meshes.train_ranks[0],
                    keep=job.config.checkpoint.keep)


def main(argv: list[str] | None = None) -> None:
    try:
        config = parse(argv)
        if config.resume:
            from rollpacker import checkpoint

            if config.resume == "auto":
                newest = checkpoint.latest(Path(config.run_dir))
                config.resume = str(newest) if newest else ""
            if config.resume:
                checkpoint.check(Path(config.resume), config.policy)
        config.check_world(int(os.environ.get("WORLD_SIZE", "1")))  # torchrun's; 1 for python -m rollpacker.run
    except (ValueError, FileNotFoundError) as e:
        sys.exit(f"rollpacker: config error: {e}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if config.resume and os.environ.get("RANK", "0") == "0":
        logger.info("resuming from %s", config.resume)
    train(config)


if __name__ == "__main__":
    main()
