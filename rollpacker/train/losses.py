"""GRPO advantages and the PPO-clip policy loss, as small pure functions over tensors.

How this differs from the paper (RollPacker builds on GRPO/DAPO and leaves the loss unchanged):

* Advantages use the **unbiased** group std (``torch.std``, as verl does), and a group whose
  rewards are all equal gets advantage exactly 0 instead of ``0 / eps``. ``scale_by_std=False``
  gives Dr.GRPO's mean-centering only.
* The clip range is asymmetric (``clip_low``, ``clip_high``: DAPO's clip-higher); the defaults
  are the symmetric 0.2 of PPO/GRPO.
* The KL penalty to a reference policy is GRPO's k3 estimator added per token, off by default
  (``kl_coef=0``), as in DAPO.
* Off-policy samples (``sorted_partial``: tokens sampled by earlier weights) are corrected with the
  engine's log-probs (the *behavior* policy) by :func:`off_policy_correction`: ``is`` takes the PPO
  ratio against them, ``tis`` keeps the on-policy ratio and weights each token by a truncated
  importance weight (verl/FlashRL's TIS).
* The loss is normalized by a **global** count passed in by the caller (all response tokens, or
  all sequences, of the RL step across ranks and micro-batches), not by a per-micro-batch mean,
  so the update does not depend on how samples were spread over ranks and micro-batches.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token", "seq-mean")
OFF_POLICY = ("none", "is", "tis")


def group_advantages(rewards: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages: rewards [num_groups, group_size] -> advantages [num_groups, group_size].

    ``(r - mean_group) / (std_group + eps)`` with the unbiased std (Bessel's correction), or
    ``r - mean_group`` when ``scale_by_std`` is False. A group whose rewards are all equal
    (including a group of one) gets exactly 0: it carries no learning signal.
    """
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # [num_groups, 1]
    flat = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)  # [num_groups, 1]
    adv = rewards - mean
    if scale_by_std and rewards.shape[1] > 1:
        std = rewards.std(dim=1, keepdim=True)  # unbiased; [num_groups, 1]
        adv = adv / (std + eps)
    return torch.where(flat, torch.zeros_like(adv), adv)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(policy || reference): ``exp(d) - d - 1`` with ``d = ref - logp``.

    Non-negative, unbiased for the KL under samples from the policy. Shapes: any, equal.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def importance_weights(proximal: Tensor, behavior: Tensor, cap: float | None = None) -> Tensor:
    """Per-token importance weights ``exp(proximal - behavior)``, truncated at ``cap`` when given, no grad.

    ``proximal``: log-probs of the sampled tokens under the current weights (before this step's update);
    ``behavior``: under the weights that sampled them (the engine's). Shapes: any, equal.
    """
    w = torch.exp(proximal.detach() - behavior)
    return w if cap is None else w.clamp(max=cap)


def off_policy_correction(mode: str, proximal: Tensor, behavior: Tensor,
                          tis_cap: float) -> tuple[Tensor, Tensor | None]:
    """The ``old_logprobs`` and per-token ``weights`` of :func:`policy_loss` for ``mode``:

    * ``"none"`` (on-policy): old = ``proximal`` detached (ratio 1 at the step's start), no weights;
    * ``"is"``: old = ``behavior``: the clipped PPO ratio is taken against the policy that sampled
      the tokens (its clip bounds the importance weight);
    * ``"tis"`` (truncated IS, verl/FlashRL): old = ``proximal`` detached as on-policy, and each token's
      PPO term is weighted by ``min(exp(proximal - behavior), tis_cap)``, detached.
    """
    if mode not in OFF_POLICY:
        raise ValueError(f"off_policy={mode!r}: expected one of {OFF_POLICY}")
    if mode == "is":
        return behavior, None
    return proximal.detach(), importance_weights(proximal, behavior, tis_cap) if mode == "tis" else None


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    aggregation: str = "token",
    normalizer: float | Tensor,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip loss of one micro-batch, normalized so micro-batch losses **sum** to the step loss.

    Shapes: ``logprobs``, ``old_logprobs``, ``ref_logprobs``, ``mask``: [N, T] (mask: 1/True on
    response tokens, float or bool; other positions may hold anything, even inf);
    ``advantages``: [N], one per sequence, broadcast over its tokens.

    Per token: ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``, times ``weights``
    [N, T] when given (truncated IS, no grad), plus ``kl_coef * k3_kl(logprobs, ref_logprobs)`` when a
    reference is given.

    Aggregation, and the contract on ``normalizer``:

    * ``"token"`` (DAPO token-level): sum over the masked tokens / ``normalizer``, which must be
      the global number of response tokens of the whole RL step, over all ranks and micro-batches.
    * ``"seq-mean"``: sum over sequences of each sequence's token mean / ``normalizer``, which must
      be the global number of sequences of the step (a sequence with no response token adds 0).

    With these normalizers, summing the returned loss over every micro-batch of every rank (i.e.
    accumulating gradients, then all-reducing with SUM) gives exactly the full-batch loss, whatever
    the split. Returns ``(loss, stats)``; ``stats`` holds detached sums over this micro-batch, to be
    all-reduced with SUM: ``num_clipped_tokens`` (tokens where the clipped term is the active one),
    ``ratio_sum``, ``kl_sum`` (0 without a reference), ``num_tokens``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation={aggregation!r}: expected one of {AGGREGATIONS}")
    mask = mask.bool()  # [N, T]
    # Zero the log-ratio off the mask first, so garbage there cannot make inf/NaN values or grads.
    log_ratio = torch.where(mask, logprobs - old_logprobs, 0.0)  # [N, T]
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None].to(ratio.dtype)  # [N, 1]
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * adv
    token_loss = torch.maximum(unclipped, clipped)  # = -min(ratio * A, clip(ratio) * A); [N, T]
    if weights is not None:
        token_loss = token_loss * torch.where(mask, weights.detach(), 0.0)
    kl = torch.zeros_like(token_loss)
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, torch.where(mask, ref_logprobs, logprobs))  # 0 off the mask
        if kl_coef:
            token_loss = token_loss + kl_coef * kl
    token_loss = torch.where(mask, token_loss, 0.0)

    if aggregation == "token":
        loss = token_loss.sum() / normalizer
    else:
        num_tokens_per_seq = mask.sum(dim=1).clamp(min=1)  # [N]
        loss = (token_loss.sum(dim=1) / num_tokens_per_seq).sum() / normalizer

    with torch.no_grad():
        stats = {
            "num_clipped_tokens": (mask & (clipped > unclipped)).sum().float(),
            "ratio_sum": torch.where(mask, ratio, 0.0).sum(),
            "kl_sum": torch.where(mask, kl, 0.0).sum(),
            "num_tokens": mask.sum().float(),
        }
    return loss, stats
