"""TorchEngine against a plain full-recompute decode, on real (tiny, random) models."""

from __future__ import annotations

from support.jobs import torchrun


def test_tensor_parallel_matches_single_rank(qwen3_tied_dir):
    """TP=2 on 2 gloo ranks equals TP=1 (greedy and seeded sampling), and weights pushed from
    live FSDP2 parameters into TP-sharded engines equal a state-dict load."""
    out = torchrun("engine_tp.py", 2, str(qwen3_tied_dir))
    assert out.count("OK") == 2, out
