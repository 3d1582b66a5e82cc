"""Shared by the vLLM and SGLang tests and their torchrun scripts: the head_dim-32 model pair and HF references."""

from __future__ import annotations

from pathlib import Path

import torch

MODEL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=344,
             vocab_size=258, tie_word_embeddings=True, max_position_embeddings=512, eos_token_id=257)


def make_pair(root: Path) -> tuple[Path, Path]:
    """A tiny random Qwen2 (head_dim 32, tied head) and a copy with other weights."""
    from support.models import make_hf_model

    a = make_hf_model(root / "m32", "qwen2", **MODEL)
    return a, perturbed(a, root / "m32b")


def perturbed(src: Path, dst: Path) -> Path:
    """A copy of the HF model ``src`` at ``dst`` with other weights (seeded noise)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(dst)
    return dst


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
