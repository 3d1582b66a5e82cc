"""``python -m rollpacker.bench engine``: rollout engines side by side on the same model and tokens.

It compares TorchEngine, vLLM in-process, SGLang and transformers' ``generate`` (``--engines``).
It measures throughput by batch size, TorchEngine's fraction of the FLOP limit, the adapters'
overhead, decode step time against running requests, and a ragged stream. The last stdout line
is one JSON object.

Invariants:

- One run, one machine, one thread count. Every response's length is forced (greedy, EOS ignored).
- The engines alternate, and the fastest of ``repeats`` calls counts (robust to a shared machine).
- ``same_tokens_*`` checks each engine's greedy tokens against the first engine's.

Why: ``engine.kind auto`` rests on these figures, so they are taken on the same tokens.
``--out`` writes the decode curve for the simulator. Each measurement and key: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollpacker.rollout.probe import decode_step_ms, greedy_requests, peak_flops, random_prompts

if TYPE_CHECKING:
    from rollpacker.model import Transformer

PROG = "python -m rollpacker.bench engine"


@dataclass(kw_only=True)
class EngineBenchConfig:
    model: str = ""
    """Hugging Face model directory; empty means the toy model (rollpacker.toy.model)."""
    engines: tuple[Literal["torch", "vllm", "sglang", "hf"], ...] = ("torch", "hf")
    """Engines compared on the same prompts: TorchEngine, vLLM in-process, SGLang, transformers' generate."""
    batch_sizes: tuple[int, ...] = (1, 8, 32, 128)
    """Batch sizes of the throughput comparison."""
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
    device: Literal["cpu", "cuda"] = "cpu"
    """Where TorchEngine, transformers and the peak matmul run (vLLM and SGLang pick their own device)."""

    def __post_init__(self) -> None:
        if not self.engines or len(set(self.engines)) != len(self.engines):
            raise ValueError(f"bench.engines must be distinct and non-empty, got {self.engines}")
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


# ---- the engines ---------------------------------------------------------------------------------


