"""Run on 2 gloo ranks by tests/dist/train/test_train.py: FSDP2 steps equal plain single-process steps.

For every aggregation mode, each policy loss, a rollout correction, the KL in the loss and in the
reward (adaptive there), a reference moved toward the policy, an entropy bonus, the top-entropy tokens
alone, two mini-batches, and PPO with a critic (GAE, the critic's clipped value loss and its own AdamW):
the trainer's step (micro-batch losses summed over ranks, divided by the step's global count) against
the same update written plainly (one process, the whole batch, full logits, the registries'
functions). With two mini-batches the first update's ratios are exactly 1 on every rank.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.nn.utils.rnn import pad_sequence

from rollpacker.dist import build_meshes, exit_process
from rollpacker.model import CausalAttention, load_model
from rollpacker.model.parallelize import with_value_head
from rollpacker.train.advantages import ADVANTAGES, returns_to_go
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import KL_ESTIMATORS, normalizer, policy_objective, units
from rollpacker.train.trainer import Sample, Trainer, group_sizes, mini_batches

MAX_TOKENS = 64  # rollout.max_new_tokens: seq-mean-token-sum-norm's constant
CASES = [  # the default, then every aggregation, loss, correction and KL placement at least once
    dict(),
    dict(aggregation="seq-mean-token-mean", loss="gspo", entropy_coef=0.01, top_entropy_quantile=0.3),
    dict(aggregation="seq-mean-token-sum", loss="cispo", rollout_correction="token_tis"),
    dict(aggregation="seq-mean-token-sum-norm", advantage="dr_grpo", rollout_correction="seq_mask",
         rollout_is_low=0.2, rollout_is_high=5.0),
    dict(mini_batches=2, kl_coef=0.05, kl_estimator="k2", advantage="rloo", ref_sync_steps=1, ref_mixup_alpha=0.6),
    dict(kl_coef=0.05, kl_in_reward=True, kl_estimator="k1", advantage="reinforce_pp", kl_target=0.01, kl_horizon=100),
    dict(advantage="gae", gamma=0.9, lam=0.8, mini_batches=2, kl_coef=0.05, kl_in_reward=True),
]


def batch() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    lengths = [(9, 30), (9, 3), (9, 17), (6, 41), (6, 2), (8, 11), (8, 25)]  # (prompt, response): groups of 3, 2, 2
    prompts = {p: torch.randint(0, 90, (p,), generator=g).tolist() for p, _ in lengths}
    return [Sample(prompts[p], torch.randint(0, 90, (r,), generator=g).tolist(), float(torch.randint(0, 3, (),
                   generator=g)) / 2, (-5.5 + 0.5 * torch.randn(r, generator=g)).tolist(), group=p)
            for p, r in lengths]


def reference_model(path: str):
    """A reference policy unlike the initial one, so that the KL terms are not all 0 at the first step."""
    model = load_model(path)
    with torch.no_grad():
        model.norm.weight.mul_(1.5)
    return model


def value_model(path: str):
    """A critic whose head is not zero, so that its values shape the first step's advantages."""
    critic = with_value_head(load_model(path))
    with torch.no_grad():
        critic.lm_head.weight.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(1))
    return critic


def plain_values(critic, samples: list[Sample]) -> torch.Tensor:
    """The critic's value [N, T] of the state before each response token."""
    values = []
    for s in samples:
        tokens = torch.tensor(s.prompt_ids + s.response_ids)
        hidden = critic(tokens, torch.arange(len(tokens)), CausalAttention([len(tokens)]))
        values.append((hidden @ critic.lm_head.weight.T)[len(s.prompt_ids) - 1:-1, 0])
    return pad_sequence(values, batch_first=True)


