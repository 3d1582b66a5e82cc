"""Run by memory_step.py (on 2 gloo ranks, one launch): the Hugging Face model path trains like the reference.

For each model directory after the first argument (one architecture each): one FSDP2 step of
``--model.impl hf`` (each decoder layer sharded and checkpointed, then the root; the fused log-prob
head on the final hidden states) equals a plain single-process step on transformers' own logits.
The first argument is a Qwen2 model both paths load: one RL step of the hf path equals the native
path's.
"""

import torch
import torch.distributed as dist
from train_step import batch

from rollpacker.model.parallelize import build_for_training
from rollpacker.train.advantages import ADVANTAGES, returns_to_go
from rollpacker.train.config import TrainConfig
from rollpacker.train.losses import normalizer, policy_objective
from rollpacker.train.trainer import Trainer, group_sizes

TEMPERATURE = 0.8


def config() -> TrainConfig:
    # several micro-batches, unequal over the ranks; adam_eps=1 keeps the first step linear in the gradient
    return TrainConfig(lr=1e-2, warmup_steps=0, micro_batch_tokens=40, grad_clip=0.5, weight_decay=0.01,
                       adam_eps=1.0, activation_checkpointing="full")


def fsdp_step(path: str, impl: str, meshes) -> tuple[dict, dict[str, torch.Tensor]]:
    cfg = config()
    model = build_for_training(path, impl, meshes.train, cfg, src=0, group=None, device=torch.device("cpu"))
    trainer = Trainer(model, cfg, meshes.train, temperature=TEMPERATURE, num_steps=1)
    samples = batch()
    stats = trainer.step(samples, normalizer(cfg.aggregation, [len(s.response_ids) for s in samples], 64))
    return stats, {n.removeprefix("model."): p.full_tensor().detach() for n, p in trainer.model.named_parameters()}


def reference_step(path: str) -> dict[str, torch.Tensor]:
    """The same update written plainly: one process, transformers' model and logits, the whole batch."""
    from transformers import AutoModelForCausalLM

    cfg, samples = config(), batch()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    logps = []
    for s in samples:
        tokens = torch.tensor(s.prompt_ids + s.response_ids)
        logits = model(tokens[None]).logits[0].float()
        lp = torch.log_softmax(logits[:-1] / TEMPERATURE, -1).gather(1, tokens[1:, None]).squeeze(1)
        logps.append(lp[len(s.prompt_ids) - 1:])
    logp = torch.nn.utils.rnn.pad_sequence(logps, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s.response_ids)) for s in samples], batch_first=True)
    behavior = torch.nn.utils.rnn.pad_sequence([torch.tensor(s.rollout_logprobs) for s in samples], batch_first=True)
    adv = ADVANTAGES[cfg.advantage].fn(returns_to_go(torch.tensor([s.reward for s in samples]), mask.bool()),
                                       mask.bool(), group_sizes(samples))
    loss, _ = policy_objective(logp, logp.detach(), behavior, adv, mask, cfg)
    (loss / mask.sum()).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=cfg.adam_eps, weight_decay=cfg.weight_decay).step()
    return {n.removeprefix("model."): p.detach() for n, p in model.named_parameters()}


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest weight difference relative to the largest weight (same names, same shapes)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:4]
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max()).item() for n in a)


def check(meshes, qwen2: str, *paths: str) -> None:
    for path in paths:
        stats, weights = fsdp_step(path, "hf", meshes)
        worst = largest_difference(weights, reference_step(path))
        assert stats["train/num_micro_batches"] > 1
        assert worst <= 1e-5, f"{path}: weights' largest relative error {worst:.2e}"
        if dist.get_rank() == 0:
            print(f"{path}: one hf-path step vs transformers' single-process step: largest relative error {worst:.1e}")
    hf_stats, hf_weights = fsdp_step(qwen2, "hf", meshes)
    native_stats, native_weights = fsdp_step(qwen2, "native", meshes)
    worst = largest_difference(hf_weights, native_weights)
    for key in ("train/loss", "train/grad_norm", "train/clip_frac"):
        assert abs(hf_stats[key] - native_stats[key]) <= 1e-5 * max(1.0, abs(native_stats[key])), key
    assert worst <= 1e-5, f"hf vs native: {worst:.2e}"
    if dist.get_rank() == 0:
        print(f"qwen2: one RL step, hf path vs native path: loss {hf_stats['train/loss']:.6f} vs "
              f"{native_stats['train/loss']:.6f}, largest relative weight difference {worst:.1e}")
