"""Run on 2 gloo ranks by tests/dist/test_train.py: one FSDP2 step equals a plain single-process step."""

import sys

import torch
import torch.distributed as dist

from rollpacker.dist import build_meshes
from rollpacker.model import CausalAttention, load_model
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import policy_loss
from rollpacker.train.trainer import Sample, Trainer


def batch() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    lengths = [(9, 30), (4, 3), (12, 17), (6, 41), (5, 2), (8, 11), (3, 25)]  # (prompt, response)
    return [
        Sample(torch.randint(0, 90, (p,), generator=g).tolist(), torch.randint(0, 90, (r,), generator=g).tolist(),
               float(torch.randn((), generator=g)), [-1.0] * r)
        for p, r in lengths
    ]


def reference_step(path: str, cfg: TrainConfig, samples: list[Sample], temperature: float) -> dict:
    """The same update, written plainly: one process, the whole batch, full logits."""
    model = load_model(path)
    logps = []
    for s in samples:
        tokens = torch.tensor(s.prompt_ids + s.response_ids)
        logits = model.logits(model(tokens, torch.arange(len(tokens)), CausalAttention([len(tokens)])))
        lp = torch.log_softmax(logits[:-1] / temperature, -1).gather(1, tokens[1:, None]).squeeze(1)
        logps.append(lp[len(s.prompt_ids) - 1:])
    logp = torch.nn.utils.rnn.pad_sequence(logps, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s.response_ids)) for s in samples], batch_first=True)
    adv = torch.tensor([s.advantage for s in samples])
    normalizer = mask.sum() if cfg.aggregation == "token" else len(samples)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                          aggregation=cfg.aggregation, normalizer=normalizer)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.adam_eps,
                            weight_decay=cfg.weight_decay)
    opt.step()
    return dict(model.named_parameters())


def main(path: str) -> None:
    meshes = build_meshes(rollout_tp=1, train_shard_size=0)
    samples = batch()
    for aggregation in ("token", "seq-mean"):
        # a small token budget: several micro-batches, and unequal counts over the 2 ranks
        # adam_eps=1 keeps Adam's first step linear in the gradient: elements whose true gradient is
        # ~0 (e.g. key biases under RoPE) would otherwise turn float noise into +-lr updates.
        cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, aggregation=aggregation, grad_clip=0.5,
                          weight_decay=0.01, adam_eps=1.0)
        trainer = Trainer(load_model(path), cfg, meshes.train, temperature=0.8, num_steps=1)
        stats = trainer.step(samples)
        expected = reference_step(path, cfg, samples, 0.8)
        initial = dict(load_model(path).named_parameters())
        worst_weight = max_diff = max_update = 0.0
        for name, p in trainer.model.named_parameters():
            full, ref, w0 = p.full_tensor().detach(), expected[name].detach(), initial[name].detach()
            worst_weight = max(worst_weight, ((full - ref).abs().max() / ref.abs().max()).item())
            max_diff = max(max_diff, (full - ref).abs().max().item())
            max_update = max(max_update, (ref - w0).abs().max().item())
        worst_update = max_diff / max_update  # relative to the largest update of the step
        assert stats["train/num_micro_batches"] > 1
        assert worst_weight <= 1e-5, f"{aggregation}: weights' max relative error {worst_weight:.2e}"
        assert worst_update <= 1e-4, f"{aggregation}: updates' max relative error {worst_update:.2e}"
        if dist.get_rank() == 0:
            print(f"{aggregation}: max relative error of weights {worst_weight:.1e}, of updates {worst_update:.1e}")
    print("OK", dist.get_rank(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