def plain_gae(cfg: TrainConfig, samples: list[Sample], kl_reward: torch.Tensor | None, values: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages (whitened over every token of the batch) and returns [N, T], the sums written out:
    A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t (V past the end 0)."""
    adv, ret = torch.zeros(values.shape), torch.zeros(values.shape)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        r = torch.zeros(n) if kl_reward is None else kl_reward[i, :n].clone()
        r[-1] += s.reward
        v = torch.cat([values[i, :n], torch.zeros(1)])
        delta = r + cfg.gamma * v[1:] - v[:-1]
        for t in range(n):
            adv[i, t] = sum((cfg.gamma * cfg.lam) ** k * delta[t + k] for k in range(n - t))
        ret[i, :n] = adv[i, :n] + v[:-1]
    mask = pad_sequence([torch.ones(len(s.response_ids), dtype=torch.bool) for s in samples], batch_first=True)
    return torch.where(mask, (adv - adv[mask].mean()) / (adv[mask].std() + 1e-6), 0.0), ret


def plain_logprobs(model, samples: list[Sample], temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies [N, T] of each response token from the full logits."""
    logps, entropies = [], []
    for s in samples:
        tokens = torch.tensor(s.prompt_ids + s.response_ids)
        logits = model.logits(model(tokens, torch.arange(len(tokens)), CausalAttention([len(tokens)])))
        lp = torch.log_softmax(logits[:-1] / temperature, -1)[len(s.prompt_ids) - 1:]
        logps.append(lp.gather(1, tokens[len(s.prompt_ids):, None]).squeeze(1))
        entropies.append(-(lp.exp() * lp).sum(-1))
    return pad_sequence(logps, batch_first=True), pad_sequence(entropies, batch_first=True)


def reference_steps(path: str, cfg: TrainConfig, samples: list[Sample], temperature: float) -> tuple[dict, float]:
    """The same updates, written plainly: old log-probs frozen first, advantages, then each
    mini-batch's AdamW step on its share of the global count. Returns the weights and the first loss."""
    model = load_model(path)
    reference = reference_model(path) if cfg.kl_coef else None
    lengths = [len(s.response_ids) for s in samples]
    mask = pad_sequence([torch.ones(n, dtype=torch.bool) for n in lengths], batch_first=True)
    behavior = pad_sequence([torch.tensor(s.rollout_logprobs) for s in samples], batch_first=True)
    with torch.no_grad():
        old, old_entropy = plain_logprobs(model, samples, temperature)
        ref = plain_logprobs(reference, samples, temperature)[0] if reference else None
    focus = None
    if cfg.top_entropy_quantile < 1:  # the tokens in the top share by entropy, over the whole batch
        every = old_entropy[mask]
        focus = old_entropy >= every.kthvalue(1 + int((1 - cfg.top_entropy_quantile) * (len(every) - 1))).values
    kl_reward = -cfg.kl_coef * KL_ESTIMATORS[cfg.kl_estimator](old, ref) if cfg.kl_in_reward else None
    critic = value_model(path) if cfg.advantage == "gae" else None
    if critic is None:
        returns = returns_to_go(torch.tensor([s.reward for s in samples]), mask, kl_reward)
        adv = ADVANTAGES[cfg.advantage].fn(returns, mask, group_sizes(samples))
    else:
        with torch.no_grad():
            values = plain_values(critic, samples)
        adv, returns = plain_gae(cfg, samples, kl_reward, values)
        critic_opt = torch.optim.AdamW(critic.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                                       weight_decay=cfg.weight_decay)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    total, losses = normalizer(cfg.aggregation, lengths, MAX_TOKENS), []
    parts = mini_batches(group_sizes(samples), cfg.mini_batches)
    for b in parts:
        logp, entropy = plain_logprobs(model, [samples[i] for i in b], temperature)
        t = logp.shape[1]
        frozen = logp.detach() if len(parts) == 1 else old[b, :t]
        part = lambda x: None if x is None else x[b, :t]  # noqa: E731
        loss, _ = policy_objective(logp, frozen, behavior[b, :t], adv[b, :t], mask[b, :t], cfg, entropy=entropy,
                                   ref=part(ref), focus=part(focus))
        share = total * units(cfg.aggregation, [lengths[i] for i in b]) / units(cfg.aggregation, lengths)
        (loss / share).backward()
        losses.append(loss.item() / share)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        if critic is not None:  # 0.5 max((V - R)^2, (clip(V, V_old +- c) - R)^2), a mean over the mini-batch's tokens
            v, clip, target = plain_values(critic, [samples[i] for i in b]), cfg.critic.value_clip, returns[b, :t]
            bounded = values[b, :t] + (v - values[b, :t]).clamp(-clip, clip)
            loss = 0.5 * torch.maximum((v - target) ** 2, (bounded - target) ** 2)
            (torch.where(mask[b, :t], loss, 0.0).sum() / mask[b, :t].sum()).backward()
            torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.grad_clip)
            critic_opt.step()
            critic_opt.zero_grad()
    critic_weights = {f"critic.{k}": v for k, v in critic.named_parameters()} if critic is not None else {}
    return dict(model.named_parameters()) | critic_weights, losses[0]


