"""Advantage estimators and DAPO's overlong punishment against values computed by hand from their
papers' formulas, with the edge cases (a group of one, all-equal rewards, an empty mask)."""

from __future__ import annotations

import pytest
import torch

from rollpacker.train.advantages import (
    ADVANTAGES,
    decoupled,
    earned_at,
    gae,
    leaving_out,
    overlong_penalty,
    returns_to_go,
)

OF_RETURNS = sorted(name for name, e in ADVANTAGES.items() if e.fn)
"""The estimators of returns alone (gae's takes the critic's values: its own tests)."""


def estimate(name: str, rewards: list[float], sizes: list[int], lengths: list[int] | None = None,
             token_rewards: torch.Tensor | None = None) -> torch.Tensor:
    lengths = lengths or [1] * len(rewards)
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    returns = returns_to_go(torch.tensor(rewards), mask, token_rewards)
    return ADVANTAGES[name].fn(returns, mask, sizes)


def test_grpo_hand_computed():
    # Group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    #   -> +-0.5 / 0.5773503 = +-0.8660254.
    # Group 1: mean 0.75, deviations (0.25, 0.25, 0.25, -0.75), var = (3 * 0.0625 + 0.5625) / 3
    #   = 0.25, std = 0.5 -> (0.5, 0.5, 0.5, -1.5).
    adv = estimate("grpo", [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [4, 4])[:, 0]
    want = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254, 0.5, 0.5, 0.5, -1.5])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)


def test_dr_grpo_and_rloo_hand_computed():
    rewards, sizes = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [4, 4]
    # Dr. GRPO: centred only.
    torch.testing.assert_close(estimate("dr_grpo", rewards, sizes)[:, 0],
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]))
    # RLOO: minus the mean of the group's other responses. Group 0: 1 - 1/3, 0 - 2/3;
    # group 1: 1 - 2/3, 0 - 1.
    torch.testing.assert_close(estimate("rloo", rewards, sizes)[:, 0],
                               torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 1 / 3, 1 / 3, 1 / 3, -1.0]))


def test_grpo_batch_std_hand_computed():
    # Centred as Dr. GRPO: (0.5, -0.5, 0, 0, 0.25, 0.25, 0.25, -0.75); the 8 rewards (6 ones, 2 zeros) have mean
    # 0.75 and unbiased std sqrt((6 * 0.25^2 + 2 * 0.75^2) / 7) = 0.4629100. The flat group (1, 1) stays 0.
    rewards, sizes = [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0], [2, 2, 4]
    adv = estimate("grpo_batch_std", rewards, sizes)[:, 0]
    want = torch.tensor([0.5, -0.5, 0.0, 0.0, 0.25, 0.25, 0.25, -0.75]) / 0.4629100
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)


def test_reinforce_pp_whitens_every_token_of_the_batch():
    # Rewards (1, 0), lengths (1, 3): token returns (1 | 0, 0, 0). Mean 0.25, unbiased std
    # sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5 -> (1.5 | -0.5, -0.5, -0.5).
    adv = estimate("reinforce_pp", [1.0, 0.0], [1, 1], [1, 3])
    torch.testing.assert_close(adv[0, :1], torch.tensor([1.5]), atol=1e-5, rtol=0)
    torch.testing.assert_close(adv[1], torch.tensor([-0.5, -0.5, -0.5]), atol=1e-5, rtol=0)
    # With the KL in the reward: token rewards (-0.1, -0.2, -0.3) make returns-to-go
    # (1 - 0.6, 1 - 0.5, 1 - 0.3) = (0.4, 0.5, 0.7): mean 1.6 / 3, unbiased std 0.1527525.
    mask = torch.ones(1, 3, dtype=torch.bool)
    returns = returns_to_go(torch.tensor([1.0]), mask, torch.tensor([[-0.1, -0.2, -0.3]]))
    torch.testing.assert_close(returns, torch.tensor([[0.4, 0.5, 0.7]]))
    mean, std = 1.6 / 3, 0.1527525
    torch.testing.assert_close(ADVANTAGES["reinforce_pp"].fn(returns, mask, [1]),
                               (torch.tensor([[0.4, 0.5, 0.7]]) - mean) / (std + 1e-6), atol=1e-5, rtol=0)


