"""TorchEngine's abort: the partial outputs come back and every KV block the requests held is free
again (what tail batching's aborts and stream training's migrations rely on)."""

from __future__ import annotations


def test_abort_frees_engine_memory():
    import torch

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import Request, SamplingParams
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    engine = TorchEngine(load_model(toy_model_dir(), torch.device("cpu"), torch.float32),
                         EngineConfig(kv_memory_mb=1, block_size=4), None)
    engine.step()  # allocate the cache
    free = len(engine.free_blocks)
    for i in range(6):
        engine.add(Request(id=str(i), prompt_ids=[5, 6, 7, 8, 9],
                           params=SamplingParams(max_new_tokens=64, ignore_eos=True)))
    for _ in range(10):
        engine.step()
    assert len(engine.free_blocks) < free
    outs = [engine.abort(str(i)) for i in range(6)]
    assert all(o.finish_reason == "abort" and o.token_ids for o in outs)
    assert len(engine.free_blocks) == free and not engine.has_unfinished()
