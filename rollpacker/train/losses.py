"""Policy losses, their aggregation, KL estimators and rollout correction, as small pure functions.

Every function takes per-token tensors ``[N, T]`` (N responses, T the longest) and a boolean
``mask`` of real response tokens. The registries (:data:`LOSSES`, :data:`AGGREGATIONS`,
:data:`KL_ESTIMATORS`, :data:`CORRECTIONS`) name them for ``train.*``.
:func:`policy_objective` puts them together; the trainer calls only it.

Invariants:

- Values off the mask may be anything, even inf or NaN; none reaches a loss or a gradient.
- Losses are sums over a micro-batch, never means. The trainer divides by one global count
  (:func:`normalizer`), so the update does not depend on how samples were split.
- A rollout correction weighs the policy term only.

Why: each formula is a few lines, tested on CPU against hand-computed values. How each departs
from its paper (GSPO's token form, CISPO's bounds, SAPO's): ``docs/algorithms.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

# --- policy losses --------------------------------------------------------------------------------


LOG_RATIO_BOUND = 20.0
GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's sequence log-ratio is clamped above at this, as verl's compute_policy_loss_gspo (not below)."""
"""A token's log-ratio is clamped to +-this before ``exp`` (as verl's): a ratio past float32's range (log r > 88)
made the step's gradient NaN (``inf * 0`` through the branch ``min`` or the gate did not take), and skipped the
step; at the bound its gradient is 0, as PPO's clip makes it there anyway for A > 0."""


