"""Run on 2 gloo ranks by tests/dist/train/test_memory.py: the memory settings change memory, not the update.

- the model built on the meta device and filled from rank 0's host copy equals the loaded one;
- activation checkpointing (full; selective attention; selective MLP every 2nd block) gives the
  loss and gradients of none, within 1e-6;
- reduce-scatter every micro-batch, and offload (FSDP2 CPUOffloadPolicy, the KL reference streamed
  layer by layer from host memory) give the update of the defaults, over two steps with a KL term;
- then, in the same launch, the Hugging Face model path (hf_step.py), given its model directories.

Arguments: the native model's directory, then hf_step.py's (a Qwen2 model, one per architecture).
"""

import sys

import torch
import torch.distributed as dist
from hf_step import check as check_hf_path
from train_step import batch

from rollpacker.dist import build_meshes, exit_process
from rollpacker.model import load_model
from rollpacker.model.parallelize import build_for_training
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import normalizer
from rollpacker.train.trainer import Trainer, spread


def build(path: str, meshes, cfg: TrainConfig) -> Trainer:
    kw = dict(src=0, group=None, device=torch.device("cpu"))
    policy = build_for_training(path, "native", meshes.train, cfg, **kw)
    reference = build_for_training(path, "native", meshes.train, cfg, reference=True, **kw) if cfg.kl_coef else None
    return Trainer(policy, cfg, meshes.train, temperature=0.8, reference=reference, num_steps=2)


def gradients(path: str, meshes, **settings) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss sum and the reduced gradients of one backward over the batch (several micro-batches)."""
    trainer = build(path, meshes, TrainConfig(micro_batch_tokens=40, **settings))
    samples = batch()
    plan = spread([s.num_tokens for s in samples], len(trainer.ranks), trainer.config.micro_batch_tokens)
    trainer._backward(samples, trainer._prepare(samples), plan, trainer.ranks, sync_last=True)
    loss = trainer.totals[0].clone()
    dist.all_reduce(loss)
    return loss.item(), {n: p.grad.full_tensor() for n, p in trainer.model.named_parameters()}


def two_steps(path: str, meshes, **settings) -> tuple[list[dict], dict[str, torch.Tensor]]:
    cfg = TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, kl_coef=0.1, adam_eps=1.0, **settings)
    trainer = build(path, meshes, cfg)
    samples = batch()
    total = normalizer(cfg.aggregation, [len(s.response_ids) for s in samples], 64)
    stats = [trainer.step(samples, total) for _ in range(2)]
    return stats, {n: p.full_tensor().detach() for n, p in trainer.model.named_parameters()}


def main(path: str, *hf_paths: str) -> None:
    meshes = build_meshes(rollout_tp=1, train_shard_size=0)
    built = build(path, meshes, TrainConfig()).model
    loaded = dict(load_model(path).named_parameters())
    for name, p in built.named_parameters():
        assert torch.equal(p.full_tensor(), loaded[name]), name

    loss, grads = gradients(path, meshes)
    for settings in ({"activation_checkpointing": "full"},
                     {"activation_checkpointing": "selective", "ac_every": 1, "ac_part": "attention"},
                     {"activation_checkpointing": "selective", "ac_every": 2, "ac_part": "mlp"}):
        other_loss, other = gradients(path, meshes, **settings)
        worst = max((grads[n] - other[n]).abs().max().item() for n in grads)
        assert abs(loss - other_loss) <= 1e-6 and worst <= 1e-6, (settings, loss - other_loss, worst)
        if dist.get_rank() == 0:
            print(f"{settings}: loss {other_loss:.6f} (none: {loss:.6f}), largest gradient difference {worst:.1e}")

    stats, weights = two_steps(path, meshes)
    assert stats[1]["train/kl"] > 0  # the reference differs from the policy at the second step
    for settings in ({"reduce_every_micro_batch": True}, {"offload": True}):
        other_stats, other = two_steps(path, meshes, **settings)
        worst = max((weights[n] - other[n]).abs().max().item() for n in weights)
        for key in ("train/loss", "train/kl", "train/grad_norm"):
            assert abs(stats[1][key] - other_stats[1][key]) <= 1e-6 * max(1.0, abs(stats[1][key])), (settings, key)
        assert worst <= 1e-6, (settings, worst)
        if dist.get_rank() == 0:
            print(f"{settings}: step 2 kl {other_stats[1]['train/kl']:.3e}, largest weight difference {worst:.1e}")
    check_hf_path(meshes, *hf_paths)
    print("OK", dist.get_rank(), flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
