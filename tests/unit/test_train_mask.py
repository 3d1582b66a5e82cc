"""The trainer learns only the model's tokens: an episode's loss mask and step rewards (rollpacker.env)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.unit.test_train import algorithm_batch, weights


def episode_batch(env_ids: int = 40, env_logprob: float = 0.0) -> list:
    """The algorithm batch as episodes: each response is model tokens, then 3 environment tokens, then
    model tokens, then 2 trailing environment tokens (``env_ids`` and ``env_logprob`` fill the trailing ones)."""
    samples = []
    for s in algorithm_batch():
        n = len(s.response_ids)
        first, second = s.response_ids[:max(1, n // 2)], s.response_ids[max(1, n // 2):] or [7]
        lps = s.rollout_logprobs + [-0.5] * (len(first) + len(second) - n)
        ids = [*first, 30, 31, 32, *second, env_ids, env_ids + 1]
        mask = [True] * len(first) + [False] * 3 + [True] * len(second) + [False] * 2
        logprobs = [*lps[:len(first)], 0.0, 0.0, 0.0, *lps[len(first):], env_logprob, env_logprob]
        samples.append(dataclasses.replace(s, response_ids=ids, rollout_logprobs=logprobs, loss_mask=mask))
    return samples


def trainer(toy_random_dir, **kw):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, **kw)
    return Trainer(load_model(toy_random_dir), cfg, build_meshes(1, 0).train, temperature=0.8, num_steps=2)


def step(toy_random_dir, samples, **kw) -> tuple[dict, dict]:
    from rollpacker.train.losses import normalizer
    from rollpacker.train.trainer import trained_lengths

    t = trainer(toy_random_dir, **kw)
    cfg = t.config
    stats = t.step(samples, normalizer(cfg.aggregation, trained_lengths(samples, cfg.mask_truncated), 64))
    return stats, weights(t)


@pytest.mark.parametrize("kw", [{}, {"rollout_correction": "token_tis", "aggregation": "seq-mean-token-mean"},
                                {"advantage": "reinforce_pp", "loss": "gspo", "entropy_coef": 0.01}])
def test_masked_tokens_cannot_change_the_loss_or_the_gradients(toy_random_dir, kw):
    """Rewriting the environment's trailing tokens and the log-probs at masked positions changes no
    update, no loss and no statistic: bitwise."""
    stats, after = step(toy_random_dir, episode_batch(), **kw)
    other_stats, other = step(toy_random_dir, episode_batch(env_ids=50, env_logprob=-7.5), **kw)
    assert stats == other_stats
    assert all(torch.equal(after[k], other[k]) for k in after)
    assert stats["train/loss"] != 0.0


def test_the_counts_are_the_model_tokens(toy_random_dir):
    from rollpacker.train.trainer import Sample, trained_lengths

    samples = episode_batch()
    assert trained_lengths(samples, False) == [sum(s.loss_mask) for s in samples]
    assert trained_lengths([Sample([1], [2, 3], 0.0, [0.0, 0.0], loss_mask=[False, False])], False) == []
    t = trainer(toy_random_dir)
    assert t._units(samples) == sum(sum(s.loss_mask) for s in samples)
    t.step(samples, t._units(samples))
    assert t.updates[0]["train/ratio_dev"] == 0.0
    tokens = sum(sum(s.loss_mask) for s in samples)  # the mean entropy is over the model's tokens
    loss, stats = t._loss(samples, t._prepare(samples))
    assert stats[0].item() == tokens


def test_an_episode_that_trains_nothing_changes_nothing(toy_random_dir):
    samples = [dataclasses.replace(s, loss_mask=[False] * len(s.response_ids)) for s in episode_batch()]
    t = trainer(toy_random_dir)
    before = weights(t)
    stats = t.step(samples, 1)
    assert stats["train/loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in weights(t).items())


@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp"])
def test_a_one_turn_episode_trains_bitwise_as_a_single_turn_response(toy_random_dir, advantage):
    """A one-turn episode: every token the model's, the environment's reward on its last token (a
    step reward), no reward function. It trains exactly as the response with that reward."""
    single = algorithm_batch()
    episodes = [dataclasses.replace(s, reward=0.0, loss_mask=[True] * len(s.response_ids),
                                    token_rewards={len(s.response_ids) - 1: s.reward}) for s in single]
    stats, after = step(toy_random_dir, single, advantage=advantage)
    episode_stats, episode_after = step(toy_random_dir, episodes, advantage=advantage)
    assert stats == episode_stats
    assert all(torch.equal(after[k], episode_after[k]) for k in after)


def test_step_rewards_reach_the_tokens_before_them(toy_random_dir):
    """Returns to go: a step reward counts for the tokens up to its action's last token, not after it;
    the environment's tokens get no advantage of their own."""
    from rollpacker.train.trainer import Sample

    t = trainer(toy_random_dir, advantage="reinforce_pp")
    mask = [True, True, False, False, True, True]
    a = Sample([5, 6], [7, 8, 30, 31, 9, 10], 0.0, [-1.0] * 6, loss_mask=mask, token_rewards={1: 1.0})
    b = Sample([5, 6], [7, 8, 30, 31, 9, 10], 0.0, [-1.0] * 6, loss_mask=mask, token_rewards={5: 1.0})
    adv_a, adv_b = (p.advantages for p in t._prepare([a, b]))
    assert adv_a[0] == adv_a[1] > adv_a[4] == adv_a[5]  # the reward is behind tokens 4 and 5
    assert adv_b[0] == adv_b[1] == adv_b[4] == adv_b[5]  # ... and ahead of all of b's
    assert adv_a[0] > 0 > adv_a[4]
    model = torch.cat([adv_a[torch.tensor(mask)], adv_b[torch.tensor(mask)]])
    assert model.mean().item() == pytest.approx(0.0, abs=1e-6)  # whitened over the model's tokens alone
    assert model.std().item() == pytest.approx(1.0, abs=1e-5)