def ratio_of(logp: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """``exp(logp - old)`` on the mask (its log clamped to +-LOG_RATIO_BOUND), 1 off it."""
    return torch.exp(torch.where(mask, logp - old, 0.0).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def ppo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip per token: ``-min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``, ``r = exp(logp - old)``.

    With ``cfg.dual_clip`` = c > 1, a token with A < 0 has loss at most ``-c A``. All [N, T].
    Returns the token losses, the ratios and where clipping decided (no gradient through r).
    """
    ratio = ratio_of(logp, old, mask)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    loss = torch.maximum(unclipped, clipped)
    active = clipped > unclipped
    if cfg.dual_clip:
        cap = -cfg.dual_clip * adv
        capped = (adv < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        active = active | capped
    return loss, ratio, mask & active


def gspo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """GSPO per token: PPO's clip on ``s_i = exp(mean_t (logp - old))``, the sequence's length-normalized ratio.

    Each token's ratio has the value ``s_i`` and the gradient ``s_i * grad logp_t`` (GSPO-token), its log
    clamped above at GSPO_LOG_RATIO_MAX, as verl's. A response with no token on the mask has ``s_i = 1``. All [N, T].
    """
    log_ratio = torch.where(mask, logp - old, 0.0)  # [N, T]
    seq = log_ratio.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)  # [N, 1]
    token_form = seq.detach() + log_ratio - log_ratio.detach()  # value log s_i, gradient per token
    ratio = torch.exp(token_form.clamp(max=GSPO_LOG_RATIO_MAX))
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv
    return torch.maximum(unclipped, clipped), ratio, mask & (clipped > unclipped)


def cispo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """CISPO per token: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * logp``.

    The weight is clipped, not the token: every token keeps a gradient. All [N, T].
    """
    logp = torch.where(mask, logp, 0.0)
    ratio = ratio_of(logp, old, mask)
    weight = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high).detach()
    return -weight * adv * logp, ratio, mask & (weight != ratio)


def sapo(logp: Tensor, old: Tensor, adv: Tensor, mask: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """SAPO per token: ``-(4 / tau) sigmoid(tau (r - 1)) A``, ``tau`` = ``cfg.tau_pos`` where A > 0, else
    ``cfg.tau_neg``: a soft gate in place of PPO's clip.

    Its gradient is ``4 g (1 - g) r A grad logp`` (g the gate): the plain policy gradient at r = 1, fading
    smoothly as r leaves 1, faster under the larger tau. "Clipped": tokens whose gate passes under half
    that gradient. All [N, T].
    """
    ratio = ratio_of(logp, old, mask)
    tau = torch.where(adv > 0, cfg.tau_pos, cfg.tau_neg)
    gate = torch.sigmoid(tau * (ratio - 1))
    g = gate.detach()
    return -(4 / tau) * gate * adv, ratio, mask & (4 * g * (1 - g) < 0.5)


LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {"ppo": ppo, "gspo": gspo, "cispo": cispo,
                                                                   "sapo": sapo}
"""``train.loss`` -> ``(logp, old, adv, mask, cfg) -> (token losses, ratios, clipped)``, all [N, T]."""

# --- aggregation ----------------------------------------------------------------------------------


def _token_sum(loss: Tensor, mask: Tensor) -> Tensor:
    return loss.sum()


def _seq_token_mean(loss: Tensor, mask: Tensor) -> Tensor:
    return (loss.sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()


@dataclass(frozen=True)
class Aggregation:
    reduce: Callable[[Tensor, Tensor], Tensor]
    """(token losses [N, T], mask [N, T]) -> the micro-batch's sum."""
    per_token: bool
    """The global count is of tokens (else of responses)."""
    scaled: bool = False
    """The count is also multiplied by a constant: the longest response allowed (Dr. GRPO)."""


AGGREGATIONS = {
    "token-mean": Aggregation(_token_sum, per_token=True),
    "seq-mean-token-mean": Aggregation(_seq_token_mean, per_token=False),
    "seq-mean-token-sum": Aggregation(_token_sum, per_token=False),
    "seq-mean-token-sum-norm": Aggregation(_token_sum, per_token=False, scaled=True),
}
"""``train.aggregation`` -> how a micro-batch sums its token losses and what the step counts."""


def units(aggregation: str, lengths: list[int]) -> int:
    """What ``aggregation`` counts in responses of ``lengths`` tokens: tokens or responses."""
    return sum(lengths) if AGGREGATIONS[aggregation].per_token else len(lengths)


def normalizer(aggregation: str, lengths: list[int], max_tokens: int) -> int:
    """The step's global count: :func:`units` over every response trained in the step, times
    ``max_tokens`` (the longest response allowed) for ``seq-mean-token-sum-norm``."""
    return units(aggregation, lengths) * (max_tokens if AGGREGATIONS[aggregation].scaled else 1)


# --- KL estimators --------------------------------------------------------------------------------


def k1(logp: Tensor, ref: Tensor) -> Tensor:
    """``logp - ref``: unbiased for KL(policy || reference) under the policy's samples, can be negative."""
    return logp - ref


def k2(logp: Tensor, ref: Tensor) -> Tensor:
    """``(logp - ref)^2 / 2``: biased, low variance, never negative."""
    return 0.5 * (logp - ref) ** 2


def k3(logp: Tensor, ref: Tensor) -> Tensor:
    """``exp(d) - d - 1`` with ``d = ref - logp``: unbiased and never negative (GRPO's)."""
    d = ref - logp
    return torch.exp(d) - d - 1


def low_var_kl(logp: Tensor, ref: Tensor) -> Tensor:
    """k3 with ``d`` clamped to [-20, 20] and the result to at most 10, so one token cannot blow up."""
    d = torch.clamp(ref - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(d) - d - 1, max=10.0)


KL_ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3, "low_var_kl": low_var_kl}
"""``train.kl_estimator`` -> ``(logp, ref) -> KL per token``."""


@dataclass
class KLController:
    """The KL coefficient a step uses: fixed, or adaptive with a ``target`` (Ziegler et al. 2019, as verl's
    ``AdaptiveKLController``): after a step whose mean token KL was ``kl`` over ``n`` responses, the
    coefficient is multiplied by ``1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon``."""

    value: float
    target: float = 0.0
    """0: fixed."""
    horizon: int = 10000

    def update(self, kl: float, n: float) -> None:
        if self.target:
            self.value *= 1 + min(max(kl / self.target - 1, -0.2), 0.2) * n / self.horizon


def reverse_kl(logp: Tensor, teacher: Tensor) -> Tensor:
    """Distillation's per-token reverse KL, KL(student || teacher) sampled at the student's token:
    ``log p_student - log p_teacher`` (k1; its negative is the token's reward)."""
    return k1(logp, teacher)

# --- rollout correction ---------------------------------------------------------------------------


def no_correction(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor | None, Tensor]:
    return None, mask


def token_tis(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor | None, Tensor]:
    """Truncated IS per token: ``min(rho_t, high)``."""
    return torch.exp(log_ratio).clamp(max=high), mask


def seq_tis(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor | None, Tensor]:
    """Truncated IS per response: ``min(prod_t rho_t, high)`` on each of its tokens."""
    rho = torch.exp(log_ratio.sum(dim=1, keepdim=True))  # [N, 1]
    return rho.clamp(max=high).expand_as(log_ratio), mask


def token_mask(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor | None, Tensor]:
    """Masked IS per token: weight ``rho_t`` inside ``[low, high]``; outside, the token contributes nothing."""
    rho = torch.exp(log_ratio)
    keep = mask & (rho >= low) & (rho <= high)
    return torch.where(keep, rho, 0.0), keep


def seq_mask(log_ratio: Tensor, mask: Tensor, low: float, high: float) -> tuple[Tensor | None, Tensor]:
    """Masked IS per response: weight ``prod_t rho_t`` inside ``[low, high]``; outside, nothing."""
    rho = torch.exp(log_ratio.sum(dim=1, keepdim=True)).expand_as(log_ratio)
    keep = mask & (rho >= low) & (rho <= high)
    return torch.where(keep, rho, 0.0), keep


CORRECTIONS = {"none": no_correction, "token_tis": token_tis, "seq_tis": seq_tis, "token_mask": token_mask,
               "seq_mask": seq_mask}
"""``train.rollout_correction`` -> ``(log rho [N, T], mask, low, high) -> (weights or None, tokens kept)``.
``rho = exp(old - behavior)``: the trainer's probability of the token over the engine's."""

# --- the whole objective --------------------------------------------------------------------------

STATS = ("tokens", "clipped", "ratio_dev", "kl", "entropy", "rollout_is", "rollout_is_outside", "rollout_ratio",
         "logprob_diff", "teacher_kl")
"""The sums :func:`policy_objective` returns, in this order."""


def policy_objective(logp: Tensor, old: Tensor, behavior: Tensor, adv: Tensor, mask: Tensor, cfg, *,
                     entropy: Tensor | None = None, ref: Tensor | None = None, teacher: Tensor | None = None,
                     kl_coef: float | None = None, focus: Tensor | None = None
                     ) -> tuple[Tensor, dict[str, Tensor]]:
    """One micro-batch's loss, a sum (divide by the step's :func:`normalizer`), and its stats.

    All [N, T]: ``logp`` (current log-probs, with grad), ``old`` (before this step's first update,
    no grad), ``behavior`` (the engine's), ``adv`` (advantages), ``mask`` (response tokens),
    ``entropy`` (per token, for its bonus and its metric), ``ref`` (the reference policy's, for
    the KL in the loss or its metric) and ``teacher`` (distillation's teacher's, no grad).
    ``cfg`` is the :class:`~rollpacker.train.config.TrainConfig`; ``kl_coef`` replaces its own (an adaptive KL's).
    ``focus`` [N, T] (``train.top_entropy_quantile``): the tokens whose policy term counts.

    Per token: the ``cfg.loss`` term times the ``cfg.rollout_correction`` weight (where ``focus``), plus
    ``kl_coef * KL`` (unless the KL is in the reward), plus ``teacher.coef * k2(logp, teacher)``
    with ``teacher.in_loss`` (k2's gradient is the reverse KL's: ``(logp - teacher) grad logp``),
    minus ``entropy_coef * entropy``; tokens the correction masks contribute nothing. The
    ``teacher_kl`` stat is :func:`reverse_kl`. The stats (:data:`STATS`) are detached sums, to be
    all-reduced with SUM.
    """
    mask = mask.bool()
    logp = torch.where(mask, logp, 0.0)  # garbage off the mask can make neither values nor grads
    old, behavior = torch.where(mask, old, 0.0), torch.where(mask, behavior, 0.0)
    log_rho = old - behavior  # the trainer's log-prob of each token over the engine's, no grad
    weights, keep = CORRECTIONS[cfg.rollout_correction](log_rho, mask, cfg.rollout_is_low, cfg.rollout_is_high)
    token_loss, ratio, clipped = LOSSES[cfg.loss](logp, old, adv, mask, cfg)
    if weights is not None:
        token_loss = token_loss * weights.detach()
    if focus is not None:
        token_loss = torch.where(focus, token_loss, 0.0)
    kl = torch.zeros_like(token_loss)
    if ref is not None:
        kl = KL_ESTIMATORS[cfg.kl_estimator](logp, torch.where(mask, ref, logp))
        kl_coef = cfg.kl_coef if kl_coef is None else kl_coef
        if kl_coef and not cfg.kl_in_reward:
            token_loss = token_loss + kl_coef * kl
    teacher_kl = torch.zeros_like(token_loss)
    if teacher is not None:
        teacher = torch.where(mask, teacher, logp)
        teacher_kl = reverse_kl(logp, teacher)
        if cfg.teacher.in_loss:
            token_loss = token_loss + cfg.teacher.coef * k2(logp, teacher)
    if entropy is not None:
        entropy = torch.where(mask, entropy, 0.0)
        if cfg.entropy_coef:
            token_loss = token_loss - cfg.entropy_coef * entropy
    token_loss = torch.where(keep, token_loss, 0.0)
    loss = AGGREGATIONS[cfg.aggregation].reduce(token_loss, mask)
    with torch.no_grad():
        rho = torch.exp(log_rho)
        masked = weights is None or cfg.rollout_correction.endswith("mask")
        outside = ~keep if masked else weights >= cfg.rollout_is_high  # truncated: a token's or its response's
        zero = torch.zeros((), device=logp.device)
        stats = {
            "tokens": mask.sum().float(),
            "clipped": (keep & clipped).sum().float(),
            "ratio_dev": torch.where(mask, (ratio - 1).abs(), 0.0).sum(),
            "kl": torch.where(mask, kl, 0.0).sum(),
            "entropy": entropy.sum() if entropy is not None else zero,
            "rollout_is": torch.where(mask, weights if weights is not None else 1.0, 0.0).sum(),
            "rollout_is_outside": (mask & outside).sum().float(),
            "rollout_ratio": torch.where(mask, rho, 0.0).sum(),
            "logprob_diff": log_rho.abs().sum(),
            "teacher_kl": torch.where(mask, teacher_kl, 0.0).sum(),
        }
    return loss, stats
