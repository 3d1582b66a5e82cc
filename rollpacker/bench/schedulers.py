"""``python -m rollpacker.bench schedulers --policies sync,tail,tail+stream,sorted,sorted_partial``:
scheduling policies side by side (also ``pipe``, ``tail+pipe`` and ``one_step_off``).

It runs the same toy job (``--preset``, default toy-cpu) under torchrun once per policy and seed.
Per policy it prints the mean over seeds of rollout time per round kind, step time and speedup,
bubble ratio, waste, staleness and held-out accuracy. ``--ablations`` adds the paper's Tables 3
and 4. The last line is JSON (``speedup_<policy>``, ...).

Invariants:

- Every run has the same seed, data order, number of steps and training shard size.
- Seed by seed, every policy within a seed: slow drift of the machine hits each alike.
- Flags after ``--`` go to every ``rollpacker.run`` unchanged.

Why: rollpacker exists to compare policies on one workload, and this is that comparison.
The policies' flags, the columns and the keys: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tyro

from rollpacker.bench import seed_list
from rollpacker.jobflags import STREAM, JobArgs, check_job, job_argv, policy_args, policy_list, split_run_args
from rollpacker.schedule.tail import TailConfig


@dataclass
class Args(JobArgs):
    policies: str = "sync,tail"
    """Comma-separated policies; the first is the baseline of the speedups."""
    seeds: str = "0,1,2"
    """Comma-separated seeds (sampling, data order and init of everything random)."""
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    ablations: bool = False
    """Also run the stream trainer's Table 3 and Table 4 ablations (seed 0)."""
    ablation_steps: int = 40
    """Steps of each ablation run."""

    def __post_init__(self) -> None:
        seed_list(self.seeds)
        policy_list(self.policies)
        if self.ablation_steps < 1 or self.nproc < 1:  # refused by the job, after the main comparison
            raise SystemExit(f"--ablation-steps and --nproc must be >= 1, got {self.ablation_steps} and {self.nproc}")


PAPER = [*STREAM, "--stream.criterion", "kv"]  # the ablations are the paper's, with its KV-fit criterion
TABLE3 = {"w/o": [], "20%": [*STREAM, "--stream.trigger", "0.2"], "30%": [*STREAM, "--stream.trigger", "0.3"],
          "40%": [*STREAM, "--stream.trigger", "0.4"], "adaptive": PAPER}
TABLE4 = {"stream": PAPER, **{f"{c}%": [*PAPER, "--stream.fetch-cap", str(c / 100)] for c in (20, 30, 40, 50)}}


def run(args: Args, run_args: list[str], policy_flags: list[str], seed: int, run_dir: str) -> list[dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "rollpacker.run", *job_argv(args, run_args, policy_flags, seed, run_dir)]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict]) -> dict[str, float]:
    steps = [r for r in rows if "time/step" in r]
    timed = steps[1:] or steps
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    out = {
        "step_time": statistics.mean(r["time/step"] for r in timed),
        "bubble_ratio": statistics.mean(r["rollout/bubble_ratio"] for r in timed),
        "wasted_tokens": sum(r["rollout/wasted_tokens"] for r in steps),
        "samples": sum(len(r["rollout/response_lengths"]) for r in steps),
        "samples_per_s": sum(len(r["rollout/response_lengths"]) for r in timed) / sum(r["time/step"] for r in timed),
        "steps": len(steps),
        "acc_before": evals[0] if evals else float("nan"),
        "acc_after": evals[-1] if evals else float("nan"),
        "step_time_long": statistics.mean([r["time/step"] for r in timed if r["sched/round_kind"] == "long"]
                                          or [float("nan")]),
        "scaled_down": sum(r.get("stream/scaled_down", 0) for r in steps),
        "hidden_train": statistics.mean(r.get("stream/train_seconds", 0) for r in timed),
        "staleness": statistics.mean(r.get("sched/staleness_mean", 0) for r in steps),
        "staleness_max": max(r.get("sched/staleness_max", 0) for r in steps),
        "rollout_to_train_end": statistics.mean(
            r.get("pipe/rollout_to_train_end", r["time/rollout"] + r["time/reward"] + r.get("time/train", 0.0))
            for r in timed),
        "wait_prev_gen": statistics.mean(r.get("time/wait_prev_gen", float("nan")) for r in timed),
        "trainer_wait": statistics.mean(r.get("pipe/trainer_wait_ratio", float("nan")) for r in timed),
    }
    for kind in ("sync", "short", "long", "sorted"):
        times = [r["time/rollout"] for r in timed if r["sched/round_kind"] == kind]
        out[f"rollout_{kind}"] = statistics.mean(times) if times else float("nan")
        out[f"rounds_{kind}"] = len([r for r in steps if r["sched/round_kind"] == kind])
    return out


