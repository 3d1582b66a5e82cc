"""``python -m rollpacker.bench spec-engine``: TorchEngine's speculative decoding on the toy model,
off against on, side by side in one run (``--device cuda``: on the GPU).

The workload is batches of the default job's rollout on one engine, sampled as the job samples.
Modes, on the same requests: ``off``, ``engine`` (the drafts the engine has alone) and ``epoch``
(also an earlier epoch's responses). Per mode it prints wall and CPU time, the tail's time, engine
steps, acceptance by source, and tokens changed against ``off``, with the measured cost table.

Invariants:

- Each mode's cost table is measured once, before timing.
- The modes alternate, and the fastest of ``repeats`` runs counts.
- ``tokens_changed`` must be 0.

Why: the engine alone isolates what a verify step costs from what the job around it adds.
The workload, the columns and the keys: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

from rollpacker.bench import json_line, ratio
from rollpacker.rollout.config import MAX_SPEC_TOKENS

PROG = "python -m rollpacker.bench spec-engine"
MODES = ("off", "engine", "epoch")


@dataclass(kw_only=True)
class SpecBenchConfig:
    num_prompts: int = 16
    """Prompts per batch (the default job's rollout.num_prompts)."""
    group_size: int = 8
    """Responses per prompt in the job (the default job's rollout.group_size)."""
    replicas: int = 2
    """Engine replicas the job routes a group over (the default job: 2 ranks); this engine gets group_size / replicas
    of each group."""
    batches: int = 3
    """Batches of prompts, each drawn with its own seed."""
    repeats: int = 2
    """Timed runs per mode and batch, alternating modes; the fastest counts."""
    spec_max_tokens: int = 8
    """engine.spec_max_tokens of the speculative modes."""
    tail_running: int = 8
    """A step belongs to the tail when at most this many requests are queued or running."""
    num_threads: int = 1
    """torch threads (the default job: one per rank)."""
    seed: int = 0
    """Seed of the batches' prompts and of the responses' sampling seeds."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where the engines run (the toy model, fp32)."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "group_size", "replicas", "batches", "repeats", "tail_running", "num_threads"):
            if getattr(self, name) <= 0:
                raise ValueError(f"bench.{name} must be positive, got {getattr(self, name)}")
        if not 1 <= self.spec_max_tokens <= MAX_SPEC_TOKENS:  # else refused after the model loads
            raise ValueError(f"bench.spec_max_tokens must be in [1, {MAX_SPEC_TOKENS}], got {self.spec_max_tokens}")
        if self.group_size % self.replicas:
            raise ValueError(f"bench.group_size={self.group_size} must be a multiple of bench.replicas={self.replicas}")


@dataclass
class Run:
    """One rollout of a batch in one mode."""

    outputs: dict
    total_s: float
    tail_s: float
    steps: int
    cpu_s: float = 0.0
    """This process's CPU time over the rollout (one thread: what a shared machine's load barely moves)."""
    tail_cpu_s: float = 0.0
    spec: object = None
    """The engine's SpecStats after the run."""


@dataclass
class ModeTotals:
    total_s: float = 0.0
    tail_s: float = 0.0
    cpu_s: float = 0.0
    tail_cpu_s: float = 0.0
    steps: int = 0
    tokens_changed: int = 0
    responses_changed: int = 0
    spec: object = None
    runs: list = field(default_factory=list)


def batch_requests(cfg: SpecBenchConfig, tokenizer, rows: list[dict], batch: int, epoch: bool = False,
                   context: dict | None = None) -> list:
    """The requests of one batch: ``group_size / replicas`` per prompt, seeded; ``epoch`` draws the
    earlier epoch's seeds instead; ``context`` (prompt index -> responses) is offered to each."""
    from rollpacker.rollout.config import RolloutConfig
    from rollpacker.rollout.engine import DraftContext, Request

    r = RolloutConfig()
    per_prompt = cfg.group_size // cfg.replicas
    picked = random.Random(cfg.seed * 1000 + batch).sample(rows, cfg.num_prompts)
    reqs = []
    for i, row in enumerate(picked):
        ids = tokenizer.encode(row["prompt"])
        offered = tuple(DraftContext(source="epoch", token_ids=tuple(t)) for t in (context or {}).get(i, ()))
        for j in range(per_prompt):
            seed = (cfg.seed * 7919 + batch) * 100_003 + i * per_prompt + j + (50_000 if epoch else 0)
            params = r.sampling(stop=(), stop_token_ids=(), seed=seed)
            reqs.append(Request(id=f"{i}:{j}", prompt_ids=ids, params=params, draft_context=offered))
    return reqs


