"""``python -m rollpacker.toy.random_model --out DIR``: a Qwen2-shaped model with random weights, in
Hugging Face format, with the toy task's byte-level tokenizer: engines measured at sizes the toy
model does not reach (the memory-bound regime of ``bench engine``), nothing downloaded.

The defaults are 16 layers, hidden 1024, 16 heads of 64 and 4 KV heads, intermediate 2816: 179M
parameters (0.72 GB in fp32), the size at which a CPU decode step streams its weights from DRAM
whatever the batch. Weights are drawn like the trainer's own initialization, so the logits are
those of an untrained model: fine for timing, and for replaying forced response lengths.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(kw_only=True)
class RandomModelConfig:
    out: Path
    """Directory to write (config.json, safetensors, tokenizer)."""
    num_layers: int = 16
    hidden_size: int = 1024
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 2816
    max_position_embeddings: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"random_model.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"random_model: hidden_size={self.hidden_size} must divide into num_heads="
                             f"{self.num_heads}, which must divide into num_kv_heads={self.num_kv_heads}")


def write(cfg: RandomModelConfig) -> int:
    """Write the model; returns its parameter count."""
    import torch
    from transformers import Qwen2Config

    from rollpacker.model import ModelArgs, Transformer, save_model
    from rollpacker.toy.model import build_tokenizer, save_tokenizer

    tokenizer = build_tokenizer()
    hf = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2ForCausalLM"], dtype="float32",
    ).to_dict()
    torch.manual_seed(cfg.seed)
    model = Transformer(ModelArgs.from_hf(hf))
    model.init_weights()
    save_model(model, cfg.out)
    save_tokenizer(tokenizer, cfg.out)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    import tyro

    from rollpacker.toy.model import refuse_out

    cfg = tyro.cli(RandomModelConfig, args=sys.argv[1:] if argv is None else argv,
                   prog="python -m rollpacker.toy.random_model")
    refuse_out(cfg.out, "rollpacker.toy.random_model")
    print(f"wrote {cfg.out}: {write(cfg) / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
