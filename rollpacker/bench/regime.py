"""``python -m rollpacker.bench regime``: the rollout phase of ``sync``, ``tail``, ``sorted`` and
``sorted_partial`` where decode is memory-bound, as on GPUs.

A CPU decode step is memory-bound when the weights are far larger than the caches and few
requests run: every step streams the weights from DRAM whatever the batch. vLLM's CPU build
(oneDNN linears on pre-packed weights) keeps its step flat there (``bench engine --engines vllm
--model M``: within 1.3x of one request's up to 4-8 running on a 50-180M model), while
TorchEngine's GEMMs are not (~1.9x at 2). So the job runs on ``--engine.kind vllm`` with a
Qwen2-shaped random model (``rollpacker.toy.random_model``, written once into ``--model-dir``)
and a small per-rank batch, every response's length forced to the paper's long-tailed mix
(``--rollout.replay-lengths``: a random model rolls out the tail a trained one would), and
training skipped (``--train.skip``: on CPU a large model's training is compute-bound and is not
what this measures). Every policy sees the same prompts and lengths (same seed).

Per policy: rollout seconds per step (rollout and the scoring after it; steps after the first)
and per round kind, the bubble
ratio, and the rollout speedup over ``sync``. Flags after ``--`` go to every ``rollpacker.run``.
The last line is JSON: ``rollout_speedup_<policy>`` and ``rollout_s_<policy>``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass

import tyro

from rollpacker.bench.schedulers import Args as RunArgs
from rollpacker.bench.schedulers import run
from rollpacker.jobflags import (
    MemoryRegime,
    check_job,
    job_argv,
    memory_regime_flags,
    policy_args,
    policy_list,
    split_run_args,
)


@dataclass
class Args(MemoryRegime):
    policies: str = "sync,tail,sorted,sorted_partial"
    """Comma-separated policies; the first is the baseline of the speedups."""

    def __post_init__(self) -> None:
        policy_list(self.policies)


def main(argv: list[str] | None = None) -> dict:
    own, extra = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.bench regime")
    run_args = memory_regime_flags(args) + extra
    policies = args.policies.split(",")
    for policy in policies:  # --train.skip (rollout alone) refuses stream and pipe: said now, not after the runs
        check_job(job_argv(RunArgs(), run_args, policy_args(policy), args.seed, "runs/x"),
                  f"policy {policy} (rolling out alone: --train.skip)", extra)
    rows = {}
    for policy in policies:
        with tempfile.TemporaryDirectory() as run_dir:
            rows[policy] = summarize(run(RunArgs(), run_args, policy_args(policy), args.seed, run_dir))
    base = rows[policies[0]]["rollout"]
    print(f"\nrollout alone, engine vllm, model {args.model_dir}, P0={args.num_prompts} R0={args.group_size}, "
          f"cap {args.max_new_tokens}, {args.num_steps} steps, seed {args.seed}")
    width = max(14, *(len(p) + 2 for p in policies))
    print(f"{'':<28}" + "".join(f"{p:>{width}}" for p in policies))
    for label, key in (("rollout/step (s)", "rollout"), ("rollout/round short (s)", "short"),
                       ("rollout/round long (s)", "long"), ("rollout/round sync (s)", "sync"),
                       ("rollout/round sorted (s)", "sorted"), ("bubble ratio", "bubble_ratio")):
        print(f"{label:<28}" + "".join(f"{rows[p][key]:>{width}.3f}" for p in policies))
    print(f"{'rollout speedup':<28}" + "".join(f"{base / rows[p]['rollout']:>{width - 1}.2f}x" for p in policies))
    summary = {f"rollout_speedup_{p}": round(base / rows[p]["rollout"], 3) for p in policies[1:]}
    summary |= {f"rollout_s_{p}": round(rows[p]["rollout"], 3) for p in policies}
    summary |= {f"bubble_ratio_{p}": round(rows[p]["bubble_ratio"], 3) for p in policies}
    print(json.dumps(summary), flush=True)
    return summary


def summarize(records: list[dict]) -> dict[str, float]:
    steps = [r for r in records if "time/rollout" in r]
    timed = steps[1:] or steps  # the first step warms the engines up
    out = {"rollout": statistics.mean(r["time/rollout"] + r["time/reward"] for r in timed),
           "bubble_ratio": statistics.mean(r["rollout/bubble_ratio"] for r in timed)}
    for kind in ("short", "long", "sync", "sorted"):
        times = [r["time/rollout"] + r["time/reward"] for r in timed if r["sched/round_kind"] == kind]
        out[kind] = statistics.mean(times) if times else float("nan")
    return out
