"""Advantage estimators: a step's returns and its groups in, each token's advantage out.

An estimator is a pure function ``(returns [N, T], mask [N, T], sizes) -> advantages [N, T]``.
``returns[i, t]`` is response i's reward-to-go from token t; ``returns[i, 0]`` is its whole
return. ``sizes`` are the group sizes, in order. :data:`ADVANTAGES` registers each by name.
:func:`gae` is PPO's with a critic: per-token rewards and the critic's values in instead.
:func:`gdpo` takes returns whose rewards :func:`decoupled` made from each reward part alone.

Invariants:

- ``per_group`` says whether a group's advantages depend on its own returns alone. Stream
  training trains a group as soon as it completes, so it needs that.
- A group (or batch) whose returns are all equal gets advantage exactly 0.
- A sample left out (:func:`leaving_out`) shifts no group's statistics, and its advantages are 0.
- Torch is not imported here, so the config can read ``per_group`` before torch loads.

Why pure functions: an estimator is its paper's formula, checked by hand on small tensors. The
estimators and how they depart from their papers: ``docs/algorithms.md``. :func:`overlong_penalty`
is DAPO's length shaping, a reward term the controller adds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch import Tensor

EPS = 1e-6


def group_centred(returns: Tensor, sizes: list[int], *, scale: bool, leave_one_out: bool = False) -> Tensor:
    """Per group, each response's return minus the group's mean (or the mean of the others:
    ``leave_one_out``), over the group's std if ``scale``; 0 in a group whose returns are all equal."""
    scores = returns[:, 0].float()  # [N] the whole response's return
    adv = scores.new_zeros(scores.shape)
    start = 0
    for n in sizes:
        r = scores[start:start + n][None]  # [1, n]
        flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
        if leave_one_out:
            a = r - (r.sum(dim=1, keepdim=True) - r) / max(n - 1, 1)
        else:
            a = r - r.mean(dim=1, keepdim=True)
        if scale and n > 1:
            a = a / (r.std(dim=1, keepdim=True) + EPS)  # unbiased std
        adv[start:start + n] = a.masked_fill(flat, 0.0)[0]
        start += n
    return adv[:, None].expand(returns.shape)


def whiten(values: Tensor, mask: Tensor) -> Tensor:
    """``(values - mean) / (std + eps)`` over the masked entries; 0 if they are all equal."""
    kept = values[mask]
    if kept.numel() < 2 or bool(kept.amax() == kept.amin()):
        return values.new_zeros(values.shape)
    return (values - kept.mean()) / (kept.std() + EPS)


