"""``python -m rollpacker.bench step``: where the synchronous baseline's step time goes.

Runs the toy job (``--preset``, default toy-cpu) under torchrun for a few steps and prints the
mean per-stage time of the steps after the first (warm-up), with each stage's share of the step.
This is the baseline every scheduling speedup is measured against. Extra arguments after ``--``
go to ``rollpacker.run`` unchanged.
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

from rollpacker.jobflags import split_run_args

STAGES = ("rollout", "reward", "train", "weight_sync")


@dataclass
class Args:
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    steps: int = 12
    """RL steps to run; the first is warm-up and not counted."""
    preset: str = "toy-cpu"
    """Preset of the job."""

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.steps < 1:  # the job's refusal was a CalledProcessError's traceback
            raise SystemExit(f"--nproc and --steps must be >= 1, got {self.nproc} and {self.steps}")


def main(argv: list[str] | None = None) -> None:
    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.bench step")
    with tempfile.TemporaryDirectory() as run_dir:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               "-m", "rollpacker.run", "--preset", args.preset, "--run-dir", run_dir, "--num-steps", str(args.steps),
               "--metrics.wandb-mode", "disabled", "--metrics.no-live", "--eval-every", "0", *run_args]
        print("$", " ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r]  # not a final evaluation's record
    timed = rows[1:] or rows
    mean = {s: statistics.mean(r[f"time/{s}"] for r in timed) for s in (*STAGES, "step")}
    print(f"\nsync baseline, {args.preset}, {args.nproc} ranks, mean of steps {timed[0]['step']}..{timed[-1]['step']}:")
    print(f"{'stage':<12}{'seconds':>10}{'share':>8}")
    for s in STAGES:
        print(f"{s:<12}{mean[s]:>10.2f}{mean[s] / mean['step']:>8.1%}")
    print(f"{'step':<12}{mean['step']:>10.2f}")
    extra = {
        "bubble_ratio": statistics.mean(r["rollout/bubble_ratio"] for r in timed),
        "response_len_max_over_p50": statistics.mean(
            r["rollout/response_len_max"] / max(r["rollout/response_len_p50"], 1) for r in timed),
        "tokens_per_s": statistics.mean(r["rollout/tokens_per_s"] for r in timed),
    }
    for k, v in extra.items():
        print(f"{k:<28}{v:.3f}")
    summary = {f"time_{s}": round(v, 3) for s, v in mean.items()}
    summary |= {"rollout_share": round(mean["rollout"] / mean["step"], 3)}
    summary |= {k: round(v, 3) for k, v in extra.items()}
    print(json.dumps(summary))