def rollout(engine, reqs: list, tail_running: int) -> Run:
    """Serve ``reqs`` to the end, timing the whole and the tail steps."""
    for r in reqs:
        engine.add(r)
    outputs, tail, tail_cpu, steps = {}, 0.0, 0.0, 0
    start, start_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        queued = len(engine.running) + len(engine.waiting)
        t, c = time.perf_counter(), time.process_time()
        for o in engine.step():
            outputs[o.id] = o
        if queued <= tail_running:
            tail, tail_cpu = tail + time.perf_counter() - t, tail_cpu + time.process_time() - c
        steps += 1
    return Run(outputs, time.perf_counter() - start, tail, steps, cpu_s=time.process_time() - start_cpu,
               tail_cpu_s=tail_cpu, spec=engine.stats().spec)


def changed(base: dict, other: dict) -> tuple[int, int]:
    """Tokens (position by position, plus the length difference) and responses that differ."""
    tokens = responses = 0
    for k, o in base.items():
        a, b = o.token_ids, other[k].token_ids
        diff = sum(x != y for x, y in zip(a, b)) + abs(len(a) - len(b))
        tokens += diff
        responses += diff > 0
    return tokens, responses


def run(cfg: SpecBenchConfig) -> dict:
    import torch
    from transformers import AutoTokenizer

    from rollpacker.data.dataset import DataConfig, load_rows
    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.engine import SpecStats, spec_metrics
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    torch.set_num_threads(cfg.num_threads)
    path = toy_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = load_rows(DataConfig())  # the default job's training prompts
    if cfg.num_prompts > len(rows):  # random.sample's ValueError, after the calibration
        raise ValueError(f"bench.num_prompts={cfg.num_prompts} exceeds the default job's {len(rows)} prompts")
    model = load_model(path, cfg.device)
    spec_cfg = EngineConfig(speculative="auto", spec_max_tokens=cfg.spec_max_tokens)
    cost = TorchEngine(model, spec_cfg).calibrate()
    engines = {"off": lambda: TorchEngine(load_model(path, cfg.device), EngineConfig()),
               **{m: (lambda: TorchEngine(load_model(path, cfg.device), spec_cfg, spec_cost=cost)) for m in MODES[1:]}}
    print(f"{PROG}: {cfg.num_prompts} prompts x {cfg.group_size // cfg.replicas} responses per batch, "
          f"{cfg.batches} batches, toy model on {cfg.device}, {cfg.num_threads} thread(s)", flush=True)
    print_cost(cost)
    totals = {m: ModeTotals(spec=SpecStats()) for m in MODES}
    for b in range(cfg.batches):
        earlier = rollout(engines["off"](), batch_requests(cfg, tokenizer, rows, b, epoch=True), cfg.tail_running)
        context: dict[int, list] = {}
        for rid, o in earlier.outputs.items():
            context.setdefault(int(rid.split(":")[0]), []).append(o.token_ids)
        best: dict[str, Run] = {}
        for _ in range(cfg.repeats):
            for m in MODES:
                reqs = batch_requests(cfg, tokenizer, rows, b, context=context if m == "epoch" else None)
                r = rollout(engines[m](), reqs, cfg.tail_running)
                if m not in best or r.total_s < best[m].total_s:
                    best[m] = r
        lengths = sorted(len(o.token_ids) for o in best["off"].outputs.values())
        print(f"batch {b}: {len(lengths)} responses, length median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
        for m in MODES:
            t = totals[m]
            r = best[m]
            t.total_s, t.tail_s, t.steps = t.total_s + r.total_s, t.tail_s + r.tail_s, t.steps + r.steps
            t.cpu_s, t.tail_cpu_s = t.cpu_s + r.cpu_s, t.tail_cpu_s + r.tail_cpu_s
            diff = changed(best["off"].outputs, r.outputs)
            t.tokens_changed, t.responses_changed = t.tokens_changed + diff[0], t.responses_changed + diff[1]
            t.spec = t.spec.plus(r.spec)
            print(f"  {m:<7} total {r.total_s:7.2f}s (cpu {r.cpu_s:6.2f}s)  tail {r.tail_s:6.2f}s "
                  f"(cpu {r.tail_cpu_s:5.2f}s)  steps {r.steps:5d}  tokens changed {diff[0]}", flush=True)
    return summarize(totals, cost, spec_metrics)


def print_cost(cost) -> None:
    """The measured cost table as ratios to a plain decode step."""
    print("verify step time / plain step time (rows: running requests; columns: draft tokens per request)")
    print("n \\ k " + "".join(f"{k:>7}" for k in cost.draft_lens) + "   plain ms")
    for n, ms in zip(cost.rows, cost.ms):
        print(f"{n:<6}" + "".join(f"{t / ms[0]:>7.2f}" for t in ms) + f"   {ms[0]:.2f}")
    print(f"speculation considered up to {cost.max_rows} running requests")


def summarize(totals: dict, cost, spec_metrics) -> dict:
    off = totals["off"]
    print(f"\n{'mode':<8}{'total s':>9}{'tail s':>8}{'steps':>7}{'speedup':>9}{'tail x':>8}{'cpu x':>7}"
          f"{'tail cpu x':>11}{'accept':>8}{'tok/row':>9}{'changed':>9}")
    out: dict[str, float] = {}
    for m, t in totals.items():
        metrics = spec_metrics(t.spec)
        print(f"{m:<8}{t.total_s:>9.2f}{t.tail_s:>8.2f}{t.steps:>7}{off.total_s / t.total_s:>9.2f}"
              f"{ratio(off.tail_s, t.tail_s):>8.2f}{off.cpu_s / t.cpu_s:>7.2f}"
              f"{ratio(off.tail_cpu_s, t.tail_cpu_s):>11.2f}{metrics.get('rollout/spec_acceptance', 0):>8.3f}"
              f"{metrics.get('rollout/spec_tokens_per_step', 1):>9.2f}{t.tokens_changed:>9}")
        if m == "off":
            continue
        for source in sorted(t.spec.num_drafts):
            rows, drafted = t.spec.num_drafts[source], t.spec.num_draft_tokens.get(source, 0)
            accepted = t.spec.num_accepted_tokens.get(source, 0)
            print(f"    {source:<9} rows {rows:6d}  draft tokens {drafted:7d}  accepted {accepted:7d}"
                  f"  tokens/row {(accepted + rows) / rows:5.2f}")
        suffix = "" if m == "epoch" else "_engine_sources"
        out[f"rollout_speedup_spec{suffix}"] = round(off.total_s / t.total_s, 3)
        out[f"tail_speedup_spec{suffix}"] = ratio(off.tail_s, t.tail_s)  # no tail (none ran alone enough): NaN
        out[f"rollout_speedup_spec_cpu{suffix}"] = round(off.cpu_s / t.cpu_s, 3)
        out[f"tail_speedup_spec_cpu{suffix}"] = ratio(off.tail_cpu_s, t.tail_cpu_s)
        out[f"steps_ratio_spec{suffix}"] = round(off.steps / t.steps, 3)
        out[f"spec_acceptance{suffix}"] = round(metrics.get("rollout/spec_acceptance", 0.0), 3)
        out[f"spec_tokens_per_step{suffix}"] = round(metrics.get("rollout/spec_tokens_per_step", 1.0), 3)
    out["tokens_changed"] = sum(t.tokens_changed for t in totals.values())
    out["responses_changed"] = sum(t.responses_changed for t in totals.values())
    for n, ms in zip(cost.rows, cost.ms):
        if n in (1, 8):
            for k, t in zip(cost.draft_lens[1:], ms[1:]):
                out[f"verify_cost_ratio_k{k}_n{n}"] = round(t / ms[0], 3)
    out["spec_max_rows"] = cost.max_rows
    return out


def main(argv: list[str] | None = None) -> dict:
    import tyro

    cfg = tyro.cli(SpecBenchConfig, args=sys.argv[1:] if argv is None else argv, prog=PROG)
    summary = run(cfg)
    sys.stdout.flush()
    print(json_line(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()