def kv_tokens(max_num_seqs: int, max_len: int, block: int) -> int:
    """KV tokens for ``max_num_seqs`` sequences of ``max_len`` tokens in ``block``-token blocks, plus one block each."""
    return max_num_seqs * (-(-max_len // block) + 1) * block


def build_engine(kind: str, path: Path, model: Transformer, max_num_seqs: int, max_len: int):
    """A contract engine (``torch``, ``vllm`` or ``sglang``) whose KV cache holds ``max_num_seqs``
    sequences of ``max_len`` tokens (no preemption)."""
    from rollpacker.rollout.config import EngineConfig

    args = model.args
    block = 128 if kind == "vllm" else 16  # vLLM's CPU block size
    kv_mb = kv_tokens(max_num_seqs, max_len, block) * args.kv_elements_per_token * model.norm.weight.element_size()
    config = EngineConfig(kind=kind, block_size=block, kv_memory_mb=max(kv_mb / 2**20, 1.0), max_num_seqs=max_num_seqs,
                          max_prefill_tokens=max_num_seqs * max_len, max_model_len=max_len, memory_fraction=0.2)
    if kind == "torch":
        from rollpacker.rollout.torch_engine import TorchEngine

        return TorchEngine(model, config)
    if kind == "sglang":
        import torch

        from rollpacker.rollout.sglang_engine import SGLangEngine

        return SGLangEngine(path, config, dtype=torch.float32, log_level="warning")
    from rollpacker.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(path, config)


def run_engine(engine, prompts: list[list[int]], new_tokens: int) -> Throughput:
    """Generate ``new_tokens`` greedy tokens for every prompt; the first step is their prefill."""
    for r in greedy_requests(prompts, new_tokens, "tput"):
        engine.add(r)
    preempted = engine.stats().num_preemptions
    start = time.perf_counter()
    done = engine.step()
    if type(engine).__name__ == "SGLangEngine":  # its step() returns on the first arrival: wait for every first token
        while engine.stats().num_waiting and engine.has_unfinished():
            done += engine.step()
    prefill = time.perf_counter() - start
    if engine.stats().num_waiting:
        raise RuntimeError("bench: the prompts did not fit one prefill; the engine is sized wrong")
    while engine.has_unfinished():
        done += engine.step()
    total = time.perf_counter() - start
    if engine.stats().num_preemptions != preempted:
        raise RuntimeError(f"bench: {type(engine).__name__} preempted requests; the KV cache is sized wrong")
    by_id = {o.id: o.token_ids for o in done}
    tokens = [by_id[f"tput-{i}"] for i in range(len(prompts))]
    return Throughput(batch=len(prompts), new_tokens=new_tokens, total_s=total, prefill_s=prefill, tokens=tokens)


def run_vllm_direct(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """The same work as :func:`run_engine` on VLLMEngine, calling vLLM's ``LLMEngine`` directly (the
    adapter's sampling settings, outputs kept as they come): seconds, for the adapter's overhead."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = engine.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        llm.add_request(f"direct-{i}", {"prompt_token_ids": p}, params)
        tokens[f"direct-{i}"] = []
    start = time.perf_counter()
    while llm.has_unfinished_requests():
        for o in llm.step():
            tokens[o.request_id] += o.outputs[0].token_ids
    seconds = time.perf_counter() - start
    if any(len(t) != new_tokens for t in tokens.values()):
        raise RuntimeError("bench: vLLM driven directly generated the wrong number of tokens")
    return seconds


def run_sglang_direct(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """The same work as :func:`run_engine` on SGLangEngine, as one ``async_generate`` batch of the
    adapter's own ``sgl.Engine`` (the adapter's sampling settings, log-probs returned, no streaming),
    on its event-loop thread: seconds, for the adapter's overhead."""
    import asyncio

    from rollpacker.rollout.engine import SamplingParams
    from rollpacker.rollout.sglang_engine import sglang_params

    params = sglang_params(SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True), new_tokens,
                           engine.eos_ids, seed=0)
    call = engine.engine.async_generate(input_ids=prompts, sampling_params=params, return_logprob=True)
    start = time.perf_counter()
    outs = asyncio.run_coroutine_threadsafe(call, engine.loop).result()
    seconds = time.perf_counter() - start
    if any(len(o["output_ids"]) != new_tokens for o in outs):
        raise RuntimeError(f"bench: SGLang driven directly generated {[len(o['output_ids']) for o in outs]} tokens, "
                           f"not {new_tokens} each")
    return seconds


def run_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> Throughput:
    """The same work through ``model.generate`` (greedy, EOS off, default cache, left padding)."""
    import torch

    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)  # equal lengths: left padding adds nothing

    prefilled: list[float] = []

    def first_logits(input_ids, scores):  # HF calls it after each forward: the first call ends the prefill
        if not prefilled:
            prefilled.append(time.perf_counter())
        return scores

    start = time.perf_counter()  # the prefill timed in the same call as the total (a call of its own differed)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=pad_id, logits_processor=[first_logits])
    total = time.perf_counter() - start
    generated = out[:, ids.shape[1]:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"bench: HF generated {generated.shape[1]} tokens, not {new_tokens}")
    return Throughput(batch=len(prompts), new_tokens=new_tokens, total_s=total, prefill_s=prefilled[0] - start,
                      tokens=generated.tolist())


