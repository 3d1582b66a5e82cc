"""The trainer and the RL loop on real gloo ranks."""

from __future__ import annotations

import pytest
import torch


def test_nonfinite_loss_skips_the_step(toy_random_dir):
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample, Trainer

    meshes = build_meshes(1, 0)
    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2), meshes.train, num_steps=2)
    before = {k: v.full_tensor().clone() for k, v in trainer.model.state_dict().items()}
    stats = trainer.step([Sample([5, 6, 7], [8, 9], float("nan"), [-1.0, -1.0])], 2)
    assert stats["train/skipped"] == 1.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k].full_tensor()) for k in before)
    stats = trainer.step([Sample([5, 6, 7], [8, 9], 1.0, [-1.0, -1.0]), Sample([5, 6, 7], [9, 8], 0.0, [-1.0, -1.0])],
                         4)
    assert stats["train/skipped"] == 0.0
    assert not torch.equal(before["norm.weight"], trainer.model.state_dict()["norm.weight"].full_tensor())


def test_lr_warms_up_then_decays_by_cosine_to_its_floor_at_the_last_step():
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import lr_factor

    cosine = TrainConfig(warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    assert [lr_factor(s, cosine, num_steps=6) for s in range(7)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.775, 0.325, 0.1, 0.1])  # 0.1 + 0.9 * (1 + cos(pi * k / 3)) / 2 after the warm-up
    constant = TrainConfig(warmup_steps=2, lr_schedule="constant")
    assert [lr_factor(s, constant, num_steps=6) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(0, TrainConfig(warmup_steps=0), num_steps=1) == 1.0


def algorithm_batch() -> list:
    """Two groups of three responses to one prompt each, rewards 0/1 (tokens within the toy vocabulary)."""
    from rollpacker.train.trainer import Sample

    g = torch.Generator().manual_seed(0)
    samples = []
    for group in range(2):
        prompt = torch.randint(2, 60, (int(torch.randint(3, 9, (), generator=g)),), generator=g).tolist()
        for reward in (1.0, 0.0, float(group % 2)):
            n = int(torch.randint(1, 12, (), generator=g))
            samples.append(Sample(prompt, torch.randint(2, 60, (n,), generator=g).tolist(), reward,
                                  (-torch.rand(n, generator=g)).tolist(), group=group))
    return samples


def weights(trainer, which: str = "model") -> dict:
    return {f"{which}.{k}": v.full_tensor().clone() for k, v in getattr(trainer, which).state_dict().items()}


def test_one_mini_batch_one_epoch_is_bitwise_the_plain_ppo_step(toy_random_dir):
    """``train.mini_batches 1, epochs 1`` (the default) is the step as it was before the registries:
    GRPO advantages per group, PPO-clip against the current log-probs detached, token sums over
    the global token count, written out here from the formulas, and bitwise the same."""
    from torch.nn.utils.rnn import pad_sequence

    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer, spread

    meshes = build_meshes(1, 0)
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=24)
    samples = algorithm_batch()
    count = sum(len(s.response_ids) for s in samples)
    trainer = Trainer(load_model(toy_random_dir), cfg, meshes.train, temperature=0.8, num_steps=2)
    stats = trainer.step(samples, count)
    plain = Trainer(load_model(toy_random_dir), cfg, meshes.train, temperature=0.8, num_steps=2)
    adv = []
    for k in range(2):
        r = torch.tensor([s.reward for s in samples if s.group == k])[None]
        adv += ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-6))[0].tolist()
    (micro_batches,) = spread([s.num_tokens for s in samples], 1, cfg.micro_batch_tokens)
    assert len(micro_batches) > 1
    for i, micro in enumerate(micro_batches):
        plain.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
        batch = [samples[j] for j in micro]
        lengths = [len(s.response_ids) for s in batch]
        logp = pad_sequence(plain._logprobs(plain.model, batch).split(lengths), batch_first=True)
        mask = pad_sequence([torch.ones(n, dtype=torch.bool) for n in lengths], batch_first=True)
        a = torch.tensor([adv[j] for j in micro])[:, None]
        ratio = torch.exp(torch.where(mask, logp - logp.detach(), 0.0))
        token = torch.maximum(-ratio * a, -torch.clamp(ratio, 0.8, 1.28) * a)
        torch.where(mask, token, 0.0).sum().backward()
    params = [p for p in plain.model.parameters() if p.grad is not None]
    for p in params:
        p.grad.div_(count)
    torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    plain.optimizer.step()
    assert stats["train/num_updates"] == 1.0 and stats["train/ratio_dev"] == 0.0
    after, want = weights(trainer), weights(plain)
    assert all(torch.equal(after[k], want[k]) for k in want)


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_several_updates_freeze_the_old_logprobs_first(toy_random_dir, tmp_path, impl):
    """Two mini-batches, two epochs: four optimizer steps. The first update's ratios are exactly 1
    (the frozen log-probs are the ones it recomputes; a model with attention dropout runs without it),
    the later ones' are not (the weights moved); the learning-rate schedule advances once."""
    from support.models import make_hf_model

    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.hf_decoder import load_hf
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, mini_batches=2, epochs=2)
    model = load_model(toy_random_dir) if impl == "native" else load_hf(
        make_hf_model(tmp_path / "hf", "qwen2", vocab_size=128, attention_dropout=0.5))
    trainer = Trainer(model, cfg, build_meshes(1, 0).train, temperature=0.8, num_steps=4)
    samples = algorithm_batch()
    stats = trainer.step(samples, sum(len(s.response_ids) for s in samples))
    ratio_dev = [u["train/ratio_dev"] for u in trainer.updates]
    assert stats["train/num_updates"] == 4.0
    assert ratio_dev[0] == 0.0 and min(ratio_dev[1:]) > 1e-4, ratio_dev
    assert {s["step"].item() for s in trainer.optimizer.state.values()} == {4.0}
    assert trainer.scheduler.last_epoch == 1
    assert 0 < stats["train/entropy"] < 10


