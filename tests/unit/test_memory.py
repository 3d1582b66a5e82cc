"""The memory plan (rollpacker.plan.memory): hand counts, the presets it holds, its refusal."""

from __future__ import annotations

import json

import pytest
import torch

from rollpacker.plan.memory import GB, Shape, TrainSetup, activations, block_saved, train_phases

TINY = Shape(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=2, qkv_bias=True)


def test_the_plans_terms_for_a_tiny_model_equal_a_hand_count():
    # a block: q 4x4 + 4, k and v 4x2 + 2 each, o 4x4, the MLP 3 x 4x6, two norms of 4
    assert TINY.layer_params == 20 + 10 + 10 + 16 + 72 + 8 == 136
    assert TINY.root_params == 10 * 4 * 2 + 4 == 84  # embedding, head (untied), final norm
    assert TINY.num_params == 2 * 136 + 84 == 356
    # saved per token in fp32, no padding: each norm 4D (its input) + 4D (normed) + 4D (output) + 4 (1/rms);
    # attention: q, k, v gathered, SDPA's output (4 bytes each), its log-sum-exp per head, the output scattered
    # back and its int64 indices; the MLP: gate, silu(gate), up, their product
    norm = 16 + 16 + 16 + 4
    attention = 4 * (4 + 2 + 2 + 4) + 4 * 2 + 4 * 4 + 8
    mlp = 4 * 4 * 6
    assert block_saved(TINY, 4, 1.0) == 2 * norm + attention + mlp == 280
    assert block_saved(TINY, 4, 1.0, "block") == 16  # a checkpointed block keeps its input
    assert block_saved(TINY, 4, 1.0, "mlp") == 280 - mlp
    setup = TrainSetup(shard_size=1, seq_lens=(8,), response_tokens=4, compute_bytes=4, head="torch",
                       foreach=False, micro_batches=1)
    acts = activations(TINY, setup)
    # 8 tokens: 2 blocks, RoPE's cos and sin (2 x 4 x head_dim), the bucket's int64 index and bool mask
    assert acts["blocks"] == 8 * (2 * 280 + 16 + 9)
    # the final norm without its output (52 - 16) per token; the head's hidden row, lse and target per response token
    assert acts["head"] == 8 * 36 + 4 * (16 + 4 + 8)
    forward = {t.name: t.bytes for t in train_phases(TINY, setup)[0].terms}
    assert forward == {
        "parameters (fp32, sharded)": 4 * 356, "optimizer state (AdamW, fp32, sharded)": 8 * 356,
        "gradients of earlier micro-batches": 0, "unsharded root (embedding, norm, head)": 4 * 84,
        "saved activations": 8 * 585 + 400,
        "log-prob head forward (torch)": 2 * 4 * 10 * 4}  # the [chunk, V] logits and logsumexp's temporary


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_saved_is_what_autograd_keeps(kind, dtype):
    """The hand count of a native block's saved tensors equals what ``saved_tensors_hooks`` sees."""
    from rollpacker.model import CausalAttention, ModelArgs, Transformer
    from rollpacker.model.transformer import rope_cos_sin

    cfg = dict(model_type=kind, vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = Transformer(ModelArgs.from_hf(cfg)).to(dtype)
    tokens = 64
    x = torch.randn(tokens, 64, dtype=dtype, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(tokens), model.inv_freq, dtype)
    attn = CausalAttention([tokens])
    kept = [(b.index, b.valid, b.rows) for b in attn.buckets]
    shared = {t.untyped_storage().data_ptr() for t in (cos, sin, *(x for k in kept for x in k))}
    shared |= {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, cos, sin, 0, attn)
    mine = sum(n for ptr, n in saved.items() if ptr not in shared)
    assert mine == tokens * block_saved(Shape.from_hf(cfg), dtype.itemsize, 1.0)


def test_every_gpu_preset_fits_an_h100_with_ten_percent_headroom(capsys):
    from rollpacker.plan.memory import main

    for preset in ("qwen2.5-7b-8k", "qwen2.5-14b-16k", "qwen2.5-32b-32k"):
        with pytest.raises(SystemExit) as done:
            main(["--preset", preset, "--gpu-memory-gb", "80"])
        assert done.value.code == 0
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert last["fits"] is True and last["headroom"] >= 0.10, (preset, last)
        assert 0 < last["peak_gb"] <= 72


def test_a_preset_that_cannot_fit_is_refused_naming_the_largest_term_and_the_fix():
    from rollpacker.config import parse
    from rollpacker.plan.memory import QWEN2_5, check_fits

    config = parse(["--preset", "qwen2.5-32b-32k", "--train.activation-checkpointing", "none"])
    with pytest.raises(ValueError) as refused:
        check_fits(config, Shape.from_hf(QWEN2_5["Qwen2.5-32B"]), world_size=8, capacity=80 * GB)
    assert str(refused.value) == (
        "memory plan: the backward (blocks) peak is 746.4 GB per GPU, over the 80.0 GB this GPU has. "
        "Largest term: saved activations, 731.2 GB; set train.activation-checkpointing full to shrink it "
        "(python -m rollpacker.plan.memory shows every term)")


def test_checkpointed_blocks_follow_the_mode():
    from rollpacker.model.parallelize import checkpointed

    assert checkpointed(5, "none", 2, "block") == []
    assert checkpointed(3, "full", 2, "mlp") == [(0, "block"), (1, "block"), (2, "block")]
    assert checkpointed(5, "selective", 2, "attention") == [(0, "attention"), (2, "attention"), (4, "attention")]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gemma2", "gemma3", "mistral"])
def test_block_saved_estimates_hugging_face_layers(kind, tmp_path):
    """The same count estimates the transformers layers of the hf path (Qwen3-MoE's routed experts,
    Gemma's four norms a block) within 5% of what autograd keeps (the attention mask included)."""
    from support.models import make_hf_model

    from rollpacker.model.hf_decoder import load_hf, read_config

    path = make_hf_model(tmp_path, kind, hidden_size=128, intermediate_size=256, head_dim=32)
    model, tokens = load_hf(path), 256
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, 100, (tokens,)), torch.arange(tokens))
    measured = sum(n for ptr, n in saved.items() if ptr not in params)
    shape = Shape.from_hf(read_config(path))
    planned = tokens * shape.num_layers * block_saved(shape, 4, 1.0)
    assert abs(planned - measured) <= 0.05 * measured, (planned, measured)
