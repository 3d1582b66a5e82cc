"""The trainer learns only the model's tokens: an episode's loss mask and step rewards (rollpacker.env)."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from tests.unit.train.test_train import algorithm_batch, weights


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

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=64, **kw)
    return Trainer(load_model(toy_random_dir), cfg, build_meshes(1, 0).train, temperature=0.8, num_steps=2)


def step(toy_random_dir, samples, **kw) -> tuple[dict, dict]:
    from rollpacker.train.losses import normalizer
    from rollpacker.train.trainer import trained_lengths

    t = trainer(toy_random_dir, **kw)
    cfg = t.config
    stats = t.step(samples, normalizer(cfg.aggregation, trained_lengths(samples, cfg.mask_truncated), 64))
    return stats, weights(t)


def loss_and_grads(t, samples) -> tuple[float, dict, list]:
    """One micro-batch's loss, its gradients and its stats, then the gradients cleared."""
    loss, stats = t._loss(samples, t._prepare(samples))
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in t.model.named_parameters() if p.grad is not None}
    t.optimizer.zero_grad(set_to_none=True)
    return loss.item(), grads, [x.item() for x in stats]


@pytest.mark.parametrize("kw", [{}, {"rollout_correction": "token_tis", "aggregation": "seq-mean-token-mean",
                                     "advantage": "reinforce_pp", "loss": "gspo", "entropy_coef": 0.01}])
def test_masked_tokens_cannot_change_the_loss_or_the_gradients(toy_random_dir, kw):
    """Rewriting the environment's trailing tokens and the log-probs at masked positions changes
    neither the loss, nor a gradient, nor a statistic: bitwise."""
    t = trainer(toy_random_dir, **kw)
    loss, grads, stats = loss_and_grads(t, episode_batch())
    other_loss, other_grads, other_stats = loss_and_grads(t, episode_batch(env_ids=50, env_logprob=-7.5))
    assert (loss, stats) == (other_loss, other_stats) and loss != 0.0
    assert grads.keys() == other_grads.keys() and all(torch.equal(grads[k], other_grads[k]) for k in grads)


def test_the_counts_are_the_model_tokens_and_an_untrained_episode_changes_nothing(toy_random_dir):
    from rollpacker.train.trainer import Sample, trained_lengths

    samples = episode_batch()
    assert trained_lengths(samples, False) == [sum(s.loss_mask) for s in samples]
    assert trained_lengths([Sample([1], [2, 3], 0.0, [0.0, 0.0], loss_mask=[False, False])], False) == []
    t = trainer(toy_random_dir)
    tokens = sum(sum(s.loss_mask) for s in samples)
    assert t._units(samples) == tokens
    assert loss_and_grads(t, samples)[2][0] == tokens  # the stats' token count: entropy and KL are per model token
    untrained = [dataclasses.replace(s, loss_mask=[False] * len(s.response_ids)) for s in samples]
    before = weights(t)
    assert t.step(untrained, 1)["train/loss"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in weights(t).items())


def test_a_one_turn_episode_trains_bitwise_as_a_single_turn_response(toy_random_dir):
    """A one-turn episode: every token the model's, its reward earned on its last token (an environment's
    step reward), no reward function. It trains exactly as the response with that reward."""
    single = algorithm_batch()
    episodes = [dataclasses.replace(s, loss_mask=[True] * len(s.response_ids),
                                    token_rewards={len(s.response_ids) - 1: s.reward}) for s in single]
    stats, after = step(toy_random_dir, single)
    episode_stats, episode_after = step(toy_random_dir, episodes)
    assert stats == episode_stats
    assert all(torch.equal(after[k], episode_after[k]) for k in after)
    t = trainer(toy_random_dir, advantage="reinforce_pp")  # whitened per token: the returns match token by token
    assert all(torch.equal(a.advantages, b.advantages) for a, b in zip(t._prepare(single), t._prepare(episodes)))


def test_step_rewards_reach_the_tokens_before_them(toy_random_dir):
    """Returns to go: a step reward counts for the tokens up to its action's last token, not after it;
    the environment's tokens get no advantage of their own."""
    from rollpacker.train.trainer import Sample

    t = trainer(toy_random_dir, advantage="reinforce_pp")
    mask = [True, True, False, False, True, True]
    a = Sample([5, 6], [7, 8, 30, 31, 9, 10], 1.0, [-1.0] * 6, loss_mask=mask, token_rewards={1: 1.0})
    b = Sample([5, 6], [7, 8, 30, 31, 9, 10], 1.0, [-1.0] * 6, loss_mask=mask, token_rewards={5: 1.0})
    adv_a, adv_b = (p.advantages for p in t._prepare([a, b]))
    assert adv_a[0] == adv_a[1] > adv_a[4] == adv_a[5]  # the reward is behind tokens 4 and 5
    assert adv_b[0] == adv_b[1] == adv_b[4] == adv_b[5]  # ... and ahead of all of b's
    assert adv_a[0] > 0 > adv_a[4]
    model = torch.cat([adv_a[torch.tensor(mask)], adv_b[torch.tensor(mask)]])
    assert model.mean().item() == pytest.approx(0.0, abs=1e-6)  # whitened over the model's tokens alone
    assert model.std().item() == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_a_failed_episode_shifts_no_siblings_advantage(toy_random_dir, advantage):
    """An episode whose environment failed (``failed``) trains nothing, and its reward (its env
    rewards before the error plus its functions' score of its partial text) enters neither its
    group's baseline nor its std: its siblings' advantages are those of the group without it."""
    t = trainer(toy_random_dir, advantage=advantage)
    samples = episode_batch()  # groups 0 and 1, three samples each
    failed = dataclasses.replace(samples[1], reward=5.0, failed=True, loss_mask=[False] * len(samples[1].loss_mask))
    alone = t._prepare(samples[:1] + samples[2:])
    with_failed = t._prepare(samples[:1] + [failed] + samples[2:])
    assert not with_failed[1].advantages.any()
    for a, b in zip(alone, with_failed[:1] + with_failed[2:]):
        torch.testing.assert_close(a.advantages, b.advantages, atol=0, rtol=0)
    every_failed = [dataclasses.replace(s, failed=True, loss_mask=[False] * len(s.loss_mask)) for s in samples]
    assert not any(p.advantages.any() for p in t._prepare(every_failed))


