"""``python -m rollpacker.bench engine``: TorchEngine against transformers' ``generate``, same model.

One run, one machine, one thread count, four measurements:

1. **Throughput** at each batch size: ``batch`` prompts of ``prompt_len`` random token ids (no
   EOS or pad ids), each forced to exactly ``max_new_tokens`` greedy fp32 tokens
   (``ignore_eos=True`` for TorchEngine; EOS switched off in HF's generation config), under
   ``torch.inference_mode()``. HF runs ``generate`` with its default (dynamic) cache; every prompt
   has the same length, so left padding never adds work. ``tok/s`` counts generated tokens only,
   over the wall time of the whole call (prefill included). Prefill is also timed on its own:
   TorchEngine's first ``step()`` (every prompt fits one prefill), and for HF a separate
   ``generate`` call with one new token; ``decode tok/s`` is ``batch * (new - 1)`` over the rest.
   Each engine is warmed up once per batch size with a short call, then the two alternate for
   ``repeats`` timed calls each and the fastest call of each counts (robust to a shared machine).
2. **Fraction of the FLOP limit**: ``achieved = decode tok/s * flops_per_token``, where
   ``flops_per_token = 2 * P_matmul + 4 * num_layers * ctx * num_heads * head_dim`` with
   ``P_matmul`` every matmul weight (q/k/v/o, MLP and the LM head even when tied; no embedding
   lookup, norms or biases) and ``ctx`` the mean context length of the decode steps
   (``prompt_len + new / 2``); the second term is ``q.k`` and ``p.v`` over the context. The peak
   is the best of a few ``matmul_size``-square fp32 matmuls (``2 n^3`` FLOPs each) timed in the
   same run with the same threads.
3. **Decode step time against running requests**: N requests of ``prompt_len`` tokens are
   prefilled, then ``decode_steps`` pure decode ``step()`` calls are timed (median reported).
   The context stays in ``prompt_len + 2 .. prompt_len + decode_steps + 1`` tokens. ``--out``
   writes this curve as JSON for the cluster simulator.
4. **Ragged stream** (TorchEngine alone): ``ragged_requests`` greedy requests of random lengths
   (prompts of ``prompt_len / 2 .. 2 * prompt_len`` tokens, ``1 .. 2 * max_new_tokens`` new
   tokens, forced) are queued at once and served with ``ragged_running`` running slots, refilled
   as requests finish: the running set changes nearly every step, as in RL rollouts.
   ``ragged tok/s`` is generated tokens over the wall time of serving the whole stream (the
   fastest of ``repeats``, after a warm-up on a shorter stream).

The last stdout line is one JSON object: ``ratio_vs_hf_batch{B}``, ``tok_s_torchengine_batch{B}``,
``tok_s_hf_batch{B}``, ``flop_fraction_batch{B}``, ``same_tokens_batch{B}`` (fraction of rows whose
greedy tokens agree exactly) for each batch size, ``peak_gflops``, ``decode_ms_per_iter``
(N -> ms) and ``ragged_tok_s_torchengine``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rollpacker.rollout.probe import decode_step_ms, greedy_requests, peak_flops, random_prompts

if TYPE_CHECKING:
    import torch

    from rollpacker.model import Transformer
    from rollpacker.rollout.torch_engine import TorchEngine

PROG = "python -m rollpacker.bench engine"


@dataclass(kw_only=True)
class EngineBenchConfig:
    model: str = ""
    """Hugging Face model directory; empty means the toy model (rollpacker.data.toy_model)."""
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    """Batch sizes of the TorchEngine-vs-HF throughput comparison."""
    prompt_len: int = 16
    """Tokens per prompt (random ids, the same for both engines)."""
    max_new_tokens: int = 128
    """Tokens generated per prompt, forced (EOS ignored) and identical for both engines."""
    warmup_tokens: int = 16
    """New tokens of each engine's warm-up call at every batch size."""
    repeats: int = 2
    """Timed calls per engine and batch size, alternating engines; the fastest counts (shared machines)."""
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    """Numbers of running requests of the decode-step curve."""
    decode_steps: int = 10
    """Decode steps timed per point of the curve (median reported)."""
    ragged_requests: int = 192
    """Requests of the ragged stream (0 skips it)."""
    ragged_running: int = 64
    """Running slots (``max_num_seqs``) of the ragged stream, refilled as requests finish."""
    matmul_size: int = 2048
    """Side of the square fp32 matmul that measures the machine's peak FLOP/s."""
    matmul_reps: int = 5
    """Timed matmuls (the best one is the peak)."""
    num_threads: int = 0
    """torch intra-op threads for everything; 0 keeps torch's default."""
    seed: int = 0
    """Seed of the random prompts."""
    out: Path | None = None
    """Write the decode-step curve (and the summary) as JSON here."""

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "decode_batch_sizes"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) <= 0:
                raise ValueError(f"bench.{name} must be non-empty and positive, got {sizes}")
        for name in ("prompt_len", "max_new_tokens", "warmup_tokens", "repeats", "decode_steps", "matmul_size",
                     "matmul_reps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench.{name} must be positive, got {getattr(self, name)}")
        if self.max_new_tokens < 2:
            raise ValueError(
                f"bench.max_new_tokens must be >= 2 to separate prefill from decode, got {self.max_new_tokens}"
            )
        if self.num_threads < 0:
            raise ValueError(f"bench.num_threads must be >= 0, got {self.num_threads}")
        if self.ragged_requests < 0:
            raise ValueError(f"bench.ragged_requests must be >= 0, got {self.ragged_requests}")
        if self.ragged_running <= 0:
            raise ValueError(f"bench.ragged_running must be positive, got {self.ragged_running}")


