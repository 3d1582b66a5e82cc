"""The FSDP2 trainer: one optimizer step per RL step, whatever the spread of samples over ranks.

- FSDP2 ``fully_shard`` per block, then the root, over the training mesh (2-D replicate x shard
  = HSDP; a 1-D mesh is plain FSDP); bf16 compute with fp32 reduction on GPU; activation
  checkpointing and CPU offload as configured (:func:`~rollpacker.model.parallelize.parallelize`).
- Samples are spread over ranks longest-first onto the least-loaded rank (by tokens), then
  packed into micro-batches under a token budget. All ranks run the same number of micro-batches
  (a rank with fewer runs zero-weighted ones: FSDP2's collectives must match), and gradients are
  reduced only after the last one.
- Every normalizer is global (all response tokens, or all sequences, of the step): micro-batch
  losses are *sums*, and the reduced gradient is divided by the step's global count just before
  clipping. The update is the one a single process would take on the whole batch, and it does
  not matter when a sample's gradient was computed.
- Stream training (``accumulate``, paper §4.4): ranks freed from rollout compute gradients of
  finished groups while rollout goes on, with no gradient sync and no optimizer step; FSDP2 keeps
  them in its unsharded accumulators, and the next :meth:`Trainer.step`, which every rank joins,
  reduces them with the rest. Optimizer state is not touched until then.
- A non-finite gradient norm skips the step: no weight changes, ``train/skipped`` = 1, and
  ``train/skipped_steps`` counts them over the run; ``train.max_skipped_steps`` in a row raise
  :class:`NonFiniteError` (the run stops), and while a run of skipped steps lasts,
  :attr:`Trainer.skipping` tells the checkpoint not to save weights that produced it.

On-policy, one optimizer step per RL step: the "old" log-probs of the PPO ratio are the current
policy's own, detached (ratio 1 at the step's start), which is what recomputing them first would
give. The engines' log-probs are then only compared, as ``train/rollout_logprob_diff`` and
``train/is_weight_mean`` (the mean of ``exp(current - engine)``); with ``train.off_policy`` is or
tis, they correct samples drawn by older weights (``losses.off_policy_correction``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.nn.utils.rnn import pad_sequence

from rollpacker.model.attention import CausalAttention
from rollpacker.model.offload import StreamedModel
from rollpacker.model.parallelize import parallelize, prepare_reference
from rollpacker.train.config import TrainConfig
from rollpacker.train.logprobs import token_logprobs
from rollpacker.train.losses import importance_weights, off_policy_correction, policy_loss


@dataclass
class Sample:
    """One scored response, ready to train on."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantage: float
    rollout_logprobs: list[float]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


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


class NonFiniteError(RuntimeError):
    """``train.max_skipped_steps`` consecutive steps had a non-finite loss or gradient norm."""


