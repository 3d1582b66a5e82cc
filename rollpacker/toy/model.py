"""The toy model: a tiny Qwen2 decoder, briefly fine-tuned on the toy task, shipped with the package.

It is the default policy for CPU runs and tests: a real Hugging Face model directory
(``config.json``, ``model.safetensors``, a byte-level tokenizer without merges, so one token per
character) that any engine can load — head_dim 32, a size vLLM's CPU attention accepts — and small
enough (0.76M parameters, 3 MB) to generate fast on two CPU cores. Supervised fine-tuning on worked
solutions of :mod:`rollpacker.toy.task` stops early on purpose, at step 600 of a 1750-step
learning-rate schedule: the model follows the format at every length and is mostly right on two
terms, but it still slips on single-digit sums and on finding the later terms of longer prompts, so
one of eight sampled answers is often right where its greedy one is wrong. That is the room RL has:
the default job raises greedy accuracy on two- to four-term problems within minutes (docs/results.md,
"Why these settings", says why step 600).

``python -m rollpacker.toy.model build`` regenerates the artifacts deterministically (about
a minute on one idle core); ``eval`` reports greedy accuracy by problem length through the rollout
engine. :func:`toy_model_dir` returns the shipped directory, or builds one into a cache once if
the package was installed without it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from rollpacker.data.dataset import DataConfig, toy_rows
from rollpacker.model import CausalAttention, ModelArgs, Transformer, load_model, save_model
from rollpacker.rollout.config import EngineConfig
from rollpacker.rollout.engine import Request, SamplingParams, generate
from rollpacker.rollout.torch_engine import TorchEngine
from rollpacker.toy import task as toy
from rollpacker.train.trainer import warmup_cosine

logger = logging.getLogger(__name__)

TOY_MODEL_DIR = Path(__file__).parent / "weights"
EOS, PAD = "<|endoftext|>", "<|pad|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ 'A:' + m['content'] + '\\n' }}{% else %}{{ m['content'] + '\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A:' }}{% endif %}"
)
"""Chat turns written as the toy task writes a problem: a user turn "3+5" becomes the prompt "Q: 3+5\\nA:";
a system turn is its own line before it. String prompts do not use it: their tokens are as they were."""
EVAL_SEED = 1_000_003
"""Seed of ``eval``'s held-out problems (training draws its own from ``SFTConfig.seed``)."""
BUCKETS = ((2, 3), (4, 6), (7, 12), (13, 24), (25, toy.MAX_TERMS))
"""Ranges of the number of terms that ``eval`` reports accuracy for."""
MAX_NEW_TOKENS = 448
"""Generation limit of ``eval``, above the longest worked solution (385 tokens)."""


@dataclass(kw_only=True)
class SFTConfig:
    num_steps: int = 600
    """Optimizer steps: stops early on purpose (see the module docstring)."""
    schedule_steps: int = 1750
    """Length of the warmup-cosine learning-rate schedule; training stops at num_steps, part-way down it."""
    batch_tokens: int = 1024
    """Tokens (prompt and response) packed into one step's batch."""
    lr: float = 3e-3
    """Peak learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 50
    """Steps of linear warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay."""
    seed: int = 0
    """Seed of the initialization and of the training problems."""

    def __post_init__(self) -> None:
        for name in ("num_steps", "schedule_steps", "batch_tokens", "warmup_steps", "lr"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sft.{name} must be positive, got {getattr(self, name)}")
        if self.num_steps > self.schedule_steps:
            raise ValueError(f"sft.num_steps={self.num_steps} must be <= sft.schedule_steps={self.schedule_steps}")


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, one token per byte (no merges), so prompt and response ids concatenate to the
    ids of the concatenated text, and encoding adds no special tokens.

    Byte-level like Qwen2's own tokenizer: ``AutoTokenizer`` swaps in ``Qwen2Tokenizer`` for any
    ``qwen2`` config, and that class re-applies its byte-level pre-tokenizer, which changes
    nothing here."""
    vocab = {t: i for i, t in enumerate([EOS, PAD, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, PAD])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=1024)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(tokenizer: PreTrainedTokenizerFast) -> dict:
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=344,
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
    sched = torch.optim.lr_scheduler.LambdaLR(  # warm-up, then a cosine to 10% that stops part-way down
        opt, lambda step: warmup_cosine(step, cfg.warmup_steps, cfg.schedule_steps, 0.1))
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
        if step % 100 == 0 or step == cfg.num_steps - 1:
            logger.info("step %d/%d loss %.4f (%.0fs)", step + 1, cfg.num_steps, loss.item(),
                        time.perf_counter() - start)


@contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread: the same floating-point reductions on every machine, and no
    collapse when another process shares the cores (two spinning OpenMP threads left one free
    core run the toy model ~50x slower)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def build(out: Path, cfg: SFTConfig | None = None) -> None:
    """Make the toy model from scratch and write it (weights, config, tokenizer) to ``out``."""
    cfg = cfg or SFTConfig()
    torch.manual_seed(cfg.seed)
    tokenizer = build_tokenizer()
    model = Transformer(ModelArgs.from_hf(model_config(tokenizer)))
    model.init_weights()
    with single_thread():
        train(model, tokenizer, cfg)
    save_model(model, out)
    save_tokenizer(tokenizer, out)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    tokenizer.save_pretrained(out)
    # Name the class every transformers version knows (v5 writes its new alias TokenizersBackend).
    tok_cfg = out / "tokenizer_config.json"
    fields = {**json.loads(tok_cfg.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
    tok_cfg.write_text(json.dumps(fields, indent=2) + "\n")


def evaluate(path: Path, num: int, seed: int = EVAL_SEED, held_out: bool = True) -> list[tuple[str, int, float, float]]:
    """Greedy decoding of ``num`` held-out problems (of the training part: not ``held_out``) through the rollout
    engine: per term-count bucket, then overall, ``(bucket, num_problems, accuracy, mean_response_tokens)``."""
    engine = TorchEngine(load_model(path), EngineConfig())  # first: it names what a directory lacks
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = toy_rows(DataConfig(toy_tail_alpha=toy.PARETO_ALPHA), num, seed, held_out=held_out)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0.0)
    with single_thread():
        outs = generate(engine, [Request(id=r["id"], prompt_ids=tokenizer.encode(r["prompt"]), params=params)
                                 for r in rows])
    report = []
    for name, lo, hi in [*((f"{lo}-{hi}", lo, hi) for lo, hi in BUCKETS), ("overall", toy.MIN_TERMS, toy.MAX_TERMS)]:
        picked = [r for r in rows if lo <= r["num_terms"] <= hi]
        ids = [outs[r["id"]].token_ids for r in picked]
        scores = [toy.score(tokenizer.decode(i, skip_special_tokens=True), r["answer"]) for i, r in zip(ids, picked)]
        n = max(1, len(picked))
        report.append((name, len(picked), sum(scores) / n, sum(map(len, ids)) / n))
    return report


def shipped_or_built(shipped: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``shipped`` if the package has it; else a model built once (``build``) into ``$ROLLPACKER_CACHE/NAME``
    (default ``~/.cache/rollpacker/NAME``)."""
    if (shipped / "model.safetensors").is_file():
        return shipped
    cached = Path(os.environ.get("ROLLPACKER_CACHE", "~/.cache/rollpacker")).expanduser() / name
    if not (cached / "model.safetensors").is_file():
        logger.warning("%s is missing; building it into %s (minutes, once)", shipped, cached)
        tmp = cached.with_name(f"{name}.tmp-{os.getpid()}")
        build(tmp)
        try:
            tmp.rename(cached)
        except OSError:  # another process finished first
            shutil.rmtree(tmp)
    return cached


def toy_model_dir() -> Path:
    """The shipped toy model (or one built once into the cache: :func:`shipped_or_built`)."""
    return shipped_or_built(TOY_MODEL_DIR, "toy_model", build)


def refuse_out(out: Path, command: str) -> None:
    """Exit naming the fix where writing a model to ``out`` would fail (a file) or overwrite what is not a model."""
    if out.exists() and not out.is_dir():
        sys.exit(f"{command}: --out {out} is a file: name a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        sys.exit(f"{command}: --out {out} holds files that are not a model's, which the model's would overwrite: "
                 "name a new directory (or a model's, to write it again)")


def build_cmd(out: Path = TOY_MODEL_DIR, sft: SFTConfig = SFTConfig()) -> None:
    """Regenerate the toy model (deterministic) and write it to ``out``.

    Args:
        out: Directory to write the model to.
        sft: Fine-tuning settings.
    """
    refuse_out(out, "rollpacker.toy.model build")
    start = time.perf_counter()
    build(out, sft)
    logger.info("wrote %s in %.0fs", out, time.perf_counter() - start)


def eval_cmd(path: Path | None = None, num: int = 1000, training_part: bool = False) -> None:
    """Report the toy model's greedy accuracy by number of terms, on held-out problems.

    Args:
        path: Model directory; default: the shipped toy model.
        num: Number of problems (drawn from the task's heavy-tailed length distribution).
        training_part: Problems of the part training draws instead (the shipped model's SFT drew both parts).
    """
    if num < 1:
        sys.exit(f"rollpacker.toy.model eval: --num must be positive, got {num}")
    start = time.perf_counter()
    try:
        report = evaluate(path or toy_model_dir(), num, held_out=not training_part)
    except (ValueError, OSError) as e:  # a directory that is no model: its message names the fix
        sys.exit(f"rollpacker.toy.model eval: {e}")
    print(f"{'terms':>8} {'problems':>9} {'accuracy':>9} {'mean tokens':>12}")
    for name, n, acc, tokens in report:
        print(f"{name:>8} {n:>9} {acc:>9.3f} {tokens:>12.1f}")
    logger.info("evaluated in %.0fs", time.perf_counter() - start)


if __name__ == "__main__":
    import tyro

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    tyro.extras.subcommand_cli_from_dict({"build": build_cmd, "eval": eval_cmd})
