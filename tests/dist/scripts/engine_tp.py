"""Run on 2 gloo ranks by tests/dist/test_engine.py: TP=2 engines against TP=1, and FSDP2 weight push."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from rollpacker.model import load_model
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import EngineConfig, TorchEngine


def requests():
    return [
        Request(id=str(i), prompt_ids=list(range(1, 3 + 7 * i)), params=SamplingParams(
            max_new_tokens=20 + 5 * i, temperature=0 if i % 2 else 0.8, top_p=0.9, seed=i, ignore_eos=True))
        for i in range(6)
    ]


def tokens(outs):
    return {k: o.token_ids for k, o in outs.items()}


def main(path: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    config = EngineConfig(block_size=4)
    single = generate(TorchEngine(load_model(path), config), requests())
    tp = TorchEngine(load_model(path), config, tp_mesh=mesh)
    sharded = generate(tp, requests())
    assert tokens(single) == tokens(sharded), "TP=2 differs from TP=1"
    for k in single:
        assert max(abs(a - b) for a, b in zip(single[k].logprobs, sharded[k].logprobs)) < 1e-4

    # Push weights from a live FSDP2-sharded copy (perturbed) into the TP engine and a TP=1 engine.
    trainer = load_model(path)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    for block in trainer.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    tp.update_weights(trainer.named_parameters())
    plain = TorchEngine(load_model(path), config)
    plain.update_weights(trainer.named_parameters())
    pushed_tp, pushed_plain = generate(tp, requests()), generate(plain, requests())
    assert tokens(pushed_tp) == tokens(pushed_plain), "FSDP2 -> TP push differs from FSDP2 -> TP=1 push"
    assert tokens(pushed_plain) != tokens(single), "the pushed weights had no effect"
    print("OK", dist.get_rank(), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
