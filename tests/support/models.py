"""Tiny random Hugging Face model directories of every architecture the tests load."""

from __future__ import annotations

from pathlib import Path

import torch

HF_KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "mistral")
"""Architectures :func:`make_hf_model` builds; the native decoder runs the first three."""

GEMMA2_CAPPED = dict(attn_logit_softcapping=1.0, initializer_range=0.2)
"""Gemma-2 overrides under which its attention cap bites: attention logits of a few units against a cap of 1
(the tiny model's logits 0.99 apart without it; at the defaults, a cap of 50, 1e-6 apart)."""


def make_hf_model(path: Path, kind: str = "qwen2", **overrides) -> Path:
    """Save a tiny random Hugging Face model of ``kind`` (one of :data:`HF_KINDS`) to ``path``."""
    import transformers

    cls = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
           "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "mistral": "MistralConfig"}[kind]
    kw = dict(
        vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=100,
    )
    kw |= {  # what makes each architecture itself: experts, sliding windows next to full attention
        "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
        "gemma2": dict(sliding_window=8, head_dim=16),
        "gemma3": dict(sliding_window=8, head_dim=16, layer_types=["sliding_attention", "full_attention"]),
        "mistral": dict(sliding_window=None),
    }.get(kind, {})
    kw.update(overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**kw)).float()
    with torch.no_grad():  # HF initializes biases to 0 and norms to 1: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def make_reward_model(path: Path) -> Path:
    """Save a tiny random Qwen2 reward model (a sequence classifier with one label) with the toy task's
    tokenizer and its chat template to ``path``."""
    import transformers

    from rollpacker.toy.model import build_tokenizer

    tokenizer = build_tokenizer()
    config = transformers.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
