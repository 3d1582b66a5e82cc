"""``python -m rollpacker.bench algorithms``: advantage estimators and policy losses side by side on the default job.

It runs the toy job (``--preset``, default toy-cpu) under torchrun once per algorithm and seed.
Only the ``train.*`` flags of :data:`ALGORITHMS` differ. Per algorithm it prints the mean over
seeds of the eval gain, the reward gain, the entropy and the wall time of a run. The last line is
JSON (``eval_gain_<name>``, ...).

Invariants:

- Every run has the same data order and number of steps.
- Seed by seed, every algorithm within a seed: slow drift of the machine hits each alike.
- ``distill``'s teacher is a GRPO run of the same job, made first, so the student learns the task
  only through it. Flags after ``--`` go to every run.

Why: the algorithms are one flag each, so one workload compares them. The short setting
(``--steps 50``), the algorithms and the keys: ``docs/algorithms.md`` and ``docs/benchmarks.md``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

from rollpacker.bench import seed_list
from rollpacker.jobflags import check_job, split_run_args

ALGORITHMS = {
    "grpo": [],
    "dr_grpo": ["--train.advantage", "dr_grpo", "--train.aggregation", "seq-mean-token-sum-norm"],
    "grpo_batch_std": ["--train.advantage", "grpo_batch_std"],
    "rloo": ["--train.advantage", "rloo"],
    "gspo": ["--train.loss", "gspo", "--train.aggregation", "seq-mean-token-mean", "--train.clip-low", "3e-4",
             "--train.clip-high", "4e-4", "--train.mini-batches", "2"],
    "cispo": ["--train.loss", "cispo", "--train.clip-low", "1.0", "--train.mini-batches", "2"],
    "sapo": ["--train.loss", "sapo", "--train.mini-batches", "2"],
    "grpo_mb2": ["--train.mini-batches", "2"],
    "ppo": ["--train.advantage", "gae"],
    "gdpo": ["--train.advantage", "gdpo"],
    "lora": ["--train.lora.rank", "16", "--train.lora.alpha", "32", "--train.lr", "2e-3"],
    "distill": ["--train.teacher.path", "{teacher}", "--train.teacher.task-weight", "0"],
}
"""Name -> its ``rollpacker.run`` flags (the papers' settings where they differ from the defaults)."""


@dataclass
class Args:
    algorithms: str = ",".join(ALGORITHMS)
    """Comma-separated names of ALGORITHMS."""
    seeds: str = "0,1,2"
    """Comma-separated seeds (sampling, data order and init of everything random)."""
    steps: int = 50
    """RL steps per run (200: the whole default job)."""
    eval_every: int = 25
    """Held-out evaluation every this many steps (and after the last)."""
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    preset: str = "toy-cpu"
    """Preset of the job."""
    teacher: str = ""
    """distill: the teacher's model directory; empty = train one first (GRPO, teacher_steps steps, seed 0)."""
    teacher_steps: int = 100
    """distill: RL steps of the teacher the bench trains."""

    def __post_init__(self) -> None:
        seed_list(self.seeds)
        if min(self.steps, self.eval_every, self.teacher_steps) <= 0:  # the gains read the first and last evaluation
            raise ValueError(f"--steps, --eval-every and --teacher-steps must be positive, got {self.steps}, "
                             f"{self.eval_every} and {self.teacher_steps}")
        if self.teacher and "distill" in self.algorithms.split(",") and not Path(self.teacher, "config.json").is_file():
            raise ValueError(f"--teacher {self.teacher}: no config.json there (met after the other algorithms' runs): "
                             "name a Hugging Face model directory, or leave it empty to train one first")


def run(args: Args, run_args: list[str], flags: list[str], seed: int, run_dir: str, *, steps: int = 0,
        export: bool = False) -> tuple[list[dict], float]:
    """One run's metrics and its wall time (``steps``: other than ``args.steps``; ``export``: the
    trained model to ``run_dir/hf``)."""
    steps = steps or args.steps
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "rollpacker.run", "--preset", args.preset, "--run-dir", run_dir, "--num-steps", str(steps),
           "--eval-every", str(args.eval_every), "--seed", str(seed), "--data.shuffle-seed", str(seed),
           "--metrics.wandb-mode", "disabled", "--metrics.no-live",
           *([] if export else ["--checkpoint.no-export-hf"]), *flags, *run_args]
    print("$", " ".join(cmd[1:]), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()], wall


