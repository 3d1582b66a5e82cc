"""Shared by the vLLM tests and their torchrun scripts: the head_dim-32 model pair and HF references."""

from __future__ import annotations

from pathlib import Path

import torch

MODEL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=344,
             vocab_size=258, tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=257)


def make_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random Qwen2 (head_dim 32, tied head) and a copy with other weights."""
    from transformers import AutoModelForCausalLM

    from conftest import make_hf_model

    a = make_hf_model(root / "m32", "qwen2", **MODEL)
    model = AutoModelForCausalLM.from_pretrained(a, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root / "m32b")
    return a, root / "m32b"


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits predicting each of ``tokens`` [len(tokens), vocab]."""
    logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(num)]