def test_mini_batches_split_whole_groups():
    from rollpacker.train.trainer import Sample, group_sizes, mini_batches

    samples = [Sample([1], [2], 0.0, [0.0], group=g) for g in (7, 7, 3, 3, 3, 7, 9)]
    assert group_sizes(samples) == [2, 3, 1, 1]  # a group is a run of consecutive samples
    assert mini_batches([2, 3, 1, 1], 2) == [[0, 1, 2, 3, 4], [5, 6]]
    assert mini_batches([2, 3, 1, 1], 3) == [[0, 1], [2, 3, 4], [5, 6]]
    assert mini_batches([2, 3], 4) == [[0, 1], [2, 3, 4]]  # at most one mini-batch per group
    assert mini_batches([], 2) == [[]]


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_mask_truncated_trains_nothing_on_a_truncated_response(advantage, toy_random_dir):
    """Nor does PPO's critic learn from one."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.parallelize import with_value_head
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    critic = with_value_head(load_model(toy_random_dir)) if advantage == "gae" else None
    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2, mask_truncated=True, advantage=advantage),
                      build_meshes(1, 0).train, critic=critic, num_steps=2)
    samples = algorithm_batch()
    for s in samples:
        s.truncated = True
    before = weights(trainer) | (weights(trainer, "critic") if critic else {})
    stats = trainer.step(samples, 1)
    assert stats["train/masked_truncated"] == len(samples) and stats["train/loss"] == 0.0
    assert stats.get("critic/vf_loss", 0.0) == 0.0
    after = weights(trainer) | (weights(trainer, "critic") if critic else {})
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("advantage", ["reinforce_pp", "reinforce_pp_baseline"])
def test_a_whitening_leaves_out_the_truncated_responses_it_does_not_train(advantage, toy_random_dir):
    """With train.mask_truncated, the responses trained are whitened as if the truncated ones were not in the step
    (their tokens, often the longest, weighed in its mean and std); a group's baseline still counts them."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.advantages import ADVANTAGES, group_centred, whiten
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(mask_truncated=True, advantage=advantage),
                      build_meshes(1, 0).train, num_steps=2)
    samples = algorithm_batch()
    samples[1].truncated = samples[5].truncated = True
    adv = [p.advantages for p in trainer._prepare(samples)]
    lengths = [len(s.response_ids) for s in samples]
    returns = torch.zeros(len(samples), max(lengths))
    mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]
    returns[:] = torch.tensor([s.reward for s in samples])[:, None]
    everyone = ADVANTAGES[advantage].fn(returns, mask, [3, 3])  # the whitening over every token
    trained = mask.clone()
    trained[[1, 5]] = False
    centred = returns if advantage == "reinforce_pp" else group_centred(returns, [3, 3], scale=False)
    expected = whiten(centred, trained)
    for i in (0, 2, 3, 4):
        assert torch.allclose(adv[i], expected[i, :lengths[i]], atol=1e-5), (i, adv[i], expected[i])
        assert not torch.allclose(adv[i], everyone[i, :lengths[i]], atol=1e-3)