@dataclass(kw_only=True)
class Throughput:
    batch: int
    new_tokens: int
    total_s: float
    """Wall time of the whole generate call."""
    prefill_s: float
    tokens: list[list[int]]
    """Generated ids per prompt."""

    @property
    def tok_s(self) -> float:
        return self.batch * self.new_tokens / self.total_s

    @property
    def decode_tok_s(self) -> float:
        return self.batch * (self.new_tokens - 1) / max(self.total_s - self.prefill_s, 1e-9)


# ---- the model's arithmetic --------------------------------------------------------------------


def matmul_params(model: Transformer) -> int:
    """Weights of every matmul of one token's forward: q/k/v/o, MLP, and the LM head (tied or not)."""
    args = model.args
    per_layer = sum(
        m.weight.numel() for layer in model.layers for m in (*_attn_linears(layer), *_mlp_linears(layer))
    )
    return per_layer + args.vocab_size * args.hidden_size


def _attn_linears(layer):
    a = layer.self_attn
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj


def _mlp_linears(layer):
    m = layer.mlp
    return m.gate_proj, m.up_proj, m.down_proj


def flops_per_token(model: Transformer, context: float) -> float:
    """2 FLOPs per matmul weight, plus q.k and p.v over ``context`` keys in every layer."""
    args = model.args
    return 2 * matmul_params(model) + 4 * args.num_layers * context * args.num_heads * args.head_dim


# ---- the two engines -----------------------------------------------------------------------------