def test_reinforce_pp_baseline_hand_computed():
    # Groups (1, 0) and (1, 1): centred (0.5, -0.5, 0, 0); whitened over the 4 tokens: mean 0,
    # unbiased std sqrt(0.5 / 3) = 0.4082483 -> (1.2247449, -1.2247449, 0, 0).
    adv = estimate("reinforce_pp_baseline", [1.0, 0.0, 1.0, 1.0], [2, 2])[:, 0]
    torch.testing.assert_close(adv, torch.tensor([1.2247449, -1.2247449, 0.0, 0.0]), atol=1e-5, rtol=0)


def test_gdpo_hand_computed():
    """Each part normalized in its group over the responses it applies to, then weighted (1, 2) and summed.
    Group 0, part 0 (1, 0, 1): mean 2/3, unbiased std sqrt(1/3) -> (0.5773503, -1.1547005, 0.5773503); part 1
    (0.5, -, 0.1): mean 0.3, std 0.2828427 -> (0.7071068, 0, -0.7071068). Group 1 applies nothing: NaN. Group 2
    (one response): 0. Then GDPO whitens each response's return over the step."""
    nan = float("nan")
    parts = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 0.1], [nan, nan], [nan, nan], [1.0, nan]])
    out = decoupled(parts, torch.tensor([1.0, 2.0]), [3, 2, 1])
    expected = torch.tensor([0.5773503 + 2 * 0.7071068, -1.1547005, 0.5773503 - 2 * 0.7071068, nan, nan, 0.0])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0, equal_nan=True)
    # scores (3, 1, 2): mean 2, unbiased std 1 -> (1, -1, 0), the same on every token
    whitened = estimate("gdpo", [3.0, 1.0, 2.0], [1, 2], [2, 1, 3])[:, 0]
    torch.testing.assert_close(whitened, torch.tensor([1.0, -1.0, 0.0]))


@pytest.mark.parametrize("name", OF_RETURNS)
def test_edge_cases_give_exactly_zero(name):
    # All-equal rewards (0.7 has no exact float: a mean need not give exactly 0 without the check).
    assert (estimate(name, [0.7, 0.7, 0.7], [3]) == 0).all()
    # Groups of one: nothing to compare with (GRPO's unbiased std would be NaN).
    single = estimate(name, [3.0, 1.0], [1, 1])
    if ADVANTAGES[name].per_group:
        assert (single == 0).all()
    assert torch.isfinite(single).all()
    # No response token at all.
    mask = torch.zeros(2, 1, dtype=torch.bool)
    adv = ADVANTAGES[name].fn(returns_to_go(torch.tensor([1.0, 0.0]), mask), mask, [2])
    assert torch.isfinite(adv).all()


@pytest.mark.parametrize("name", OF_RETURNS)
def test_per_group_is_what_stream_training_relies_on(name):
    """A per-group estimator gives each group, alone, bitwise what it gives it inside the batch."""
    g = torch.Generator().manual_seed(0)
    rewards, sizes, lengths = torch.rand(9, generator=g).tolist(), [4, 2, 3], [3, 1, 5, 2, 2, 4, 1, 1, 3]
    whole = estimate(name, rewards, sizes, lengths)
    alone, start = [], 0
    for n in sizes:
        part = estimate(name, rewards[start:start + n], [n], lengths[start:start + n])
        alone.append(torch.nn.functional.pad(part, (0, whole.shape[1] - part.shape[1])))
        start += n
    mask = torch.arange(whole.shape[1])[None, :] < torch.tensor(lengths)[:, None]
    same = torch.equal(torch.where(mask, whole, 0), torch.where(mask, torch.cat(alone), 0))
    assert same == ADVANTAGES[name].per_group