def main(argv: list[str] | None = None) -> None:
    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.bench schedulers")
    policies, seeds = args.policies.split(","), seed_list(args.seeds)
    for policy in policies:
        check_job(job_argv(args, run_args, policy_args(policy), seeds[0], "runs/x"), f"policy {policy}", run_args)
    results: dict[str, list[dict]] = {p: [] for p in policies}
    for seed in seeds:
        for policy in policies:
            with tempfile.TemporaryDirectory() as run_dir:
                results[policy].append(summarize(run(args, run_args, policy_args(policy), seed, run_dir)))
    mean = {p: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for p, rs in results.items()}
    base = mean[policies[0]]["step_time"]
    print(f"\n{args.preset}, {args.nproc} ranks, mean over seeds {args.seeds}:")
    rows = [
        ("rollout/round sync (s)", "rollout_sync", ".3f"), ("rollout/round short (s)", "rollout_short", ".3f"),
        ("rollout/round long (s)", "rollout_long", ".3f"), ("rollout/round sorted (s)", "rollout_sorted", ".3f"),
        ("rounds short/long", None, None),
        ("step time, long rounds (s)", "step_time_long", ".3f"), ("step time (s)", "step_time", ".3f"),
        ("speedup", None, None), ("samples/s", "samples_per_s", ".1f"), ("bubble ratio", "bubble_ratio", ".3f"),
        ("scale-downs", "scaled_down", ".0f"),
        ("train hidden/step (s)", "hidden_train", ".3f"),
        ("rollout->train end (s)", "rollout_to_train_end", ".3f"), ("trainer wait ratio", "trainer_wait", ".3f"),
        ("wait for prev gen (s)", "wait_prev_gen", ".3f"),
        ("tokens wasted", "wasted_tokens", ".0f"), ("samples trained", "samples", ".0f"),
        ("staleness mean", "staleness", ".3f"), ("staleness max", "staleness_max", ".0f"),
        ("eval acc before", "acc_before", ".3f"), ("eval acc after", "acc_after", ".3f"),
    ]
    width = max(12, *(len(p) + 2 for p in policies))
    print(f"{'':<26}" + "".join(f"{p:>{width}}" for p in policies))
    for label, key, fmt in rows:
        if label == "speedup":
            cells = [f"{base / mean[p]['step_time']:.2f}x" for p in policies]
        elif label.startswith("rounds"):
            cells = [f"{mean[p]['rounds_short']:.0f}/{mean[p]['rounds_long']:.0f}" for p in policies]
        else:
            cells = [format(mean[p][key], fmt) for p in policies]
        print(f"{label:<26}" + "".join(f"{c:>{width}}" for c in cells))
    for p in policies:
        accs = ", ".join(f"seed {s}: {r['acc_before']:.3f} -> {r['acc_after']:.3f}" for s, r in zip(seeds, results[p]))
        print(f"{p}: {accs}")
    key = {p: p.replace("+", "_") for p in policies}
    summary = {f"speedup_{key[p]}": round(base / mean[p]["step_time"], 3) for p in policies[1:]}
    summary |= {f"step_time_{key[p]}": round(mean[p]["step_time"], 3) for p in policies}
    summary |= {f"step_time_long_{key[p]}": round(mean[p]["step_time_long"], 3) for p in policies}
    summary |= {f"acc_after_{key[p]}": round(mean[p]["acc_after"], 4) for p in policies}
    summary |= {f"samples_{key[p]}": mean[p]["samples"] for p in policies}
    summary |= {f"staleness_{key[p]}": round(mean[p]["staleness"], 3) for p in policies}
    summary |= {f"samples_per_s_{key[p]}": round(mean[p]["samples_per_s"], 2) for p in policies}
    if args.ablations:
        summary |= ablate(args, run_args)
    print(json.dumps({k: v for k, v in summary.items() if v == v}))  # NaN (no such round) is not JSON


def ablate(args: Args, run_args: list[str]) -> dict[str, float]:
    """The paper's Tables 3 and 4 on the tail policy, seed 0: step times of long rounds and of all."""
    out = {}
    for name, table in (("table3", TABLE3), ("table4", TABLE4)):
        rows = {}
        for variant, flags in table.items():
            with tempfile.TemporaryDirectory() as run_dir:
                rows[variant] = summarize(run(args, [*run_args, "--num-steps", str(args.ablation_steps)],
                                              [f"schedule:{TailConfig.name}", *flags], 0, run_dir))
        first = next(iter(rows.values()))
        print(f"\n{name}: tail, seed 0, {args.ablation_steps} steps")
        print(f"{'':<26}" + "".join(f"{v:>10}" for v in rows))
        for label, k in (("step time, long (s)", "step_time_long"), ("step time, all (s)", "step_time")):
            print(f"{label:<26}" + "".join(f"{r[k]:>10.3f}" for r in rows.values()))
        print(f"{'speedup, long rounds':<26}" + "".join(f"{first['step_time_long'] / r['step_time_long']:>9.2f}x"
                                                        for r in rows.values()))
        out |= {f"{name}_{v.replace('%', 'pct').replace('/', '')}":
                round(first["step_time_long"] / r["step_time_long"], 3) for v, r in rows.items()}
    return out