def main(path: str) -> None:
    meshes = build_meshes(rollout_tp=1, train_shard_size=0)
    samples = batch()
    lengths = [len(s.response_ids) for s in samples]
    for case in CASES:
        # a small token budget: several micro-batches, and unequal counts over the 2 ranks
        # adam_eps=1 keeps Adam's first step linear in the gradient: elements whose true gradient is
        # ~0 (e.g. key biases under RoPE) would otherwise turn float noise into +-lr updates.
        cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, grad_clip=0.5, weight_decay=0.01,
                          adam_eps=1.0, **case)
        reference = reference_model(path) if cfg.kl_coef else None
        critic = value_model(path) if cfg.advantage == "gae" else None
        trainer = Trainer(load_model(path), cfg, meshes.train, temperature=0.8, reference=reference, critic=critic,
                          num_steps=1)
        stats = trainer.step(samples, normalizer(cfg.aggregation, lengths, MAX_TOKENS))
        expected, first_loss = reference_steps(path, cfg, samples, 0.8)
        initial = dict(load_model(path).named_parameters())
        if critic is not None:
            initial |= {f"critic.{k}": v for k, v in value_model(path).named_parameters()}
        trained = [*trainer.model.named_parameters(),
                   *(() if critic is None else ((f"critic.{k}", v) for k, v in trainer.critic.named_parameters()))]
        worst_weight = max_diff = max_update = 0.0
        for name, p in trained:
            full, ref, w0 = p.full_tensor().detach(), expected[name].detach(), initial[name].detach()
            worst_weight = max(worst_weight, ((full - ref).abs().max() / ref.abs().max()).item())
            max_diff = max(max_diff, (full - ref).abs().max().item())
            max_update = max(max_update, (ref - w0).abs().max().item())
        worst_update = max_diff / max_update  # relative to the largest update of the step
        first = trainer.updates[0]
        assert max(u["train/num_micro_batches"] for u in trainer.updates) > 1
        assert stats["train/num_updates"] == cfg.mini_batches, stats
        assert abs(first["train/loss"] - first_loss) <= 1e-5 * max(1.0, abs(first_loss)), (case, first, first_loss)
        assert worst_weight <= 1e-5, f"{case}: weights' max relative error {worst_weight:.2e}"
        assert worst_update <= 1e-4, f"{case}: updates' max relative error {worst_update:.2e}"
        if cfg.mini_batches > 1:  # the frozen log-probs are exactly those the first update recomputes
            assert first["train/ratio_dev"] == 0.0 and trainer.updates[1]["train/ratio_dev"] > 0, trainer.updates
            # weights that hardly move: the step's loss and token means are one update's (each update's mean was
            # averaged, whatever its tokens)
            still = [Trainer(load_model(path), dataclasses.replace(cfg, lr=1e-12, mini_batches=m), meshes.train,
                             temperature=0.8, reference=reference_model(path) if cfg.kl_coef else None,
                             critic=value_model(path) if critic is not None else None, num_steps=1).step(
                samples, normalizer(cfg.aggregation, lengths, MAX_TOKENS)) for m in (cfg.mini_batches, 1)]
            for k in ("train/loss", "train/entropy", "train/kl", "train/num_tokens",
                      *(("critic/vf_loss", "critic/returns_mean", "critic/num_tokens") if critic is not None else ())):
                assert abs(still[0][k] - still[1][k]) <= 1e-5 * max(1.0, abs(still[1][k])), (case, k, still)
        assert 0 < stats["train/entropy"] < 10 and (stats["train/kl"] > 0) == bool(cfg.kl_coef), stats
        assert stats["train/num_samples"] == len(samples) and stats.get("train/kl_coef") == (cfg.kl_coef or None)
        assert ("train/entropy_threshold" in stats) == (cfg.top_entropy_quantile < 1), stats
        if cfg.ref_sync_steps:  # after the step, the reference moved 60% of the way to the policy
            moved = reference_model(path).state_dict()
            for (name, ref), p in zip(trainer.reference.named_parameters(), trainer.model.parameters()):
                want = moved[name].mul_(1 - cfg.ref_mixup_alpha).add_(p.full_tensor(), alpha=cfg.ref_mixup_alpha)
                assert torch.equal(ref.full_tensor(), want), name
        if cfg.kl_target:  # the step used kl_coef; the next one's moved by the step's KL over its 7 responses
            error = min(max(stats["train/kl"] / cfg.kl_target - 1, -0.2), 0.2)
            assert error and trainer.kl.value == cfg.kl_coef * (1 + error * len(samples) / cfg.kl_horizon), stats
        if dist.get_rank() == 0:
            print(f"{case}: loss {first['train/loss']:.6f} (plain {first_loss:.6f}), max relative error of weights "
                  f"{worst_weight:.1e}, of updates {worst_update:.1e}", flush=True)
    print("OK", dist.get_rank(), flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1])
