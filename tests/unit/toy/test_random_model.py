"""``rollpacker.toy.random_model``: a Qwen2-shaped random model in HF format that our loader and
transformers both read, with the toy tokenizer."""

from __future__ import annotations

import pytest
import torch

from rollpacker.toy.random_model import RandomModelConfig, write


def test_writes_a_model_both_loaders_read_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollpacker.model import CausalAttention, load_model

    cfg = RandomModelConfig(out=tmp_path / "m", num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=1,
                            intermediate_size=96, max_position_embeddings=128)
    count = write(cfg)
    ours = load_model(cfg.out)
    assert (ours.args.num_layers, ours.args.head_dim, ours.args.num_kv_heads) == (2, 32, 1)
    assert count == sum(p.numel() for p in ours.parameters())
    ids = AutoTokenizer.from_pretrained(cfg.out)("12+7=")["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(cfg.out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
        mine = ours.logits(ours(torch.tensor(ids), torch.arange(len(ids)), CausalAttention([len(ids)])))
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_bad_shapes_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="hidden_size=1024 must divide into num_heads=3"):
        RandomModelConfig(out=tmp_path, num_heads=3)
