"""The toy model: a tiny Qwen2 decoder, briefly fine-tuned on the toy task, shipped with the package.

It is the default policy for CPU runs and tests: a real Hugging Face model directory
(``config.json``, ``model.safetensors``, a char-level tokenizer) that any engine can load, small
enough (about 1.6M parameters) to generate on two CPU cores. Supervised fine-tuning on worked
solutions of :mod:`rollpacker.data.toy` stops early on purpose: the model follows the format and
is often right on short problems, but its mistakes compound over the many steps of long ones, so
RL has something to improve and the longest responses are the ones that matter.

``python -m rollpacker.data.toy_model build`` regenerates the artifacts deterministically (a few
minutes on two cores); ``eval`` reports greedy accuracy by problem length through the rollout
engine. :func:`toy_model_dir` returns the shipped directory, or builds one into a cache once if
the package was installed without it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Qwen2Config

from rollpacker.data import toy
from rollpacker.model import CausalAttention, Transformer, load_model, ModelArgs, save_model

logger = logging.getLogger(__name__)

TOY_MODEL_DIR = Path(__file__).parent / "toy_model"
PAD, EOS, UNK = "<|pad|>", "<|endoftext|>", "<|unk|>"
CHARS = ["\n"] + [chr(c) for c in range(32, 127)]
"""The vocabulary besides the special tokens: newline and printable ASCII, one token each."""
EVAL_SEED = 1_000_003
BUCKETS = ((2, 3), (4, 6), (7, 12), (13, 24), (25, toy.MAX_TERMS))
"""Ranges of the number of terms that ``eval`` reports accuracy for."""


@dataclass(kw_only=True)
class SFTConfig:
    num_steps: int = 600
    """Optimizer steps."""
    batch_tokens: int = 4096
    """Tokens (prompt and response) packed into one step's batch."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 30
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the initialization and of the training problems."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "batch_tokens", "warmup_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SFTConfig.{name}={getattr(self, name)} must be positive")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; encoding adds no special tokens, so prompt and response ids
    concatenate to the ids of the concatenated text."""
    specials = [PAD, EOS, UNK]
    vocab = {t: i for i, t in enumerate(specials + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(specials)
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, unk_token=UNK, model_max_length=1024
    )


def model_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2ForCausalLM"],
        dtype="float32",
    ).to_dict()


def sft_batch(
    rng: random.Random, tokenizer: PreTrainedTokenizerFast, batch_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Fresh problems packed up to ``batch_tokens``: tokens, positions and targets (the next
    token on response positions, -100 elsewhere), all [T], and the sequence lengths."""
    tokens: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    seq_lens: list[int] = []
    while True:
        problem = toy.make_problem(rng)
        prompt = tokenizer.encode(problem["prompt"])
        ids = prompt + tokenizer.encode(toy.solution(problem)) + [tokenizer.eos_token_id]
        if seq_lens and len(tokens) + len(ids) > batch_tokens:
            break
        tokens += ids
        positions += range(len(ids))
        targets += [-100] * (len(prompt) - 1) + ids[len(prompt) :] + [-100]
        seq_lens.append(len(ids))
    return torch.tensor(tokens), torch.tensor(positions), torch.tensor(targets), seq_lens


def train(model: Transformer, tokenizer: PreTrainedTokenizerFast, cfg: SFTConfig) -> None:
    """Supervised fine-tuning on worked solutions, loss on response tokens only."""
    rng = random.Random(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min((s + 1) / cfg.warmup_steps, 0.55 + 0.45 * torch.cos(torch.tensor(s / cfg.num_steps * torch.pi)).item()),
    )
    start = time.perf_counter()
    for step in range(cfg.num_steps):
        tokens, positions, targets, seq_lens = sft_batch(rng, tokenizer, cfg.batch_tokens)
        logits = model.logits(model(tokens, positions, CausalAttention(seq_lens)))
        loss = F.cross_entropy(logits, targets, ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == cfg.num_steps - 1:
            logger.info("step %d/%d loss %.4f (%.0fs)", step + 1, cfg.num_steps, loss.item(), time.perf_counter() - start)


def build(out: Path, cfg: SFTConfig | None = None) -> None:
    """Make the toy model from scratch and write it (weights, config, tokenizer) to ``out``."""
    cfg = cfg or SFTConfig()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = Transformer(ModelArgs.from_hf(model_config(tokenizer)))
    model.init_weights()
    train(model, tokenizer, cfg)
    save_model(model, out)
    tokenizer.save_pretrained(out)
    # Name the class every transformers version knows (v5 writes its own new alias).
    tok_cfg = out / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


def toy_model_dir() -> Path:
    """The shipped toy model; if the package lacks it, one built once into
    ``$ROLLPACKER_CACHE/toy_model`` (default ``~/.cache/rollpacker/toy_model``)."""
    if (TOY_MODEL_DIR / "model.safetensors").is_file():
        return TOY_MODEL_DIR
    cached = Path(os.environ.get("ROLLPACKER_CACHE", "~/.cache/rollpacker")).expanduser() / "toy_model"
    if not (cached / "model.safetensors").is_file():
        logger.warning("%s is missing; building the toy model into %s (a few minutes, once)", TOY_MODEL_DIR, cached)
        tmp = cached.with_name(f"toy_model.tmp-{os.getpid()}")
        build(tmp)
        try:
            tmp.rename(cached)
        except OSError:  # another process finished first
            shutil.rmtree(tmp)
    return cached