def load_hf(path: Path, device: str = "cpu"):
    """transformers' own model from the same directory, fp32, EOS switched off in its generation config."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
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


def run_ragged(engine, requests: list) -> tuple[float, int]:
    """Serve ``requests`` (all queued at once) to the end: (seconds, generated tokens)."""
    import copy

    for r in copy.deepcopy(requests):
        engine.add(r)
    preempted, generated = engine.stats().num_preemptions, engine.stats().num_generated_tokens
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    seconds = time.perf_counter() - start
    if engine.stats().num_preemptions != preempted:
        raise RuntimeError(f"bench: {type(engine).__name__} preempted requests; the KV cache is sized wrong")
    return seconds, engine.stats().num_generated_tokens - generated


# ---- the run -------------------------------------------------------------------------------------

NAMES = {"torch": "TorchEngine", "vllm": "vLLM", "sglang": "SGLang", "hf": "HF"}
KEYS = {"torch": "torchengine", "vllm": "vllm", "sglang": "sglang", "hf": "hf"}
DIRECT = {"vllm": run_vllm_direct, "sglang": run_sglang_direct}
"""Engine kind -> the same work driven through the library directly (the adapter's overhead)."""
"""Engine kind -> its name in the tables and in the JSON keys."""


def run(cfg: EngineBenchConfig) -> dict:
    """Every measurement; prints the tables and returns the summary (the JSON line)."""
    import torch
    from rich.console import Console

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 160  # piped to a file: do not squeeze the tables to 80 columns
    path, model, hf, avoid, pad_id = open_model(cfg)
    args = model.args
    max_len = cfg.prompt_len + max(cfg.max_new_tokens, cfg.decode_steps + 3)
    kinds = [k for k in cfg.engines if k != "hf"]  # the contract engines
    engines = {k: build_engine(k, path, model, max(*cfg.batch_sizes, *cfg.decode_batch_sizes), max_len)
               for k in kinds}
    threads, load = torch.get_num_threads(), os.getloadavg()[0]
    if load > 0.5:
        console.print(
            f"[yellow]warning[/yellow]: load average {load:.1f} before the bench on {os.cpu_count()} cores: other "
            "processes share the CPU, so timings are noisy (multi-threaded ones badly); --num-threads 1 is steadier"
        )
    console.print(
        f"[bold]engine bench[/bold]: {path.name} ({args.model_type}, {matmul_params(model) / 1e6:.2f}M matmul params, "
        f"{args.num_layers} layers, hidden {args.hidden_size}), fp32 on {cfg.device}, {threads} threads, "
        f"torch {torch.__version__}, "
        f"prompt {cfg.prompt_len} tokens, {cfg.max_new_tokens} new tokens, engines {', '.join(cfg.engines)}"
    )

    peak = peak_flops(cfg.matmul_size, cfg.matmul_reps, cfg.device)
    context = cfg.prompt_len + cfg.max_new_tokens / 2
    fpt = flops_per_token(model, context)
    with torch.inference_mode():
        results, direct = measure_batches(cfg, engines, hf, args.vocab_size, avoid, pad_id)
        stepped = {k: e for k, e in engines.items() if k != "sglang"}  # SGLang's step() is not one decode step
        curves = {kind: {n: statistics.median(decode_step_ms(engine, n, cfg.prompt_len, args.vocab_size, avoid,
                                                             cfg.decode_steps, cfg.seed))
                         for n in cfg.decode_batch_sizes}
                  for kind, engine in stepped.items()}
        ragged = measure_ragged(cfg, stepped, lambda kind, seqs, length: build_engine(kind, path, model, seqs, length),
                                args.vocab_size, avoid) if cfg.ragged_requests else {}
        engines |= stepped  # the ragged stream rebuilt them
        for engine in engines.values():
            engine.shutdown()

    summary = throughput_table(console, cfg, results, direct, fpt, peak)
    console.print(
        f"tok/s = batch * new tokens / wall time of the whole call (prefill included); decode tok/s "
        f"excludes the prefill. FLOPs/token = 2 * {matmul_params(model):,} matmul params + 4 * "
        f"{args.num_layers} layers * {context:.0f} mean context * {args.num_heads * args.head_dim} "
        f"= {fpt / 1e6:.2f} MFLOP; peak = best {cfg.matmul_size}^2 fp32 matmul = {peak / 1e9:.1f} GFLOP/s "
        f"({threads} threads). 'same tokens': rows whose greedy tokens match the {NAMES[cfg.engines[0]]}'s exactly."
    )
    console.print(curve_table(cfg, curves))
    for kind, (seconds, generated) in ragged.items():
        console.print(
            f"Ragged stream: {cfg.ragged_requests} requests ({generated:,} generated tokens) through "
            f"{cfg.ragged_running} running slots: {seconds:.2f} s, {generated / seconds:,.0f} tok/s ({NAMES[kind]})"
        )
        summary[f"ragged_tok_s_{KEYS[kind]}"] = round(generated / seconds, 1)
    summary |= {"peak_gflops": round(peak / 1e9, 2), "flops_per_token": round(fpt), "num_threads": threads,
                "loadavg_before": round(load, 2)}
    for kind, curve in curves.items():
        key = "decode_ms_per_iter" if kind == next(iter(curves)) else f"decode_ms_per_iter_{KEYS[kind]}"
        summary[key] = {str(n): round(ms, 3) for n, ms in curve.items()}
    if cfg.out is not None and curves:
        write_curve(cfg, path.name, threads, next(iter(curves)), summary)
        console.print(f"decode curve ({NAMES[next(iter(curves))]}) written to {cfg.out}")
    return summary


def open_model(cfg: EngineBenchConfig):
    """The benched model: its directory, our fp32 ``Transformer``, transformers' model, the token ids
    random prompts avoid (EOS and padding), and the padding id."""
    import torch

    from rollpacker.model import load_model

    if cfg.model:
        path = Path(cfg.model)
    else:
        from rollpacker.toy.model import toy_model_dir

        path = toy_model_dir()
    if cfg.device == "cuda":  # fp32 as on CPU: the engines' greedy tokens compared exactly
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    model = load_model(path, cfg.device, torch.float32)
    hf = load_hf(path, cfg.device)
    avoid = set(model.args.eos_token_ids) | {hf.generation_config.pad_token_id, hf.config.pad_token_id} - {None}
    return path, model, hf, avoid, min(avoid) if avoid else 0


def write_curve(cfg: EngineBenchConfig, model_name: str, threads: int, engine: str, summary: dict) -> None:
    """``--out``: the first contract engine's decode curve and the summary, as JSON (the cost model's
    ``fit_calibration`` input)."""
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "model": model_name, "dtype": "float32", "num_threads": threads, "prompt_len": cfg.prompt_len,
        "context_len": [cfg.prompt_len + 2, cfg.prompt_len + cfg.decode_steps + 1], "engine": engine,
        "decode_ms_per_iter": summary["decode_ms_per_iter"], "summary": summary,
    }
    cfg.out.write_text(json.dumps(record, indent=2) + "\n")