def test_a_response_through_the_one_request_path_trains_bitwise_as_a_plain_single_turn_sample(toy_random_dir):
    """The one request path: a single-turn response is the one-turn episode without environment
    (:class:`~rollpacker.env.episode.Episode` with no bridge); the controller's samples of its
    :class:`~rollpacker.env.episode.Response` (loss mask all the model's, no step reward) train bitwise as
    the plain samples of the engine's outputs did (no mask, the reward alone)."""
    from rollpacker.config import Config
    from rollpacker.controller import Controller
    from rollpacker.data.dataset import PromptSampler
    from rollpacker.env.episode import Episode
    from rollpacker.schedule.base import Group
    from rollpacker.schedule.sync import SyncPolicy

    plain = algorithm_batch()
    ctl = Controller(config=Config(), rows=[], eval_rows=None, tokenizer=None, rewards=None,
                     policy=SyncPolicy(PromptSampler(4, 0), 1, 1), metrics=None, display=None, max_model_len=200)
    through = []
    for group in (0, 1):
        responses = []
        for k, s in enumerate(x for x in plain if x.group == group):
            episode = Episode(f"0:{group}:{k}", s.prompt_ids, None, seed=0, max_turns=1, max_tokens=64,
                              max_new_tokens=64, max_context=200)
            episode.on_turn(s.response_ids, s.rollout_logprobs, "stop")
            responses.append(episode.output())
        rewards = [s.reward for s in plain if s.group == group]
        through += ctl.group_samples(Group(prompt=group, outputs=responses, rewards=rewards))
    assert [(s.prompt_ids, s.response_ids, s.reward, s.rollout_logprobs) for s in through] == [
        (s.prompt_ids, s.response_ids, s.reward, s.rollout_logprobs) for s in plain]
    stats, after = step(toy_random_dir, plain)
    through_stats, through_after = step(toy_random_dir, through)
    assert stats == through_stats and stats["train/loss"] != 0.0
    assert all(torch.equal(after[k], through_after[k]) for k in after)


@pytest.mark.parametrize("case", ["no_token", "all_masked", "empty"])
def test_a_step_with_nothing_to_train_changes_no_weight_and_does_not_crash(toy_random_dir, case):
    """Every episode's environment failed: at its reset (no token at all), or later (every token masked
    out), or every group was left out. The step takes no update and raises nothing (a micro-batch of no
    response token indexed with a float tensor raised IndexError on every rank); the learning rate's
    schedule stays where it was, with no warning from torch that it ran ahead of the optimizer."""
    from rollpacker.train.trainer import Sample

    t = trainer(toy_random_dir)
    samples = {"no_token": [Sample([1, 2], [], 0.0, [], failed=True, loss_mask=[]) for _ in range(2)],
               "all_masked": [Sample([1, 2], [3], 0.0, [0.0], failed=True, loss_mask=[False]) for _ in range(2)],
               "empty": []}[case]
    before = weights(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stats = t.step(samples, 1)
    assert stats["train/loss"] == 0.0 and stats["train/grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in weights(t).items())
    assert t.scheduler.last_epoch == 0 and t.optimizer_steps == {"policy": 0, "critic": 0}


def test_gdpo_normalizes_each_reward_part_in_its_group_then_whitens_the_responses(toy_random_dir):
    """train.advantage gdpo: a sample's parts (weight, value) are normalized in its group, weighted and summed, its
    reward (the rest: an overlong punishment) added, then each response's return whitened over the step. An
    episode whose environment failed shifts nothing, and one that no part applies to gets no advantage."""
    from rollpacker.train.advantages import decoupled
    from rollpacker.train.trainer import Sample

    t = trainer(toy_random_dir, advantage="gdpo")
    rows = [(0, -0.5, (1.0, 0.5), False), (0, 0.0, (0.0, None), False), (0, 0.0, (1.0, 0.1), False),
            (1, 0.0, (1.0, 0.0), False), (1, 0.0, (0.0, 1.0), False), (1, 0.0, (1.0, 1.0), True),
            (2, 0.0, (None, None), False)]
    samples = [Sample([5, 6], [7 + i, 8, 9][:1 + i % 3], rest, [-1.0] * (1 + i % 3), group=g, failed=failed,
                      parts=((1.0, a), (2.0, b)))
               for i, (g, rest, (a, b), failed) in enumerate(rows)]
    prepared = t._prepare(samples)
    nan = float("nan")
    values = torch.tensor([[nan if v is None or f else v for v in ab] for _, _, ab, f in rows])
    sums = decoupled(values, torch.tensor([1.0, 2.0]), [3, 3, 1]) + torch.tensor([r for _, r, _, _ in rows])
    kept = sums[:5]  # the failed episode and the unscored response are out
    expected = ((kept - kept.mean()) / (kept.std() + 1e-6)).tolist() + [0.0, 0.0]
    for p, s, e in zip(prepared, samples, expected):
        torch.testing.assert_close(p.advantages, torch.full((len(s.response_ids),), e), atol=1e-5, rtol=0)
    assert expected[3] != expected[4]  # group 1 without its failed episode still compares its two parts