def build_torch_engine(model: Transformer, max_num_seqs: int, max_len: int) -> TorchEngine:
    """An engine whose KV cache holds ``max_num_seqs`` sequences of ``max_len`` tokens (no preemption)."""
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine

    args, block = model.args, 16
    blocks = max_num_seqs * (-(-max_len // block) + 1)
    kv_mb = blocks * block * args.kv_elements_per_token * model.norm.weight.element_size() / 2**20
    config = EngineConfig(
        block_size=block, kv_memory_mb=max(kv_mb, 1.0), max_num_seqs=max_num_seqs,
        max_prefill_tokens=max_num_seqs * max_len,
    )
    return TorchEngine(model, config)


def run_torch_engine(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> Throughput:
    """Generate ``new_tokens`` greedy tokens for every prompt; the first step is their prefill."""
    for r in greedy_requests(prompts, new_tokens, "tput"):
        engine.add(r)
    preempted = engine.stats().num_preemptions
    start = time.perf_counter()
    done = engine.step()
    prefill = time.perf_counter() - start
    if engine.stats().num_waiting:
        raise RuntimeError("bench: the prompts did not fit one prefill; the engine is sized wrong")
    while engine.has_unfinished():
        done += engine.step()
    total = time.perf_counter() - start
    if engine.stats().num_preemptions != preempted:
        raise RuntimeError("bench: TorchEngine preempted requests; the KV cache is sized wrong")
    by_id = {o.id: o.token_ids for o in done}
    tokens = [by_id[f"tput-{i}"] for i in range(len(prompts))]
    return Throughput(batch=len(prompts), new_tokens=new_tokens, total_s=total, prefill_s=prefill, tokens=tokens)


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Throughput:
    """The same work through ``model.generate`` (greedy, EOS off, default cache, left padding)."""
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)  # equal lengths: left padding adds nothing

    def generate(n: int) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=pad_id,
        )
        return time.perf_counter() - start, out

    prefill, _ = generate(1)
    total, out = generate(new_tokens)
    generated = out[:, ids.shape[1]:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"bench: HF generated {generated.shape[1]} tokens, not {new_tokens}")
    return Throughput(batch=len(prompts), new_tokens=new_tokens, total_s=total, prefill_s=prefill,
                      tokens=generated.tolist())


def load_hf(path: Path):
    """transformers' own model from the same directory, fp32, EOS switched off in its generation config."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # forced length: nothing may stop a row early
    return model


def ragged_stream(num: int, prompt_len: int, new_tokens: int, vocab_size: int, avoid: set[int],
                  seed: int) -> list:
    """``num`` greedy requests of ``prompt_len / 2 .. 2 * prompt_len`` prompt tokens and
    ``1 .. 2 * new_tokens`` new tokens (forced), lengths uniform."""
    import random

    from rollpacker.rollout.engine import Request, SamplingParams

    rng = random.Random(seed)
    prompts = random_prompts(num, 2 * prompt_len, vocab_size, avoid, seed)
    return [
        Request(id=f"ragged-{i}", prompt_ids=p[: rng.randint(max(1, prompt_len // 2), 2 * prompt_len)],
                params=SamplingParams(max_new_tokens=rng.randint(1, 2 * new_tokens), temperature=0.0,
                                      ignore_eos=True))
        for i, p in enumerate(prompts)
    ]


def run_ragged(engine: TorchEngine, requests: list) -> tuple[float, int]:
    """Serve ``requests`` (all queued at once) to the end: (seconds, generated tokens)."""
    for r in requests:
        engine.add(r)
    preempted, generated = engine.stats().num_preemptions, engine.stats().num_generated_tokens
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    if engine.stats().num_preemptions != preempted:
        raise RuntimeError("bench: TorchEngine preempted requests; the KV cache is sized wrong")
    return seconds, engine.stats().num_generated_tokens - generated


# ---- the run -------------------------------------------------------------------------------------


def run(cfg: EngineBenchConfig) -> dict:
    """Every measurement; prints the tables and returns the summary (the JSON line)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from rollpacker.model import load_model

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    if cfg.model:
        path = Path(cfg.model)
    else:
        from rollpacker.data.toy_model import toy_model_dir

        path = toy_model_dir()
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160  # piped to a file: do not squeeze the tables to 80 columns
    threads = torch.get_num_threads()
    model = load_model(path, dtype=torch.float32)
    hf = load_hf(path)
    args = model.args
    avoid = set(args.eos_token_ids) | {hf.generation_config.pad_token_id, hf.config.pad_token_id} - {None}
    pad_id = min(avoid) if avoid else 0
    max_seqs = max(*cfg.batch_sizes, *cfg.decode_batch_sizes)
    engine = build_torch_engine(model, max_seqs, cfg.prompt_len + max(cfg.max_new_tokens, cfg.decode_steps + 3))
    load = os.getloadavg()[0]
    if load > 0.5:
        console.print(
            f"[yellow]warning[/yellow]: load average {load:.1f} before the bench on {os.cpu_count()} cores: other "
            "processes share the CPU, so timings are noisy (multi-threaded ones badly); --num-threads 1 is steadier"
        )
    console.print(
        f"[bold]engine bench[/bold]: {path.name} ({args.model_type}, {matmul_params(model) / 1e6:.2f}M matmul params, "
        f"{args.num_layers} layers, hidden {args.hidden_size}), fp32, {threads} threads, torch {torch.__version__}, "
        f"prompt {cfg.prompt_len} tokens, {cfg.max_new_tokens} new tokens"
    )

    peak = peak_flops(cfg.matmul_size, cfg.matmul_reps)
    context = cfg.prompt_len + cfg.max_new_tokens / 2
    fpt = flops_per_token(model, context)
    results: dict[int, tuple[Throughput, Throughput]] = {}
    with torch.inference_mode():
        for b in cfg.batch_sizes:
            prompts = random_prompts(b, cfg.prompt_len, args.vocab_size, avoid, cfg.seed + b)
            warm = min(cfg.warmup_tokens, cfg.max_new_tokens)
            run_torch_engine(engine, prompts, warm)
            run_hf(hf, prompts, warm, pad_id)
            runs = [(run_torch_engine(engine, prompts, cfg.max_new_tokens),
                     run_hf(hf, prompts, cfg.max_new_tokens, pad_id)) for _ in range(cfg.repeats)]
            results[b] = (min((r[0] for r in runs), key=lambda r: r.total_s),
                          min((r[1] for r in runs), key=lambda r: r.total_s))

        step_ms = {
            n: decode_step_ms(engine, n, cfg.prompt_len, args.vocab_size, avoid, cfg.decode_steps, cfg.seed)
            for n in cfg.decode_batch_sizes
        }

        ragged = None
        if cfg.ragged_requests:
            engine = build_torch_engine(model, cfg.ragged_running, 2 * (cfg.prompt_len + cfg.max_new_tokens))
            stream = ragged_stream(cfg.ragged_requests, cfg.prompt_len, cfg.max_new_tokens, args.vocab_size, avoid,
                                   cfg.seed)
            run_ragged(engine, stream[: max(1, len(stream) // 4)])  # warm-up
            ragged = min((run_ragged(engine, stream) for _ in range(cfg.repeats)), key=lambda r: r[0])
    curve = {n: statistics.median(ms) for n, ms in step_ms.items()}

    table = Table(title="Generate throughput: TorchEngine vs transformers generate (generated tokens only)")
    for col in ("batch", "TE tok/s", "HF tok/s", "TE/HF", "TE prefill ms", "HF prefill ms",
                "TE decode tok/s", "HF decode tok/s", "TE GFLOP/s", "of peak", "same tokens"):
        table.add_column(col, justify="right")
    summary: dict = {}
    for b, (ours, theirs) in results.items():
        ratio = ours.tok_s / theirs.tok_s
        achieved = ours.decode_tok_s * fpt
        same = sum(x == y for x, y in zip(ours.tokens, theirs.tokens)) / b
        table.add_row(
            str(b), f"{ours.tok_s:,.0f}", f"{theirs.tok_s:,.0f}", f"{ratio:.2f}x",
            f"{1e3 * ours.prefill_s:.1f}", f"{1e3 * theirs.prefill_s:.1f}",
            f"{ours.decode_tok_s:,.0f}", f"{theirs.decode_tok_s:,.0f}",
            f"{achieved / 1e9:.2f}", f"{achieved / peak:.2%}", f"{same:.0%}",
        )
        summary[f"ratio_vs_hf_batch{b}"] = round(ratio, 3)
        summary[f"tok_s_torchengine_batch{b}"] = round(ours.tok_s, 1)
        summary[f"tok_s_hf_batch{b}"] = round(theirs.tok_s, 1)
        summary[f"decode_tok_s_torchengine_batch{b}"] = round(ours.decode_tok_s, 1)
        summary[f"decode_tok_s_hf_batch{b}"] = round(theirs.decode_tok_s, 1)
        summary[f"flop_fraction_batch{b}"] = round(achieved / peak, 5)
        summary[f"same_tokens_batch{b}"] = round(same, 4)
    console.print(table)
    console.print(
        f"tok/s = batch * new tokens / wall time of the whole call (prefill included); decode tok/s "
        f"excludes the prefill. FLOPs/token = 2 * {matmul_params(model):,} matmul params + 4 * "
        f"{args.num_layers} layers * {context:.0f} mean context * {args.num_heads * args.head_dim} "
        f"= {fpt / 1e6:.2f} MFLOP; TE = TorchEngine; peak = best {cfg.matmul_size}^2 fp32 matmul = "
        f"{peak / 1e9:.1f} GFLOP/s ({threads} threads). 'same tokens': rows whose greedy tokens match exactly."
    )

    curve_table = Table(title=f"TorchEngine decode step vs running requests (context {cfg.prompt_len + 2}.."
                              f"{cfg.prompt_len + cfg.decode_steps + 1} tokens, median of {cfg.decode_steps})")
    for col in ("running", "ms / step (median)", "ms / step (min)", "tok/s (median)"):
        curve_table.add_column(col, justify="right")
    for n, ms in curve.items():
        curve_table.add_row(str(n), f"{ms:.2f}", f"{min(step_ms[n]):.2f}", f"{1e3 * n / ms:,.0f}")
    console.print(curve_table)

    if ragged is not None:
        seconds, generated = ragged
        console.print(
            f"Ragged stream: {cfg.ragged_requests} requests ({generated:,} generated tokens) through "
            f"{cfg.ragged_running} running slots: {seconds:.2f} s, {generated / seconds:,.0f} tok/s (TorchEngine)"
        )
        summary["ragged_tok_s_torchengine"] = round(generated / seconds, 1)

    summary["peak_gflops"] = round(peak / 1e9, 2)
    summary["flops_per_token"] = round(fpt)
    summary["num_threads"] = threads
    summary["loadavg_before"] = round(load, 2)
    summary["decode_ms_per_iter"] = {str(n): round(ms, 3) for n, ms in curve.items()}
    if cfg.out is not None:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "model": path.name, "dtype": "float32", "num_threads": threads, "prompt_len": cfg.prompt_len,
            "context_len": [cfg.prompt_len + 2, cfg.prompt_len + cfg.decode_steps + 1],
            "decode_ms_per_iter": summary["decode_ms_per_iter"], "summary": summary,
        }
        cfg.out.write_text(json.dumps(record, indent=2) + "\n")
        console.print(f"decode curve written to {cfg.out}")
    return summary


def main(argv: list[str] | None = None) -> dict:
    import tyro

    cfg = tyro.cli(EngineBenchConfig, args=sys.argv[1:] if argv is None else argv, prog=PROG)
    summary = run(cfg)
    sys.stdout.flush()
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