def summarize(rows: list[dict], wall: float) -> dict[str, float]:
    """Eval gain, reward gain (last quarter minus first), entropy of the first and last quarter."""
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = [r for r in rows if "reward/mean" in r]
    quarter = max(1, len(steps) // 4)
    first, last = steps[:quarter], steps[-quarter:]
    return {
        "eval_before": evals[0],
        "eval_after": evals[-1],
        "eval_gain": evals[-1] - evals[0],
        "reward_gain": statistics.mean(r["reward/mean"] for r in last)
        - statistics.mean(r["reward/mean"] for r in first),
        "entropy_first": statistics.mean(r["train/entropy"] for r in first),
        "entropy": statistics.mean(r["train/entropy"] for r in last),
        "wall_s": wall,
    }


def teacher(args: Args, run_args: list[str], work: str) -> str:
    """The distillation teacher's directory: ``args.teacher``, or the default job trained by GRPO for
    ``args.teacher_steps`` steps (seed 0), exported to ``work/hf``."""
    if args.teacher:
        return args.teacher
    rows, wall = run(args, run_args, [], 0, work, steps=args.teacher_steps, export=True)
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    print(f"  teacher: {args.teacher_steps} GRPO steps, eval {evals[0]:.3f} -> {evals[-1]:.3f}, {wall:.0f} s",
          flush=True)
    return str(Path(work) / "hf")


def check_flags(args: Args, run_args: list[str], names: list[str]) -> None:
    """Every algorithm's flags with those after ``--`` make a valid job, checked before the first run: a
    flag that one algorithm refuses (``--train.dual-clip`` is ppo's) fails now, not hours in."""
    for name in names:
        flags = [f.format(teacher="teacher") for f in ALGORITHMS[name]]
        check_job(["--preset", args.preset, *flags, *run_args],
                  f"algorithm {name} ({' '.join(flags) or 'the defaults'})", run_args, evaluated=True)


def main(argv: list[str] | None = None) -> None:
    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.bench algorithms")
    names, seeds = args.algorithms.split(","), seed_list(args.seeds)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        raise SystemExit(f"unknown algorithm(s) {unknown}: choose from {', '.join(ALGORITHMS)}")
    check_flags(args, run_args, names)
    results: dict[str, list[dict]] = {n: [] for n in names}
    work = tempfile.TemporaryDirectory()
    taught = any("{teacher}" in ALGORITHMS[n] for n in names)
    fill = {"teacher": teacher(args, run_args, work.name) if taught else ""}
    for seed in seeds:
        for name in names:
            with tempfile.TemporaryDirectory() as run_dir:
                flags = [f.format(**fill) for f in ALGORITHMS[name]]
                results[name].append(summarize(*run(args, run_args, flags, seed, run_dir)))
            r = results[name][-1]
            print(f"  {name} seed {seed}: eval {r['eval_before']:.3f} -> {r['eval_after']:.3f}, reward gain "
                  f"{r['reward_gain']:+.3f}, entropy {r['entropy_first']:.3f} -> {r['entropy']:.3f}, "
                  f"{r['wall_s']:.0f} s", flush=True)
    mean = {n: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for n, rs in results.items()}
    print(f"\n{args.preset}, {args.nproc} ranks, {args.steps} steps, mean over seeds {args.seeds}:")
    width = max(12, *(len(n) + 2 for n in names))
    print(f"{'algorithm':<{width}}{'eval gain':>10}{'reward gain':>13}{'entropy first->last':>21}{'wall s':>8}"
          "  eval gain per seed")
    for n in names:
        m = mean[n]
        per_seed = " / ".join(f"{r['eval_gain']:+.3f}" for r in results[n])
        print(f"{n:<{width}}{m['eval_gain']:>+10.3f}{m['reward_gain']:>+13.3f}"
              f"{m['entropy_first']:>12.3f} -> {m['entropy']:.3f}{m['wall_s']:>8.0f}  {per_seed}")
    passed = all(mean[n]["eval_gain"] > 0 for n in names)
    print(f"bar: every algorithm's mean eval gain > 0: {'yes' if passed else 'NO'}")
    summary = {f"eval_gain_{n}": round(mean[n]["eval_gain"], 4) for n in names}
    summary |= {f"reward_gain_{n}": round(mean[n]["reward_gain"], 4) for n in names}
    summary |= {f"entropy_{n}": round(mean[n]["entropy"], 4) for n in names}
    summary |= {f"wall_s_{n}": round(mean[n]["wall_s"], 1) for n in names}
    print(json.dumps(summary))
    work.cleanup()