def measure_batches(cfg: EngineBenchConfig, engines: dict, hf, vocab_size: int, avoid: set[int], pad_id: int
                    ) -> tuple[dict[int, dict[str, Throughput]], dict[int, float]]:
    """Per batch size, every engine's best of ``cfg.repeats`` generate calls on the same prompts (after
    a warm-up call each), and vLLM and SGLang driven directly when they run: per kind, per batch size, seconds."""
    results: dict[int, dict[str, Throughput]] = {}
    direct: dict[str, dict[int, float]] = {k: {} for k in DIRECT if k in engines}
    for b in cfg.batch_sizes:
        prompts = random_prompts(b, cfg.prompt_len, vocab_size, avoid, cfg.seed + b)

        def call(kind: str, n: int) -> Throughput:
            return run_hf(hf, prompts, n, pad_id) if kind == "hf" else run_engine(engines[kind], prompts, n)

        for kind in cfg.engines:
            call(kind, min(cfg.warmup_tokens, cfg.max_new_tokens))
        runs, direct_runs = [], []
        for _ in range(cfg.repeats):  # the direct calls in turn with the adapters': load moves both alike
            runs.append({kind: call(kind, cfg.max_new_tokens) for kind in cfg.engines})
            direct_runs.append({kind: DIRECT[kind](engines[kind], prompts, cfg.max_new_tokens) for kind in direct})
        results[b] = {kind: min((r[kind] for r in runs), key=lambda r: r.total_s) for kind in cfg.engines}
        for kind in direct:
            direct[kind][b] = min(r[kind] for r in direct_runs)
    return results, direct


