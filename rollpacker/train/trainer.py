"""The FSDP2 trainer: its optimizer steps per RL step, whatever the spread of samples over ranks.

:meth:`Trainer.step` takes the step's samples and global normalizer, computes the advantages
(:mod:`rollpacker.train.advantages`) and the loss (:func:`~rollpacker.train.losses.policy_objective`),
and steps the optimizer. :meth:`Trainer.accumulate` is stream training's gradient without a step.
With ``train.advantage gae`` it also trains PPO's critic: the critic's values give the advantages
(:func:`~rollpacker.train.advantages.gae`), and each update steps the critic on its value loss.

Invariants:

- The update is the one a single process would take on the whole batch: losses are sums, divided
  once by the step's global count, whatever the ranks, micro-batches or streamed groups.
- All ranks run the same number of micro-batches (FSDP2's collectives must match).
- With one update per step the "old" log-probs are the current ones, detached: the ratio is 1.
- Only the model's tokens train (``loss_mask``); an environment's tokens never do.
- A non-finite gradient norm skips the update, and the checkpoint does not save its weights.

Why: the update must not depend on how samples were scheduled, spread or streamed. How a step runs:
``docs/architecture.md`` (The trainer takes one step); the algorithms around it: ``docs/algorithms.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence

from rollpacker import watchdog
from rollpacker.errors import UserError
from rollpacker.model.attention import CausalAttention
from rollpacker.model.lora import AdaptersOff
from rollpacker.model.offload import StreamedModel
from rollpacker.model.parallelize import parallelize, prepare_reference
from rollpacker.train.advantages import ADVANTAGES, decoupled, earned_at, gae, leaving_out, returns_to_go, whiten
from rollpacker.train.config import TrainConfig
from rollpacker.train.logprobs import token_logprobs, token_logprobs_entropy
from rollpacker.train.losses import KL_ESTIMATORS, STATS, KLController, policy_objective, reverse_kl, units


@dataclass
class Sample:
    """One scored response, ready to train on."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float
    """Its task reward (its step rewards included), what ``train.teacher.task_weight`` weighs."""
    rollout_logprobs: list[float]
    """The engine's log-probs of the response tokens (the behaviour policy)."""
    group: int = 0
    """The responses of one prompt share it and are consecutive: the advantage's group."""
    truncated: bool = False
    """Cut by the length limit: no loss with ``train.mask_truncated``."""
    loss_mask: list[bool] | None = None
    """Per response token, whether the model sampled it (trained); None: all of them. An episode's
    environment tokens are False (their ``rollout_logprobs`` are 0.0, unused)."""
    token_rewards: dict[int, float] = field(default_factory=dict)
    """Response position -> the part of ``reward`` earned at that token (an episode's step rewards): the
    returns of the tokens after it leave it out."""
    failed: bool = False
    """An episode whose environment failed: it trains nothing and its reward enters no group's
    baseline or std (its siblings' advantages are those of the group without it)."""
    shaping: float = 0.0
    """What the controller adds to the reward (DAPO's overlong punishment), whatever the task reward's weight."""
    parts: tuple[tuple[float, float | None], ...] = ()
    """With ``train.advantage gdpo``: ``(weight, value)`` of each part of its reward that GDPO normalizes alone in
    its group (each reward function, then its environment; value None: did not apply). ``reward`` is then the
    rest, and no part is in ``token_rewards``."""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_model_tokens(self) -> int:
        """The response tokens the model sampled: those the loss counts."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)

    def model_mask(self) -> list[bool]:
        """Per response token, whether the model sampled it."""
        return [True] * len(self.response_ids) if self.loss_mask is None else list(self.loss_mask)


def trained_lengths(samples: list[Sample], mask_truncated: bool) -> list[int]:
    """The model tokens of each sample that trains (``mask_truncated`` leaves out the truncated
    ones; a sample without a model token trains nothing): what an aggregation's global count counts."""
    return [s.num_model_tokens for s in samples if not (mask_truncated and s.truncated) and s.num_model_tokens]


def step_rewards(samples: list[Sample], shape: tuple[int, int]) -> torch.Tensor | None:
    """The samples' ``token_rewards`` as [N, T] (``shape``), None when no sample has any."""
    if not any(s.token_rewards for s in samples):
        return None
    out = torch.zeros(shape)
    for i, s in enumerate(samples):
        for position, reward in s.token_rewards.items():
            out[i, position] += reward
    return out