class Trainer:
    """Lives on the ranks of ``mesh`` (every rank, or the training pool of disaggregated pools,
    whose process group is ``group``)."""

    def __init__(self, model: nn.Module, config: TrainConfig, mesh: DeviceMesh, *, temperature: float = 1.0,
                 reference: nn.Module | None = None, group: dist.ProcessGroup | None = None, num_steps: int):
        """``model``: the policy, sharded by :func:`~rollpacker.model.parallelize.parallelize` (or whole,
        then sharded here); ``reference``: the KL reference, sharded, streamed or whole (then sharded)."""
        self.config, self.temperature = config, temperature
        self.device = compute_device(mesh)
        mixed = config.mixed_precision and self.device.type == "cuda"
        if not isinstance(model, FSDPModule):
            parallelize(model, mesh, config, mixed_precision=mixed)
        self.model = model
        if reference is not None and not isinstance(reference, (FSDPModule, StreamedModel)):
            reference = prepare_reference(reference, mesh, config, mixed_precision=mixed, device=self.device)
        self.reference = reference
        self.rank, self.ranks, self.group = dist.get_rank(), mesh.mesh.flatten().tolist(), group
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas,
                                           eps=config.adam_eps, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lambda step: lr_factor(step, config, num_steps))
        self.skipped_steps = 0
        """Steps skipped for a non-finite loss or gradient norm, over the run (since this process started)."""
        self.skipping = 0
        """Consecutive skipped steps up to the last one (0: the last step was taken)."""
        self.totals = torch.zeros(6, dtype=torch.float64, device=self.device)
        """Sums since the last step: loss, clipped tokens, tokens, KL, |log-prob diff|, importance weights."""

    def accumulate(self, samples: list[Sample], ranks: list[int]) -> None:
        """Gradients of this rank's share of ``samples`` among ``ranks`` (the ranks training now,
        whole FSDP shard groups), with no gradient sync and no optimizer step: the next
        :meth:`step` reduces them with everything else."""
        self._backward(samples, ranks, sync_last=False)

    def step(self, samples: list[Sample], normalizer: int | None = None) -> dict[str, float]:
        """One optimizer step on ``samples`` (identical on every rank) and whatever :meth:`accumulate`
        buffered since the last step. ``normalizer`` is the step's global count (response tokens,
        or sequences for seq-mean), accumulated samples included; None counts ``samples``."""
        cfg = self.config
        if normalizer is None:
            normalizer = sum(len(s.response_ids) for s in samples) if cfg.aggregation == "token" else len(samples)
        normalizer = max(normalizer, 1)
        num_micro = self._backward(samples, self.ranks, sync_last=True)
        totals, self.totals = self.totals, torch.zeros_like(self.totals)
        dist.all_reduce(totals, group=self.group)
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:  # the global normalizer: losses were sums
            p.grad.div_(normalizer)
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        loss, clipped, tokens, kl, lp_diff, is_weight = totals.tolist()
        loss /= normalizer
        skipped = not math.isfinite(norm) or not math.isfinite(loss)
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += skipped
        self.skipping = self.skipping + 1 if skipped else 0
        limit = cfg.max_skipped_steps
        if limit and self.skipping >= limit:  # loss and norm are global: every training rank raises
            raise NonFiniteError(
                f"train: {self.skipping} consecutive steps skipped for a non-finite update (last: loss={loss}, "
                f"grad_norm={norm}; train.max_skipped_steps={limit}). Stopping without saving these weights: the "
                "newest committed checkpoint predates them. Lower train.lr, raise train.adam_eps, check the "
                "rewards and data, then resume from that checkpoint")
        return {
            "train/loss": loss,
            "train/grad_norm": norm,
            "train/clip_frac": clipped / max(tokens, 1),
            "train/kl": kl / max(tokens, 1),
            "train/rollout_logprob_diff": lp_diff / max(tokens, 1),
            "train/is_weight_mean": is_weight / max(tokens, 1),
            "train/lr": lr,
            "train/skipped": float(skipped),
            "train/skipped_steps": float(self.skipped_steps),
            "train/num_micro_batches": float(num_micro),
        }

    def _backward(self, samples: list[Sample], ranks: list[int], *, sync_last: bool) -> int:
        """Forward/backward of this rank's micro-batches (losses are sums); the gradients are reduced
        after the last one only if ``sync_last``. Returns the number of micro-batches each rank ran
        (at least one, so that a sync reduces what earlier calls accumulated)."""
        plan = spread([s.num_tokens for s in samples], len(ranks), self.config.micro_batch_tokens)
        mine, num_micro = plan[ranks.index(self.rank)], max(1, *(len(p) for p in plan))
        reduce_every = self.config.reduce_every_micro_batch
        self.model.train()
        for i in range(num_micro):
            self.model.set_requires_gradient_sync(sync_last and (i == num_micro - 1 or reduce_every))
            if i < len(mine):
                loss, stats = self._loss([samples[j] for j in mine[i]])
                self.totals += torch.stack([loss.detach().double(), *stats]).to(self.totals)
            else:
                loss = self._idle_loss()
            loss.backward()
        return num_micro

    def _logprobs(self, model: nn.Module, batch: list[Sample]) -> torch.Tensor:
        """Log-probs of every response token of ``batch``, flat [sum of response lengths]."""
        tokens = torch.tensor([t for s in batch for t in (*s.prompt_ids, *s.response_ids)], device=self.device)
        positions = torch.cat([torch.arange(s.num_tokens) for s in batch]).to(self.device)
        pick, start = [], 0  # the position predicting each response token
        for s in batch:
            p = start + len(s.prompt_ids) - 1
            pick.extend(range(p, p + len(s.response_ids)))
            start += s.num_tokens
        pick_t = torch.tensor(pick, device=self.device)
        targets = tokens[pick_t + 1]
        attn = CausalAttention([s.num_tokens for s in batch], self.device)
        return model(tokens, positions, attn,
                     head=lambda h, w: token_logprobs(h[pick_t], w, targets, self.temperature,
                                                     impl=self.config.logprobs_impl, softcap=model.logit_softcap))

    def _loss(self, batch: list[Sample]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        lengths = [len(s.response_ids) for s in batch]
        logp_flat = self._logprobs(self.model, batch)
        logp = pad_sequence(logp_flat.split(lengths), batch_first=True)  # [N, T]
        mask = pad_sequence([torch.ones(n, device=self.device) for n in lengths], batch_first=True)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = pad_sequence(self._logprobs(self.reference, batch).split(lengths), batch_first=True)
        adv = torch.tensor([s.advantage for s in batch], device=self.device)
        rollout = torch.tensor([lp for s in batch for lp in s.rollout_logprobs], device=self.device)
        behavior = pad_sequence(rollout.split(lengths), batch_first=True)  # [N, T]
        cfg = self.config
        old, weights = off_policy_correction(cfg.off_policy, logp, behavior, cfg.tis_cap)
        loss, stats = policy_loss(
            logp, old, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high, ref_logprobs=ref,
            kl_coef=cfg.kl_coef, aggregation=cfg.aggregation, normalizer=1, weights=weights)
        lp_diff = (logp_flat.detach() - rollout).abs().sum()
        is_weight = importance_weights(logp_flat, rollout).sum()
        return loss, [stats["num_clipped_tokens"], stats["num_tokens"], stats["kl_sum"], lp_diff, is_weight]

    def _idle_loss(self) -> torch.Tensor:
        """A zero-weighted forward/backward that joins FSDP2's collectives on a rank with no work."""
        tokens = torch.zeros(1, dtype=torch.long, device=self.device)
        out = self.model(tokens, tokens, CausalAttention([1], self.device), head=lambda h, w: (h @ w.T).sum())
        return out * 0.0
