"""Run on 2 gloo ranks by tests/dist/rollout/test_sglang_engine.py: one SGLang engine at TP 2 over both
ranks (its two schedulers spawned by rank 0) against TorchEngine at TP 1: greedy tokens, a weight
push from the FSDP2-sharded trainer (every rank sends its tensors), abort with partial output and
memory release across the group; the trainer's default group still works. Arg: model."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from support.engine_pair import prompts
from torch.distributed.device_mesh import init_device_mesh

from rollpacker.dist import exit_process
from rollpacker.model import load_model
from rollpacker.model.parallelize import shard_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.sglang_engine import SGLangEngine
from rollpacker.rollout.torch_engine import TorchEngine


def greedy(n: int) -> list[Request]:
    params = SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)
    return [Request(id=f"r{i}", prompt_ids=p, params=params) for i, p in enumerate(prompts(3, 20, seed=7))]


def tokens(outs: dict) -> dict[str, list[int]]:
    return {k: o.token_ids for k, o in outs.items()}


def main(path: Path) -> None:
    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (2,))
    engine = SGLangEngine(path, EngineConfig(kind="sglang", kv_memory_mb=8, max_num_seqs=8), tp_mesh=mesh,
                          dtype=torch.float32, log_level="warning")
    before = tokens(generate(engine, greedy(12)))
    assert before == tokens(generate(TorchEngine(load_model(path), EngineConfig()), greedy(12))), before

    trainer = load_model(path)
    with torch.no_grad():
        for p in trainer.parameters():
            p.mul_(1.5)
    shard_model(trainer, mesh, mixed_precision=False)
    engine.update_weights(trainer.named_parameters())
    reference = TorchEngine(load_model(path), EngineConfig())
    reference.update_weights(trainer.named_parameters())
    after = tokens(generate(engine, greedy(12)))
    assert after == tokens(generate(reference, greedy(12))) and after != before, (after, before)

    engine.add(Request(id="long", prompt_ids=[3, 4, 5], params=SamplingParams(max_new_tokens=200, temperature=0,
                                                                              ignore_eos=True)))
    engine.add(Request(id="short", prompt_ids=[3, 4], params=SamplingParams(max_new_tokens=4, temperature=0,
                                                                            ignore_eos=True)))
    while not any(o.id == "short" for o in engine.step()):
        pass
    partial = engine.abort("long")
    assert partial.finish_reason == "abort" and 0 < len(partial.token_ids) < 200, partial
    engine.release_memory()
    engine.resume_memory()
    assert tokens(generate(engine, greedy(12))) == after
    seen = [None, None]
    dist.all_gather_object(seen, len(partial.token_ids))  # the same partial on both ranks, default group alive
    assert seen[0] == seen[1], seen
    engine.shutdown()
    print(f"rank {rank} OK", flush=True)
    exit_process(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