def grpo(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    return group_centred(returns, sizes, scale=True)


def dr_grpo(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    return group_centred(returns, sizes, scale=False)


def grpo_batch_std(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    """Each return minus its group's mean, over the std of the step's returns, one per response (TRL's
    scale_rewards="batch", LitePPO's group mean and batch std): a group of near-equal rewards is not magnified
    as by its own std."""
    centred = group_centred(returns, sizes, scale=False)
    scores = returns[:, 0].float()
    return centred if scores.numel() < 2 else centred / (scores.std() + EPS)


def rloo(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    return group_centred(returns, sizes, scale=False, leave_one_out=True)


def reinforce_pp(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    return whiten(returns.float(), mask)


def reinforce_pp_baseline(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    return whiten(group_centred(returns, sizes, scale=False), mask)


def gdpo(returns: Tensor, mask: Tensor, sizes: list[int]) -> Tensor:
    """GDPO's second stage: each response's whole return (:func:`decoupled`'s sum, with the rest of its reward)
    whitened over the step's responses, one each (TRL's normalize_then_sum); 0 if they are all equal."""
    scores = returns[:, 0].float()
    if scores.numel() < 2 or bool(scores.amax() == scores.amin()):
        return returns.float().new_zeros(returns.shape)
    return ((scores - scores.mean()) / (scores.std() + EPS))[:, None].expand(returns.shape)


def decoupled(parts: Tensor, weights: Tensor, sizes: list[int]) -> Tensor:
    """GDPO's first stage (Liu et al. 2026): parts [N, K] (each response's value of each reward part; NaN: it did
    not apply), weights [K] -> [N], per group each part centred and scaled by its own mean and unbiased std
    over the responses it applies to, then weighted and summed; NaN where no part applies."""
    out = parts.new_full(parts.shape[:1], float("nan"))
    start = 0
    for n in sizes:
        v = parts[start:start + n]  # [n, K]
        on = ~v.isnan()
        count = on.sum(0)  # [K]
        mean = v.nan_to_num(0.0).sum(0) / count.clamp(min=1)
        centred = (v - mean).nan_to_num(0.0)
        std = (centred.square().sum(0) / (count - 1).clamp(min=1)).sqrt()
        total = (centred / (std + EPS) * weights).sum(1)
        out[start:start + n] = total.where(on.any(1), float("nan"))
        start += n
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over each response's model tokens.

    rewards [N, T] (the reward earned at each token; off the response, 0), values [N, T] (the critic's value
    of the state before each token), mask [N, T] (the model's tokens) -> (advantages, returns = advantages +
    values), both [N, T], 0 off the mask. A token off the mask (an environment's) is no action: the
    recursion passes over it, its reward joining the model token before it (verl's multi-turn GAE drops it).
    """
    rewards, values = rewards.float(), values.float()
    adv = values.new_zeros(values.shape)
    last = next_value = pending = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        on = mask[:, t]
        reward = rewards[:, t] + pending
        delta = reward + gamma * next_value - values[:, t]
        step = delta + gamma * lam * last
        last, next_value = step.where(on, last), values[:, t].where(on, next_value)
        pending = reward.where(~on, 0.0)
        adv[:, t] = step.where(on, 0.0)
    return adv, (adv + values).where(mask, 0.0)


@dataclass(frozen=True)
class Estimator:
    fn: Callable[[Tensor, Tensor, list[int]], Tensor] | None
    """``(returns [N, T], mask [N, T], group sizes) -> advantages [N, T]``; None: :func:`gae`, from the
    critic's values."""
    per_group: bool
    """A group's advantages depend on its own returns alone (stream training needs this)."""
    group_baseline: bool = True
    """Its baseline is the group's (a group of one response has advantage 0: nothing trains)."""


ADVANTAGES = {
    "grpo": Estimator(grpo, per_group=True),
    "dr_grpo": Estimator(dr_grpo, per_group=True),
    "grpo_batch_std": Estimator(grpo_batch_std, per_group=False),
    "rloo": Estimator(rloo, per_group=True),
    "reinforce_pp": Estimator(reinforce_pp, per_group=False, group_baseline=False),
    "reinforce_pp_baseline": Estimator(reinforce_pp_baseline, per_group=False),
    "gae": Estimator(None, per_group=False, group_baseline=False),  # whitened over the step's batch, as verl's
    "gdpo": Estimator(gdpo, per_group=False),  # on decoupled rewards (Sample.parts), each normalized in its group
}
"""``train.advantage`` -> its estimator."""


def leaving_out(fn: Callable[[Tensor, Tensor, list[int]], Tensor], returns: Tensor, mask: Tensor,
                sizes: list[int], kept: list[bool]) -> Tensor:
    """``fn``'s advantages [N, T] computed over the ``kept`` samples alone, as if the others were not
    in the batch (their groups smaller, a group of none gone); the others' advantages are 0."""
    if all(kept):
        return fn(returns, mask, sizes)
    keep = mask.new_tensor(kept)  # [N] bool
    kept_sizes, start = [], 0
    for n in sizes:
        kept_sizes.append(sum(kept[start:start + n]))
        start += n
    adv = returns.float().new_zeros(returns.shape)
    if any(kept):
        adv[keep] = fn(returns[keep], mask[keep], [n for n in kept_sizes if n])
    return adv


def returns_to_go(rewards: Tensor, mask: Tensor, token_rewards: Tensor | None = None,
                  earned: Tensor | None = None) -> Tensor:
    """rewards [N] (each response's whole reward), mask [N, T], per-token rewards [N, T] or None (added
    from their token on: KL, a teacher), earned [N, T] or None (parts of the reward earned at a token:
    an episode's step rewards, which a later token's return leaves out) -> each token's return [N, T]
    (no discount)."""
    returns = rewards.float()[:, None].expand(mask.shape)
    if earned is not None:
        returns = returns - (earned.cumsum(1) - earned)
    if token_rewards is None:
        return returns
    after = token_rewards.where(mask, 0.0).flip(1).cumsum(1).flip(1)
    return returns + after


def earned_at(returns: Tensor, within: Tensor) -> Tensor:
    """returns [N, T] (undiscounted, :func:`returns_to_go`), within [N, T] (each response's tokens) -> the
    reward earned at each token [N, T]: the return's drop to the next token; at the last, all that is left."""
    after = returns.new_zeros(returns.shape)
    after[:, :-1] = returns[:, 1:].where(within[:, 1:], 0.0)
    return (returns - after).where(within, 0.0)


def overlong_penalty(length: int, max_tokens: int, buffer: int, penalty: float) -> float:
    """DAPO's soft overlong punishment (its eq. 13), scaled by ``penalty``: 0 up to ``max_tokens -
    buffer`` tokens, then falling linearly to ``-penalty`` at ``max_tokens`` (and below, beyond)."""
    if not buffer or length <= max_tokens - buffer:
        return 0.0
    return -penalty * min(1.0, (length - (max_tokens - buffer)) / buffer)
