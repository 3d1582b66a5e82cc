"""TorchEngine against a plain full-recompute decode, on real (tiny, random) models."""

from __future__ import annotations

from support.jobs import QUIET, launch_job, torchrun
from support.models import make_hf_model


def test_tensor_parallel_matches_single_rank(qwen3_tied_dir):
    """TP=2 on 2 gloo ranks equals TP=1 (greedy and seeded sampling), and weights pushed from
    live FSDP2 parameters into TP-sharded engines equal a state-dict load."""
    out = torchrun("engine_tp.py", 2, str(qwen3_tied_dir))
    assert out.count("OK") == 2, out


def test_a_rollout_tp_that_splits_the_models_key_value_heads_stops_the_job_saying_so(tmp_path):
    """rollout.tp 2 on a model of one key-value head: each engine's TP sharding raised a ValueError on every rank,
    a traceback each, not the config error it is."""
    from rollpacker.toy.model import build_tokenizer, save_tokenizer

    model = make_hf_model(tmp_path / "m", "qwen2", vocab_size=258, num_key_value_heads=1, eos_token_id=0)
    save_tokenizer(build_tokenizer(), model)
    proc = launch_job("--model.path", str(model), "--rollout.tp", "2", "--run-dir", str(tmp_path / "run"), *QUIET,
                      timeout=300)
    said = "rollpacker: --rollout.tp=2 does not divide the model's 1 key-value heads"
    assert proc.returncode != 0 and proc.stderr.count(said) == 1 and "Traceback" not in proc.stderr.split(said)[0], \
        proc.stderr[-3000:]