def measure_ragged(cfg: EngineBenchConfig, engines: dict, build, vocab_size: int, avoid: set[int]
                   ) -> dict[str, tuple[float, int]]:
    """Each engine, rebuilt by ``build(kind, max_seqs, max_len)`` with ``cfg.ragged_running`` slots
    (replacing ``engines[kind]``), on the same ragged stream: its best (seconds, generated tokens)."""
    stream = ragged_stream(cfg.ragged_requests, cfg.prompt_len, cfg.max_new_tokens, vocab_size, avoid, cfg.seed)
    ragged = {}
    for kind in list(engines):
        engines[kind].shutdown()  # vLLM: one engine per process at a time
        engines[kind] = build(kind, cfg.ragged_running, 2 * (cfg.prompt_len + cfg.max_new_tokens))
        run_ragged(engines[kind], stream[: max(1, len(stream) // 4)])  # warm-up
        ragged[kind] = min((run_ragged(engines[kind], stream) for _ in range(cfg.repeats)), key=lambda r: r[0])
    return ragged


def curve_table(cfg: EngineBenchConfig, curves: dict[str, dict[int, float]]):
    """The decode step's cost by running requests, per engine, and against 1 running."""
    from rich.table import Table

    table = Table(title=f"Decode step vs running requests (context {cfg.prompt_len + 2}.."
                        f"{cfg.prompt_len + cfg.decode_steps + 1} tokens, median of {cfg.decode_steps})")
    table.add_column("running", justify="right")
    for kind in curves:
        for col in ("ms / step", f"vs {min(cfg.decode_batch_sizes)} running", "tok/s"):
            table.add_column(f"{NAMES[kind]} {col}", justify="right")
    for n in cfg.decode_batch_sizes:
        row = [str(n)]
        for curve in curves.values():
            row += [f"{curve[n]:.2f}", f"{curve[n] / curve[min(curve)]:.2f}x", f"{1e3 * n / curve[n]:,.0f}"]
        table.add_row(*row)
    return table


def throughput_table(console, cfg: EngineBenchConfig, results: dict[int, dict[str, Throughput]],
                     direct: dict[str, dict[int, float]], fpt: float, peak: float) -> dict:
    """Print the throughput table; its figures for the summary."""
    from rich.table import Table

    first = cfg.engines[0]
    table = Table(title="Generate throughput, same prompts and tokens (generated tokens only)")
    table.add_column("batch", justify="right")
    for kind in cfg.engines:
        for col in ("tok/s", "decode tok/s") + (("same tokens",) if kind != first else ()):
            table.add_column(f"{NAMES[kind]} {col}", justify="right")
    pairs = [(a, b) for a, b in (("torch", "hf"), ("torch", "vllm"), ("vllm", "hf"), ("torch", "sglang"))
             if {a, b} <= set(cfg.engines)]
    for a, b in pairs:
        table.add_column(f"{NAMES[a]}/{NAMES[b]}", justify="right")
    if "torch" in cfg.engines:
        table.add_column("TorchEngine GFLOP/s (of peak)", justify="right")
    for kind in direct:
        table.add_column(f"{NAMES[kind]} adapter overhead", justify="right")
    summary: dict = {}
    for b, by_kind in results.items():
        row = [str(b)]
        for kind, t in by_kind.items():
            same = sum(x == y for x, y in zip(t.tokens, by_kind[first].tokens)) / b
            row += [f"{t.tok_s:,.0f}", f"{t.decode_tok_s:,.0f}"]
            summary[f"tok_s_{KEYS[kind]}_batch{b}"] = round(t.tok_s, 1)
            summary[f"decode_tok_s_{KEYS[kind]}_batch{b}"] = round(t.decode_tok_s, 1)
            if kind != first:
                row.append(f"{same:.0%}")
                summary[f"same_tokens_{KEYS[kind]}_batch{b}"] = round(same, 4)
        for a, c in pairs:
            ratio = by_kind[a].tok_s / by_kind[c].tok_s
            row.append(f"{ratio:.2f}x")
            key = f"ratio_vs_hf_batch{b}" if (a, c) == ("torch", "hf") else f"ratio_{a}_vs_{c}_batch{b}"
            summary[key] = round(ratio, 3)
        if "torch" in by_kind:
            achieved = by_kind["torch"].decode_tok_s * fpt
            row.append(f"{achieved / 1e9:.2f} ({achieved / peak:.2%})")
            summary[f"flop_fraction_batch{b}"] = round(achieved / peak, 5)
        for kind, seconds in direct.items():
            overhead = by_kind[kind].total_s / seconds[b] - 1
            row.append(f"{overhead:+.1%}")
            summary[f"{kind}_adapter_overhead_batch{b}"] = round(overhead, 4)
        table.add_row(*row)
    console.print(table)
    for kind, seconds in direct.items():
        b = 32 if 32 in seconds else max((x for x in seconds if x < 32), default=max(seconds))
        summary[f"{kind}_adapter_overhead"] = summary[f"{kind}_adapter_overhead_batch{b}"]
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