def _parts(samples: list[Sample], kept: list[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' ``parts`` as values [N, K] (NaN: did not apply, or the sample is not ``kept``) and weights [K]."""
    if not samples:
        return torch.zeros(0, 0), torch.zeros(0)
    if not samples[0].parts:
        raise ValueError("train.advantage gdpo needs each sample's reward parts (Sample.parts): none came")
    values = torch.tensor([[float("nan") if v is None or not k else v for _, v in s.parts]
                           for s, k in zip(samples, kept)])
    return values, torch.tensor([w for w, _ in samples[0].parts])


@dataclass
class Prepared:
    """What a step fixes for a sample before its first update."""

    advantages: torch.Tensor
    """Per response token [T]."""
    old: torch.Tensor | None = None
    """Log-probs before the first update [T]; None: the current ones, detached (one update)."""
    ref: torch.Tensor | None = None
    """The reference policy's log-probs [T]; None: computed with the loss, when there is a reference."""
    teacher: torch.Tensor | None = None
    """The teacher's log-probs [T]; None: computed with the loss, when there is a teacher."""
    focus: torch.Tensor | None = None
    """``train.top_entropy_quantile``: the tokens [T] whose policy term counts; None: every one."""
    values: torch.Tensor | None = None
    """``train.advantage gae``: the critic's values before the step's first update [T]."""
    returns: torch.Tensor | None = None
    """``train.advantage gae``: the critic's targets [T] (advantages before whitening plus ``values``)."""


def group_sizes(samples: list[Sample]) -> list[int]:
    """The sizes of the runs of consecutive samples that share a group."""
    sizes: list[int] = []
    for i, s in enumerate(samples):
        if i and s.group == samples[i - 1].group:
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def mini_batches(sizes: list[int], num: int) -> list[list[int]]:
    """Sample indices of at most ``num`` mini-batches: contiguous runs of whole groups, as equal
    in number of groups as can be (one mini-batch when there is no group)."""
    num = max(1, min(num, len(sizes)))
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    bounds = [len(sizes) * k // num for k in range(num + 1)]
    return [list(range(starts[a], starts[b])) for a, b in zip(bounds, bounds[1:])]


def spread(lengths: list[int], num_ranks: int, budget: int) -> list[list[list[int]]]:
    """Sample indices per rank, per micro-batch: longest first onto the least-loaded rank, then
    packed in order under ``budget`` tokens (a longer sample forms its own micro-batch)."""
    loads = [0] * num_ranks
    per_rank: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = loads.index(min(loads))
        per_rank[r].append(i)
        loads[r] += lengths[i]
    plan = []
    for indices in per_rank:
        micro: list[list[int]] = []
        used = budget
        for i in indices:
            if used + lengths[i] > budget:
                micro.append([])
                used = 0
            micro[-1].append(i)
            used += lengths[i]
        plan.append(micro)
    return plan


def warmup_cosine(step: int, warmup: int, last: int, floor: float) -> float:
    """A learning-rate factor: linear warm-up to 1 over ``warmup`` steps (0-based ``step``), then a
    cosine down to ``floor`` at step ``last``, held there after."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, last - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def lr_factor(step: int, config: TrainConfig, num_steps: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based) as a fraction of ``config.lr``: linear
    warm-up over ``warmup_steps``, then constant, or a cosine down to ``min_lr_ratio`` at the run's
    last step, ``num_steps - 1``."""
    if config.lr_schedule == "constant":
        return min(1.0, (step + 1) / config.warmup_steps) if config.warmup_steps else 1.0
    return warmup_cosine(step, config.warmup_steps, num_steps - 1, config.min_lr_ratio)


def compute_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on (parameters may live in host memory with ``train.offload``)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


class NonFiniteError(UserError):
    """``train.max_skipped_steps`` consecutive steps had a non-finite loss or gradient norm: the run stops saying
    so once, as for bad input (the fix is the user's: the settings, the rewards, the data)."""


TAKEN = ("train.lr", "train.betas", "train.adam_eps", "train.weight_decay", "train.critic.lr")
"""The settings :meth:`Trainer.take_settings` applies over a checkpoint's, and says."""


class Trainer:
    """Lives on the ranks of ``mesh`` (every rank, or the training pool of disaggregated pools,
    whose process group is ``group``)."""

    def __init__(self, model: nn.Module, config: TrainConfig, mesh: DeviceMesh, *, temperature: float = 1.0,
                 reference: nn.Module | None = None, teacher: nn.Module | None = None,
                 critic: nn.Module | None = None, group: dist.ProcessGroup | None = None, num_steps: int):
        """``model``: the policy, sharded by :func:`~rollpacker.model.parallelize.parallelize` (or whole,
        then sharded here, with its LoRA adapters); ``reference``: the KL reference, sharded, streamed or
        whole (then sharded), or None: with LoRA and ``kl_coef`` the policy with its adapters off;
        ``teacher``: distillation's teacher, as the reference; ``critic``: ``train.advantage gae``'s value
        model (:func:`~rollpacker.model.parallelize.with_value_head`), sharded or whole (then sharded)."""
        self.config, self.temperature = config, temperature
        self.device = compute_device(mesh)
        mixed = config.mixed_precision and self.device.type == "cuda"
        if not isinstance(model, FSDPModule):
            parallelize(model, mesh, config, mixed_precision=mixed)
        self.model = model
        if reference is None and config.kl_coef and config.lora.rank:
            reference = AdaptersOff(model)
        self.reference, self.teacher = (
            m if m is None or isinstance(m, (FSDPModule, StreamedModel, AdaptersOff))
            else prepare_reference(m, mesh, config, mixed_precision=mixed, device=self.device)
            for m in (reference, teacher))
        self.rank, self.ranks, self.group = dist.get_rank(), mesh.mesh.flatten().tolist(), group
        if (critic is None) == (config.advantage == "gae"):
            raise ValueError(f"Trainer: a critic is trained with train.advantage gae only (got {config.advantage!r} "
                             f"and {'a' if critic is not None else 'no'} critic)")
        if critic is not None and not isinstance(critic, FSDPModule):
            parallelize(critic, mesh, config, mixed_precision=mixed, adapters=False)
        self.critic = critic
        for m in (model, *self._critics()):  # dropout off (TRL's disable_dropout): before the weights move, every
            m.eval()  # forward of a sample gives the same log-probs, so the first update's ratios are 1
        trainable = [p for p in model.parameters() if p.requires_grad]  # with LoRA, the adapters alone
        self.optimizer, self.scheduler = self._optimizer(trainable, config.lr, num_steps)
        self.critic_optimizer, self.critic_scheduler = (
            self._optimizer(list(critic.parameters()), config.critic.lr or config.lr, num_steps) if critic else
            (None, None))
        self.kl = KLController(config.kl_coef, config.kl_target, config.kl_horizon)
        """The KL coefficient (adaptive with ``train.kl_target``); a checkpoint saves its value."""
        self.entropy_threshold = math.inf
        """``train.top_entropy_quantile``: the last step's entropy threshold."""
        self.optimizer_steps = {"policy": 0, "critic": 0}
        """The optimizers' steps since this process started."""
        self.skipped_steps = 0
        """Steps skipped for a non-finite loss or gradient norm, over the run (since this process started)."""
        self.skipping = 0
        """Consecutive skipped steps up to the last one (0: the last step was taken)."""
        self.totals = torch.zeros(len(TOTALS), dtype=torch.float64, device=self.device)
        """Sums since the last update, :data:`TOTALS` in order."""

    def _optimizer(self, params: list[nn.Parameter], lr: float, num_steps: int
                   ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
        cfg = self.config
        optimizer = torch.optim.AdamW(params, lr=lr, betas=cfg.betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, num_steps))

    def take_settings(self) -> list[str]:
        """After a checkpoint's optimizers and schedules are loaded: this run's ``train.lr`` (``critic.lr``),
        ``betas``, ``adam_eps`` and ``weight_decay`` in place of the checkpoint's, the moments and the schedule's
        step kept (the way out of a NaN run: resume with a lower lr). What changed, as ``name: saved -> now``."""
        cfg, changed = self.config, []
        for name, optimizer, scheduler, lr in (("lr", self.optimizer, self.scheduler, cfg.lr),
                                               ("critic.lr", self.critic_optimizer, self.critic_scheduler,
                                                cfg.critic.lr or cfg.lr)):
            if optimizer is None:
                continue
            now = {name: lr, "betas": tuple(cfg.betas), "adam_eps": cfg.adam_eps, "weight_decay": cfg.weight_decay}
            for group in optimizer.param_groups:
                saved = {name: group["initial_lr"], "betas": tuple(group["betas"]), "adam_eps": group["eps"],
                         "weight_decay": group["weight_decay"]}
                changed += [f"train.{k}: {saved[k]} -> {v}" for k, v in now.items() if saved[k] != v]
                group.update(initial_lr=lr, betas=now["betas"], eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
            scheduler.base_lrs = [lr] * len(optimizer.param_groups)
            factors = [f(scheduler.last_epoch) for f in scheduler.lr_lambdas]
            for group, factor in zip(optimizer.param_groups, factors, strict=True):
                group["lr"] = lr * factor
        return list(dict.fromkeys(changed))

    def accumulate(self, samples: list[Sample], ranks: list[int]) -> None:
        """Gradients of this rank's share of ``samples`` among ``ranks`` (the ranks training now,
        whole FSDP shard groups), with no gradient sync and no optimizer step: the next
        :meth:`step` reduces them with everything else. ``samples`` are whole groups, and the
        advantage estimator is per group (the config refuses the others with streaming)."""
        prepared = self._prepare(samples)
        self._backward(samples, prepared, spread([s.num_tokens for s in samples], len(ranks),
                                                 self.config.micro_batch_tokens), ranks, sync_last=False)

    def step(self, samples: list[Sample], normalizer: float) -> dict[str, float]:
        """The RL step's optimizer steps on ``samples`` (identical on every rank; whole groups),
        the first one with whatever :meth:`accumulate` buffered since the last step.
        ``normalizer`` is the step's global count (:func:`~rollpacker.train.losses.normalizer`),
        accumulated samples included; each mini-batch takes its share of it."""
        cfg = self.config
        batches = mini_batches(group_sizes(samples), cfg.mini_batches)
        plans = [spread([samples[i].num_tokens for i in b], len(self.ranks), cfg.micro_batch_tokens) for b in batches]
        several = len(batches) * cfg.epochs > 1
        needs_frozen = (several or cfg.kl_in_reward or cfg.teacher.in_reward or cfg.top_entropy_quantile < 1
                        or self.critic is not None)
        frozen = self._frozen(samples, batches, plans) if needs_frozen else {}
        prepared = self._prepare(samples, frozen)
        total = self._units(samples)
        updates, shares, before = [], [], dict(self.optimizer_steps)
        for _ in range(cfg.epochs):
            for batch, plan in zip(batches, plans):
                share = normalizer * self._units([samples[i] for i in batch]) / total if several and total else (
                    normalizer)
                shares.append(share)
                updates.append(self._update([samples[i] for i in batch], [prepared[i] for i in batch], plan,
                                            share, frozen=needs_frozen))
        # each schedule advances once per RL step in which its optimizer stepped (HF Trainer's rule): a step that
        # updated nothing (a non-finite gradient, no model token, the critic's warm-up) leaves it where it was
        if self.optimizer_steps["policy"] > before["policy"]:
            self.scheduler.step()
            if cfg.ref_sync_steps and self.scheduler.last_epoch % cfg.ref_sync_steps == 0:
                self._mix_reference()
        if self.optimizer_steps["critic"] > before["critic"]:
            self.critic_scheduler.step()
        self._count_skipped(updates)
        stats = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        # of several updates: the loss over the step's count, a token mean over their tokens (the means of each
        # update's own misstated them, and adaptive KL steered by that)
        stats["train/loss"] = sum(u["train/loss"] * w for u, w in zip(updates, shares)) / max(sum(shares), 1e-12)
        for k, count in TOKEN_MEANS.items():
            if k in stats:
                stats[k] = sum(u[k] * u[count] for u in updates) / max(sum(u[count] for u in updates), 1)
        for count in {"train/num_tokens", "critic/num_tokens"} & stats.keys():
            stats[count] = float(sum(u[count] for u in updates[:len(batches)]))
        stats["train/skipped"] = float(sum(u["train/skipped"] for u in updates))
        stats["train/masked_truncated"] = float(sum(u["train/masked_truncated"] for u in updates[:len(batches)]))
        stats["train/num_samples"] = float(sum(u["train/num_samples"] for u in updates[:len(batches)]))
        if cfg.top_entropy_quantile < 1:
            stats["train/entropy_threshold"] = self.entropy_threshold
        if self.reference is not None:
            stats["train/kl_coef"] = self.kl.value  # this step's
            if math.isfinite(stats["train/kl"]):  # a skipped step's may not be
                self.kl.update(stats["train/kl"], stats["train/num_samples"])
        stats["train/skipped_steps"] = float(self.skipped_steps)
        stats["train/num_updates"] = float(len(updates))
        self.updates = updates
        """The last step's updates' stats, one dict each (tests read the first update's ratios)."""
        return stats

    def _count_skipped(self, updates: list[dict[str, float]]) -> None:
        """A step with an update skipped for a non-finite loss or gradient is a skipped step (its weights are not
        saved); ``train.max_skipped_steps`` of them in a row stop the run (loss and norm are global: every training
        rank raises)."""
        skipped = next((u for u in updates if u["train/skipped"]), None)
        self.skipped_steps += skipped is not None
        self.skipping = self.skipping + 1 if skipped else 0
        limit = self.config.max_skipped_steps
        if limit and self.skipping >= limit:
            raise NonFiniteError(
                f"train: {self.skipping} consecutive steps skipped for a non-finite loss or gradient (last: "
                f"loss={skipped['train/loss']}, grad_norm={skipped['train/grad_norm']}; train.max_skipped_steps="
                f"{limit}). Stopping without saving these weights: the newest committed checkpoint predates them. "
                "Lower train.lr, raise train.adam_eps, check the rewards and data, then resume from that checkpoint")

    def _update(self, samples: list[Sample], prepared: list[Prepared], plan: list[list[list[int]]],
                normalizer: float, *, frozen: bool) -> dict[str, float]:
        """One optimizer step on ``samples`` spread as ``plan``, gradients over ``normalizer``
        (``frozen``: the frozen pass gave the reference's and the teacher's log-probs)."""
        cfg = self.config
        normalizer = max(normalizer, 1)
        num_micro = self._backward(samples, prepared, plan, self.ranks, sync_last=True, frozen=frozen)
        totals, self.totals = self.totals, torch.zeros_like(self.totals)
        dist.all_reduce(totals, group=self.group)
        params = [p for p in self.model.parameters() if p.grad is not None]
        scale = normalizer / len(self.ranks)  # FSDP2 averaged over the ranks; the losses were sums
        for p in params:
            p.grad.div_(scale)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        sums = dict(zip(TOTALS, totals.tolist()))
        loss = sums["loss"] / normalizer
        skipped = not math.isfinite(norm) or not math.isfinite(loss)
        lr = self.optimizer.param_groups[0]["lr"]
        if not skipped and sums["tokens"] and not self.warming:  # no model token anywhere: no update at all
            self.optimizer.step()
            self.optimizer_steps["policy"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(sums["tokens"], 1)
        critic = self._critic_step(sums) if self.critic is not None else {}
        return critic | {
            "train/loss": loss,
            "train/grad_norm": norm,
            "train/clip_frac": sums["clipped"] / tokens,
            "train/ratio_dev": sums["ratio_dev"] / tokens,
            "train/kl": sums["kl"] / tokens,
            "train/entropy": sums["entropy"] / tokens,
            "train/rollout_logprob_diff": sums["logprob_diff"] / tokens,
            "train/rollout_is_ratio_mean": sums["rollout_ratio"] / tokens,
            "train/rollout_is_weight_mean": sums["rollout_is"] / tokens,
            "train/rollout_is_outside_frac": sums["rollout_is_outside"] / tokens,
            "train/masked_truncated": sums["masked_truncated"],
            "train/num_samples": sums["samples"],
            "train/num_tokens": sums["tokens"],
            "train/lr": lr,
            "train/skipped": float(skipped),
            "train/num_micro_batches": float(num_micro),
        } | ({"train/teacher_kl": sums["teacher_kl"] / tokens} if self.teacher is not None else {})

    @property
    def warming(self) -> bool:
        """``train.critic.warmup_steps``: this step trains the critic alone (the policy's weights and schedule wait)."""
        return self.critic is not None and self.critic_scheduler.last_epoch < self.config.critic.warmup_steps

    def _critic_step(self, sums: dict[str, float]) -> dict[str, float]:
        """The critic's optimizer step on the value loss's gradients (a token mean over the update's
        trained tokens, whatever the aggregation); skipped, alone, on a non-finite gradient norm."""
        cfg, tokens = self.config, max(sums["vf_tokens"], 1)
        params = [p for p in self.critic.parameters() if p.grad is not None]
        for p in params:
            p.grad.div_(tokens / len(self.ranks))
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(norm) and sums["vf_tokens"]:
            self.critic_optimizer.step()
            self.optimizer_steps["critic"] += 1
        self.critic_optimizer.zero_grad(set_to_none=True)
        variance = {k: sums[f"{k}_sq"] / tokens - (sums[k] / tokens) ** 2 for k in ("ret", "err")}
        return {"critic/vf_loss": sums["vf_loss"] / tokens, "critic/vf_clipfrac": sums["vf_clipped"] / tokens,
                "critic/vpred_mean": sums["vpred"] / tokens, "critic/returns_mean": sums["ret"] / tokens,
                "critic/vf_explained_var": 1 - variance["err"] / variance["ret"] if variance["ret"] > 1e-12 else 0.0,
                "critic/grad_norm": norm, "critic/lr": self.critic_optimizer.param_groups[0]["lr"],
                "critic/warmup": float(self.warming), "critic/num_tokens": sums["vf_tokens"]}

    @torch.no_grad()
    def _mix_reference(self) -> None:
        """``train.ref_sync_steps``: reference = alpha x policy + (1 - alpha) x reference, shard by shard (both are
        sharded alike, so no collective)."""
        alpha = self.config.ref_mixup_alpha
        for model in (self.model, self.reference):
            model.reshard()  # FSDP2 leaves a root's parameters unsharded after a forward without backward
        for ref, policy in zip(self.reference.parameters(), self.model.parameters(), strict=True):
            ref.mul_(1 - alpha).add_(policy, alpha=alpha)

    def _units(self, samples: list[Sample]) -> int:
        """What the aggregation counts in ``samples``, leaving out those whose loss is masked."""
        return units(self.config.aggregation, trained_lengths(samples, self.config.mask_truncated))

    def _masked(self, sample: Sample) -> bool:
        return self.config.mask_truncated and sample.truncated

    def _trains(self, sample: Sample) -> bool:
        """Its model tokens train: neither a failed episode nor masked for truncation (the critic's tokens)."""
        return not (sample.failed or self._masked(sample))

    def _prepare(self, samples: list[Sample], frozen: dict[int, Frozen] | None = None) -> list[Prepared]:
        """Each sample's advantages (``train.advantage`` over its group or the whole of ``samples``),
        with the frozen log-probs of ``frozen`` (index -> (old, ref, teacher), this rank's samples).
        The task reward weighs ``train.teacher.task_weight``; the controller's shaping is added after."""
        cfg, frozen = self.config, frozen or {}
        lengths = [len(s.response_ids) for s in samples]
        mask = torch.arange(max([1, *lengths]))[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
        for i, s in enumerate(samples):  # [N, T] the model's tokens
            if s.loss_mask is not None:
                mask[i, :len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.bool)
        token_rewards = self._token_rewards(samples, frozen, mask)
        steps = step_rewards(samples, tuple(mask.shape))
        rewards = torch.tensor([s.reward for s in samples])
        kept = [not s.failed for s in samples]
        if cfg.advantage == "gdpo":  # GDPO's first stage; a response no part applies to has no advantage
            parts = decoupled(*_parts(samples, kept), group_sizes(samples))
            kept = [k and not math.isnan(p) for k, p in zip(kept, parts.tolist())]
            rewards = rewards + parts.nan_to_num(0.0)
        if cfg.teacher.path:
            rewards = cfg.teacher.task_weight * rewards
            steps = None if steps is None else cfg.teacher.task_weight * steps
        rewards = rewards + torch.tensor([s.shaping for s in samples])
        returns = returns_to_go(rewards, mask, token_rewards, earned=steps)  # [N, T]
        values = targets = None
        trained = mask & torch.tensor([self._trains(s) for s in samples], dtype=torch.bool)[:, None]
        if self.critic is not None:
            within = torch.arange(mask.shape[1])[None, :] < torch.tensor(lengths, dtype=torch.long)[:, None]
            values = self._everyones(samples, {i: f[4] for i, f in frozen.items()}, mask.shape)
            adv, targets = gae(earned_at(returns, within), values, mask, cfg.gamma, cfg.lam)
            adv = whiten(adv, trained).where(trained, 0.0)  # over the tokens the step trains, as verl's
        else:  # a whitening's statistics over the tokens the step trains too
            adv = leaving_out(ADVANTAGES[cfg.advantage].fn, returns, trained, group_sizes(samples), kept)
        focus = self._focus(samples, frozen)
        return [Prepared(adv[i, :n], *frozen.get(i, (None,) * 4)[:3], focus=focus.get(i),
                         values=None if values is None else values[i, :n],
                         returns=None if targets is None else targets[i, :n])
                for i, n in enumerate(lengths)]

    def _focus(self, samples: list[Sample], frozen: dict[int, Frozen]) -> dict[int, torch.Tensor]:
        """``train.top_entropy_quantile``: each of this rank's samples' tokens whose entropy before the step is at
        least the quantile over every token the step trains, on every rank (``train/entropy_threshold``)."""
        q = self.config.top_entropy_quantile
        if q >= 1:
            return {}
        entropy = {i: f[3] for i, f in frozen.items()}
        trained = [e[torch.tensor(samples[i].model_mask(), dtype=torch.bool, device=e.device)]
                   for i, e in sorted(entropy.items()) if not self._masked(samples[i])]
        every = gather_varlen(torch.cat(trained) if trained else torch.zeros(0, device=self.device), self.group)
        rank = 1 + int((1 - q) * (len(every) - 1))  # the lower of the quantile's neighbours, as numpy's "lower"
        self.entropy_threshold = every.kthvalue(rank).values.item() if len(every) else math.inf
        return {i: e >= self.entropy_threshold for i, e in entropy.items()}

    def _token_rewards(self, samples: list[Sample], frozen: dict[int, Frozen], mask: torch.Tensor
                       ) -> torch.Tensor | None:
        """Per-token rewards [N, T] of every sample, None without any: ``-kl_coef x KL`` to the
        reference (``train.kl_in_reward``) plus ``-teacher.coef x (old - teacher)``, the teacher's
        reverse KL (distillation's reward mode). Each rank computes its own share's from the frozen
        pass, and one all-reduce gives every rank all of them."""
        cfg = self.config
        if not (cfg.kl_in_reward or cfg.teacher.in_reward):
            return None
        mine = {}
        for i, (old, ref, teacher, *_) in frozen.items():
            reward = torch.zeros_like(old)
            if cfg.kl_in_reward:
                reward = reward - self.kl.value * KL_ESTIMATORS[cfg.kl_estimator](old, ref)
            if cfg.teacher.in_reward:
                reward = reward - cfg.teacher.coef * reverse_kl(old, teacher)
            mine[i] = reward
        return self._everyones(samples, mine, tuple(mask.shape))

    def _everyones(self, samples: list[Sample], mine: dict[int, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Every sample's per-token values [N, T] (``shape``; 0 past a response), on every rank, from each rank's
        ``mine`` (index -> [its response length], this rank's samples): one all-reduce (none for no sample: a
        step whose groups were all filtered, on every rank alike)."""
        if not samples:
            return torch.zeros(shape)
        lengths = [len(s.response_ids) for s in samples]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = torch.zeros(offsets[-1], dtype=torch.float32, device=self.device)
        for i, values in mine.items():
            flat[offsets[i]:offsets[i + 1]] = values
        dist.all_reduce(flat, group=self.group)
        padded = pad_sequence(flat.cpu().split(lengths), batch_first=True)  # [N, T'], T' <= T
        out = torch.zeros(shape)
        out[:, :padded.shape[1]] = padded
        return out

    def _frozen_models(self) -> list[nn.Module]:
        """The frozen models whose log-probs a step needs besides the policy's: reference, teacher."""
        return [m for m in (self.reference, self.teacher) if m is not None]

    def _reshard_frozen(self) -> None:
        """FSDP2 leaves a root's parameters unsharded after a forward without backward: a sharded frozen model's
        embedding and head would stay whole on the device through the step and rollout (2 GB a GPU for a 7B
        model), which the memory plan counts as shards."""
        for model in self._frozen_models():
            if isinstance(model, FSDPModule):
                model.reshard()

    def _critics(self) -> list[nn.Module]:
        return [self.critic] if self.critic is not None else []

    @torch.no_grad()
    def _frozen(self, samples: list[Sample], batches: list[list[int]], plans: list[list[list[list[int]]]]
                ) -> dict[int, Frozen]:
        """Log-probs (and the reference's and teacher's; the critic's values) of this rank's samples before the
        step's first update, on the micro-batches the updates will use: index -> (old, ref, teacher, entropy,
        value) [T] each (None without that model; the entropy with ``train.top_entropy_quantile`` only)."""
        out = {}
        for batch, plan in zip(batches, plans):
            mine, num_micro = plan[self.ranks.index(self.rank)], max(1, *(len(p) for p in plan))
            for i in range(num_micro):
                watchdog.progress()  # a rank waiting on this step (the other pool) waits on
                if i >= len(mine):  # FSDP2's all-gathers must match: an idle forward
                    for model in (self.model, *self._frozen_models(), *self._critics()):
                        self._idle_loss(model)
                    continue
                micro = [samples[batch[j]] for j in mine[i]]
                lengths = [len(s.response_ids) for s in micro]
                entropy = [None] * len(micro)
                if self.config.top_entropy_quantile < 1:
                    old, entropy = (x.split(lengths) for x in self._logprobs(self.model, micro, entropy=True))
                else:
                    old = self._logprobs(self.model, micro).split(lengths)
                ref, teacher = (self._logprobs(m, micro).split(lengths) if m is not None else [None] * len(micro)
                                for m in (self.reference, self.teacher))
                values = self._values(micro).split(lengths) if self.critic is not None else [None] * len(micro)
                for j, o, r, t, e, v in zip(mine[i], old, ref, teacher, entropy, values):
                    out[batch[j]] = (o, r, t, e, v)
        self._reshard_frozen()
        return out

    def _backward(self, samples: list[Sample], prepared: list[Prepared], plan: list[list[list[int]]],
                  ranks: list[int], *, sync_last: bool, frozen: bool = False) -> int:
        """Forward/backward of this rank's micro-batches of ``plan`` (losses are sums); the gradients
        are reduced after the last one only if ``sync_last``. Without ``frozen`` log-probs, each
        micro-batch also runs the reference and the teacher (an idle rank too: FSDP2's all-gathers
        must match). Returns the number of micro-batches each rank ran (at least one, so that a sync
        reduces what earlier calls accumulated)."""
        mine, num_micro = plan[ranks.index(self.rank)], max(1, *(len(p) for p in plan))
        reduce_every = self.config.reduce_every_micro_batch
        for i in range(num_micro):
            watchdog.progress()  # a rank waiting on this step (the other pool) waits on
            for model in (self.model, *self._critics()):
                model.set_requires_gradient_sync(sync_last and (i == num_micro - 1 or reduce_every))
            if i < len(mine):
                batch, ready = [samples[j] for j in mine[i]], [prepared[j] for j in mine[i]]
                loss, stats = self._loss(batch, ready)
                loss.backward()
                totals = [loss.detach(), *stats]
                if self.critic is not None:
                    value_loss, critic_stats = self._value_loss(batch, ready)
                    value_loss.backward()
                    totals += critic_stats
                self.totals[:len(totals)] += torch.stack(totals).to(self.totals)
                continue
            if not frozen:
                with torch.no_grad():
                    for model in self._frozen_models():
                        self._idle_loss(model)
                self._reshard_frozen()  # as _loss does: the next micro-batch's all-gathers then match
            for model in (self.model, *self._critics()):
                self._idle_loss(model).backward()
        return num_micro

    def _packed(self, batch: list[Sample]) -> tuple[torch.Tensor, torch.Tensor, CausalAttention, torch.Tensor]:
        """``batch`` packed for a forward: its tokens, their positions, the attention, and the position
        predicting each response token (empty: a micro-batch of no response token)."""
        tokens = torch.tensor([t for s in batch for t in (*s.prompt_ids, *s.response_ids)], device=self.device)
        positions = torch.cat([torch.arange(s.num_tokens) for s in batch]).to(self.device)
        pick, start = [], 0
        for s in batch:
            p = start + len(s.prompt_ids) - 1
            pick.extend(range(p, p + len(s.response_ids)))
            start += s.num_tokens
        attn = CausalAttention([s.num_tokens for s in batch], self.device)
        return tokens, positions, attn, torch.tensor(pick, dtype=torch.long, device=self.device)

    def _logprobs(self, model: nn.Module, batch: list[Sample], entropy: bool = False):
        """Log-probs of every response token of ``batch``, flat [sum of response lengths]; with
        ``entropy``, also each token's entropy, the same shape."""
        tokens, positions, attn, pick = self._packed(batch)
        fn = token_logprobs_entropy if entropy else token_logprobs
        return model(tokens, positions, attn,
                     head=lambda h, w: fn(h[pick], w, tokens[pick + 1], self.temperature,
                                          impl=self.config.logprobs_impl, softcap=model.logit_softcap))

    def _values(self, batch: list[Sample]) -> torch.Tensor:
        """The critic's value of the state before every response token of ``batch``, flat [sum of response
        lengths]."""
        tokens, positions, attn, pick = self._packed(batch)
        return self.critic(tokens, positions, attn, head=lambda h, w: (h[pick] @ w[0]).float())

    def _value_loss(self, batch: list[Sample], prepared: list[Prepared]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A micro-batch's value loss, a sum over the tokens the policy trains on (not a failed episode's):
        ``0.5 x max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2)``; and its totals (:data:`CRITIC_TOTALS`)."""
        lengths = [len(s.response_ids) for s in batch]
        vpred = pad(self._values(batch), lengths)
        old, returns = (pad(torch.cat([getattr(p, k) for p in prepared]).to(self.device), lengths)
                        for k in ("values", "returns"))
        mask = pad_sequence([torch.tensor(s.model_mask(), dtype=torch.bool, device=self.device) & self._trains(s)
                             for s in batch], batch_first=True)
        loss = (vpred - returns) ** 2
        clipped = torch.zeros_like(mask)
        if clip := self.config.critic.value_clip:
            bounded = (old + (vpred - old).clamp(-clip, clip) - returns) ** 2
            clipped, loss = bounded > loss, torch.maximum(loss, bounded)
        loss = 0.5 * loss.where(mask, 0.0).sum()
        error = (returns - vpred.detach()).where(mask, 0.0)
        returns = returns.where(mask, 0.0)
        return loss, [loss.detach(), (mask & clipped).sum().float(), vpred.detach().where(mask, 0.0).sum(),
                      mask.sum().float(), returns.sum(), (returns ** 2).sum(), error.sum(), (error ** 2).sum()]

    def _loss(self, batch: list[Sample], prepared: list[Prepared]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A micro-batch's loss (a sum) and its :data:`TOTALS` after the loss. The frozen models'
        log-probs not given in ``prepared`` are computed first (the order an idle rank follows)."""
        lengths = [len(s.response_ids) for s in batch]

        def padded(flat: torch.Tensor) -> torch.Tensor:
            return pad(flat, lengths)

        def frozen(model: nn.Module | None, given: list[torch.Tensor | None]) -> torch.Tensor | None:
            if model is None:
                return None
            if given[0] is not None:
                return padded(torch.cat(given))
            with torch.no_grad():
                return padded(self._logprobs(model, batch))

        ref = frozen(self.reference, [p.ref for p in prepared])
        teacher = frozen(self.teacher, [p.teacher for p in prepared])
        self._reshard_frozen()
        logp_flat, entropy_flat = self._logprobs(self.model, batch, entropy=True)
        logp = padded(logp_flat)
        mask = pad_sequence([torch.tensor(s.model_mask(), dtype=torch.bool, device=self.device) & (not self._masked(s))
                             for s in batch], batch_first=True)  # the model's tokens of the samples that train
        old = padded(torch.cat([p.old for p in prepared])) if prepared[0].old is not None else logp.detach()
        behavior = padded(torch.tensor([lp for s in batch for lp in s.rollout_logprobs], device=self.device))
        adv = padded(torch.cat([p.advantages for p in prepared]).to(self.device))
        focus = None if prepared[0].focus is None else padded(torch.cat([p.focus for p in prepared]).to(self.device))
        loss, stats = policy_objective(logp, old, behavior, adv, mask, self.config, entropy=padded(entropy_flat),
                                       ref=ref, teacher=teacher, kl_coef=self.kl.value, focus=focus)
        counts = torch.tensor([float(sum(map(self._masked, batch))), float(len(batch))], device=self.device)
        return loss, [stats[k] for k in STATS] + [*counts]

    def _idle_loss(self, model: nn.Module | None = None) -> torch.Tensor:
        """A zero-weighted forward/backward that joins FSDP2's collectives on a rank with no work."""
        model = model or self.model
        tokens = torch.zeros(1, dtype=torch.long, device=self.device)
        out = model(tokens, tokens, CausalAttention([1], self.device), head=lambda h, w: (h @ w.T).sum())
        return out * 0.0


Frozen = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]
"""A sample's log-probs before the step's first update [T]: the policy's, the reference's, the teacher's; the
policy's entropies (``train.top_entropy_quantile``); the critic's values (``train.advantage gae``)."""


def pad(flat: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-token values of consecutive responses, flat [sum of ``lengths``] -> [N, T], zero-padded."""
    return pad_sequence(flat.split(lengths), batch_first=True)


def gather_varlen(values: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's ``values`` (1-D, any length), concatenated in rank order, on every rank of ``group``."""
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=values.device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(values)], device=values.device), group=group)
    longest = max(int(s) for s in sizes)
    parts = [torch.empty(longest, dtype=values.dtype, device=values.device) for _ in range(world)]
    dist.all_gather(parts, torch.cat([values, values.new_zeros(longest - len(values))]), group=group)
    return torch.cat([p[:int(s)] for p, s in zip(parts, sizes)])

CRITIC_TOTALS = ("vf_loss", "vf_clipped", "vpred", "vf_tokens", "ret", "ret_sq", "err", "err_sq")
"""The critic's sums of an update (``train.advantage gae``): its loss, its clipped tokens, its values, its tokens, and
of its targets R and errors R - V, each and squared (the explained variance)."""
TOTALS = ("loss", *STATS, "masked_truncated", "samples", *CRITIC_TOTALS)
"""What a trainer sums over micro-batches and ranks for an update's metrics."""
TOKEN_MEANS = {**{f"train/{k}": "train/num_tokens" for k in (
    "clip_frac", "ratio_dev", "kl", "entropy", "rollout_logprob_diff", "rollout_is_ratio_mean",
    "rollout_is_weight_mean", "rollout_is_outside_frac", "teacher_kl")},
               **{f"critic/{k}": "critic/num_tokens" for k in (
                   "vf_loss", "vf_clipfrac", "vpred_mean", "returns_mean", "vf_explained_var")}}
"""An update's metrics that are means over its tokens -> their count: a step of several weighs each by its tokens."""