@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_a_step_with_no_sample_updates_nothing(advantage, toy_random_dir):
    """A step whose groups were all filtered (tail's zero-variance filter at the data's end): PPO's critic values
    and the KL in the reward, gathered over no sample, were pad_sequence's "empty list of sequences"."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.parallelize import with_value_head
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    critic = with_value_head(load_model(toy_random_dir)) if advantage == "gae" else None
    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2, advantage=advantage, kl_in_reward=True,
                                                              kl_coef=0.1), build_meshes(1, 0).train,
                      reference=load_model(toy_random_dir), critic=critic, num_steps=2)
    before = weights(trainer) | (weights(trainer, "critic") if critic else {})
    stats = trainer.step([], 1)
    assert stats["train/loss"] == 0.0
    after = weights(trainer) | (weights(trainer, "critic") if critic else {})
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("epochs", [1, 2])  # the reference in each micro-batch's loss; in the step's first pass
def test_a_sharded_reference_goes_back_to_its_shards_after_its_forward(toy_random_dir, epochs):
    """FSDP2 leaves a root unsharded after a forward without backward: the KL reference's embedding and head stayed
    whole on the device through the step and the rollout after it (2 GB a GPU for a 7B model) beside the shards the
    memory plan counts."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample, Trainer

    trainer = Trainer(load_model(toy_random_dir), TrainConfig(lr=1e-2, kl_coef=0.1, epochs=epochs),
                      build_meshes(1, 0).train, reference=load_model(toy_random_dir), num_steps=2)
    trainer.step([Sample([5, 6, 7], [8, 9], 1.0, [-1.0, -1.0]), Sample([5, 6, 7], [9, 8], 0.0, [-1.0, -1.0])], 2)
    assert not trainer.reference._get_fsdp_state()._fsdp_param_group.is_unsharded


@pytest.mark.parametrize("impl", ["native", "hf"])
def test_a_critic_starts_at_zero_and_learns_its_returns(impl, toy_random_dir, qwen3_tied_dir):
    """PPO with a critic on one rank, the native decoder and a Hugging Face one (both with a tied embedding): the
    zero head's first values are 0, and steps on one batch bring the value loss down. The critic's head is its
    own: one output, not the embedding."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.hf_decoder import load_hf
    from rollpacker.model.parallelize import with_value_head
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Trainer

    path, load = (toy_random_dir, load_model) if impl == "native" else (qwen3_tied_dir, load_hf)
    cfg = TrainConfig(lr=1e-3, warmup_steps=0, lr_schedule="constant", advantage="gae", lam=0.95)
    meshes = build_meshes(1, 0)
    with pytest.raises(ValueError, match="a critic is trained with train.advantage gae only"):
        Trainer(load(path), cfg, meshes.train, num_steps=1)
    trainer = Trainer(load(path), cfg, meshes.train, critic=with_value_head(load(path)), num_steps=8)
    assert trainer.critic.lm_head.weight.shape == (1, trainer.model.lm_head.weight.shape[1])  # not the embedding
    samples = algorithm_batch()
    steps = [trainer.step(samples, sum(len(s.response_ids) for s in samples)) for _ in range(8)]
    assert steps[0]["critic/vpred_mean"] == 0.0 and steps[0]["critic/vf_loss"] > 0.1, steps[0]
    losses = [s["critic/vf_loss"] for s in steps]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(s["train/grad_norm"] > 0 and s["critic/lr"] == 1e-3 for s in steps)


def test_a_critic_from_a_reward_model_starts_as_the_reward_model(reward_model_dir):
    """``train.critic.path`` a reward model (a sequence classifier with one label): the critic keeps its score
    head, so its value after the last token is the reward model's score (transformers' own forward)."""
    import transformers

    from rollpacker.model import CausalAttention, load_model
    from rollpacker.model.parallelize import with_value_head

    critic = with_value_head(load_model(reward_model_dir))
    reward_model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokens = torch.tensor([5, 17, 42, 9, 33, 8])
    with torch.no_grad():
        hidden = critic(tokens, torch.arange(len(tokens)), CausalAttention([len(tokens)]))
        torch.testing.assert_close((hidden @ critic.lm_head.weight.T)[-1, 0],
                                   reward_model(tokens[None]).logits[0, 0], atol=1e-5, rtol=1e-5)
    assert torch.equal(critic.lm_head.weight, load_model(reward_model_dir).lm_head.weight)


def test_critic_warmup_trains_the_critic_alone_first(toy_random_dir):
    """``train.critic.warmup_steps 1`` (verl's critic_warmup): the first step moves the critic and not the
    policy, whose learning-rate schedule waits; the second moves both."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.model.parallelize import with_value_head
    from rollpacker.train.config import CriticConfig, TrainConfig
    from rollpacker.train.trainer import Trainer

    cfg = TrainConfig(lr=1e-2, warmup_steps=0, advantage="gae", critic=CriticConfig(warmup_steps=1))
    trainer = Trainer(load_model(toy_random_dir), cfg, build_meshes(1, 0).train,
                      critic=with_value_head(load_model(toy_random_dir)), num_steps=4)
    samples = algorithm_batch()
    policy, critic = weights(trainer), weights(trainer, "critic")
    for step in range(2):
        stats = trainer.step(samples, sum(len(s.response_ids) for s in samples))
        assert stats["critic/warmup"] == float(step < 1)
        moved = {which: not all(torch.equal(v, weights(trainer, which)[k]) for k, v in before.items())
                 for which, before in (("model", policy), ("critic", critic))}
        assert moved == {"model": step == 1, "critic": True}, (step, moved)
        policy, critic = weights(trainer), weights(trainer, "critic")
    assert (trainer.scheduler.last_epoch, trainer.critic_scheduler.last_epoch) == (1, 2)