def test_gae_hand_computed_and_an_environments_tokens_are_no_actions():
    # gamma 0.9, lambda 0.5; response 0: three model tokens, reward 1 at the last; response 1: one token, reward 0
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.2, 0.1], [0.3, 9.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv, returns = gae(rewards, values, mask, 0.9, 0.5)
    # delta = r + 0.9 V' - V: 0.9, 0 + 0.09 - 0.2 = -0.11, 0 + 0.18 - 0.5 = -0.32; A = delta + 0.45 A'
    torch.testing.assert_close(adv, torch.tensor([[-0.32 + 0.45 * 0.295, -0.11 + 0.45 * 0.9, 0.9],
                                                  [-0.3, 0.0, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[0.5 - 0.18725, 0.2 + 0.295, 1.0], [0.0, 0.0, 0.0]]))
    # gamma = lambda = 1: each token's advantage is its return minus its value
    assert torch.allclose(gae(rewards, values, mask, 1.0, 1.0)[0][0], torch.tensor([0.5, 0.8, 0.9]))
    # an environment's token (off the mask) between two model tokens: passed over, its reward (0.5) joining the
    # model token before it; its own advantage 0. A step reward at a model token stays there.
    env = torch.tensor([[True, False, True], [True, True, False]])
    values = torch.tensor([[0.5, 7.0, 0.1], [0.3, 0.0, 7.0]])  # an environment token's value is never read
    adv, _ = gae(torch.tensor([[0.0, 0.5, 1.0], [0.0, 1.0, 0.0]]), values, env, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5 + 0.1 - 0.5 + 0.9, 0.0, 0.9], [-0.3 + 1.0, 1.0, 0.0]]))


def test_earned_at_recovers_each_tokens_reward_from_the_returns():
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    token_rewards = torch.tensor([[-0.1, -0.2, 0.0, -0.3], [-0.5, 0.25, 9.0, 9.0]])
    earned = torch.tensor([[0.0, 0.4, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])  # an episode's step reward at token 1
    returns = returns_to_go(torch.tensor([1.0, 2.0]), mask, token_rewards, earned=earned)
    torch.testing.assert_close(earned_at(returns, mask), torch.tensor([[-0.1, 0.4 - 0.2, 0.0, 0.6 - 0.3],
                                                                       [-0.5, 2.0 + 0.25, 0.0, 0.0]]))


def test_overlong_penalty_hand_computed():
    # DAPO eq. 13 with L_max = 100, L_cache = 20: 0 up to 80 tokens, then linear down to -1 at 100.
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (10, 80, 90, 95, 100)] == [0.0, 0.0, -0.5, -0.75, -1.0]
    assert overlong_penalty(90, 100, 20, 0.5) == -0.25
    assert overlong_penalty(100, 100, 0, 1.0) == 0.0  # off


def test_a_sample_left_out_is_absent_to_the_estimator():
    # Group 0 (1, 5, 0) with the 5 left out is the group (1, 0): mean 0.5, unbiased std 0.7071068
    # -> +-0.7071. Group 1 (2) left out entirely: gone. Group 2 (1, 1): all equal -> 0.
    returns = torch.tensor([1.0, 5.0, 0.0, 2.0, 1.0, 1.0])[:, None].expand(6, 2)
    mask = torch.ones(6, 2, dtype=torch.bool)
    adv = leaving_out(ADVANTAGES["grpo"].fn, returns, mask, [3, 1, 2], [True, False, True, False, True, True])
    torch.testing.assert_close(adv[:, 0], torch.tensor([0.7071068, 0.0, -0.7071068, 0.0, 0.0, 0.0]), atol=1e-5, rtol=0)
    # with it in, the correct answer (1) would have a negative advantage: (1 - 2) / 2.6458 = -0.378
    assert ADVANTAGES["grpo"].fn(returns, mask, [3, 1, 2])[0, 0] < 0
    assert not leaving_out(ADVANTAGES["rloo"].fn, returns, mask, [3, 1, 2], [False] * 6).any()
