"""``python -m rollpacker.bench planner``: fixed rollout TP 1, fixed TP 2 and the parallelism planner, side by side.

Runs the toy job (``--preset``, default toy-cpu) under torchrun on ``--nproc`` ranks with the tail
policy, four times with the same seed: ``--rollout.tp 1``, ``--rollout.tp 2``, ``--plan.enabled``
(profiled first, into a temporary cache, then started at the profile's best TP) and the planner
without its profile guard (``paper``: the paper's preemption heuristic alone). The engine memory
per rank is ``--memory-mb`` MiB, weights included (``--engine.memory-mb``): tight enough that
short rounds preempt at TP 1, while TP 2 leaves more of it to the KV cache.
Per variant it prints preemptions and rollout time per short and per long round, the step time,
the TP each round kind ran at and the in-process TP switches with their mean cost.

Flags after ``--`` go to every ``rollpacker.run`` unchanged. The last line is JSON: ``tp_switches``
and ``tp_switches_paper`` (the planner runs' in-process TP changes), ``speedup_planner``,
``speedup_paper`` and ``speedup_tp2`` (step time of TP 1 over theirs), preemptions and rollout
times per round kind of each variant.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import dataclass

import tyro

from rollpacker.bench import json_line
from rollpacker.bench.schedulers import run, summarize
from rollpacker.jobflags import split_run_args


@dataclass
class Args:
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    preset: str = "toy-cpu"
    """Preset of the job."""
    steps: int = 20
    """RL steps per variant."""
    seed: int = 0
    """Seed of every variant (sampling, data order)."""
    memory_mb: float = 4.25
    """Engine memory per rank in MiB, weights included (--engine.memory-mb)."""
    train_shard_size: int = 0
    """--train.train-shard-size of every run (0 = FSDP over all ranks)."""

    def __post_init__(self) -> None:
        if min(self.nproc, self.steps) <= 0 or self.memory_mb <= 0:
            raise ValueError(f"--nproc {self.nproc}, --steps {self.steps} and --memory-mb {self.memory_mb:g} must be "
                             "positive")


def variants(profile_dir: str) -> dict[str, list[str]]:
    planner = ["--plan.enabled", "--plan.profile-dir", profile_dir]
    return {"tp1": ["--rollout.tp", "1"], "tp2": ["--rollout.tp", "2"], "planner": planner,
            "paper": [*planner, "--plan.no-profile-guard"]}


def by_kind(rows: list[dict], key: str, kind: str) -> float:
    values = [r[key] for r in rows[1:] if r["sched/round_kind"] == kind and key in r]  # step 0 warms up
    return statistics.mean(values) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog="python -m rollpacker.bench planner")
    extra = ["schedule:tail", "--num-steps", str(args.steps), "--eval-every", "0",
             "--engine.memory-mb", str(args.memory_mb), *run_args]
    table: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as profiles:
        for name, flags in variants(profiles).items():
            with tempfile.TemporaryDirectory() as run_dir:
                rows = run(args, extra, flags, args.seed, run_dir)
            steps = [r for r in rows if "time/step" in r]
            out = summarize(steps)
            fixed = int(flags[1]) if flags[0] == "--rollout.tp" else None
            for kind in ("short", "long"):
                out[f"preemptions_{kind}"] = by_kind(steps, "rollout/preemptions", kind)
                tps = sorted({r.get("plan/rollout_tp", fixed) for r in steps if r["sched/round_kind"] == kind})
                out[f"tp_{kind}"] = "/".join(map(str, tps)) or "-"
            switches = [r["time/tp_switch"] for r in steps if r.get("plan/switched")]
            out["tp_switches"] = len(switches)
            out["switch_s"] = statistics.mean(switches) if switches else 0.0
            table[name] = out
    print(f"\n{args.preset}, {args.nproc} ranks, tail policy, seed {args.seed}, {args.steps} steps, "
          f"engine memory {args.memory_mb} MiB per rank:")
    rows = [("preemptions/short round", "preemptions_short", ".1f"),
            ("preemptions/long round", "preemptions_long", ".1f"),
            ("rollout/short round (s)", "rollout_short", ".3f"), ("rollout/long round (s)", "rollout_long", ".3f"),
            ("step time (s)", "step_time", ".3f"), ("TP of short rounds", "tp_short", ""),
            ("TP of long rounds", "tp_long", ""), ("TP switches", "tp_switches", "d"),
            ("mean switch cost (s)", "switch_s", ".3f"), ("samples trained", "samples", ".0f")]
    print(f"{'':<26}" + "".join(f"{v:>12}" for v in table))
    for label, key, fmt in rows:
        print(f"{label:<26}" + "".join(f"{format(t[key], fmt):>12}" for t in table.values()))
    base = table["tp1"]["step_time"]
    summary = {"tp_switches": table["planner"]["tp_switches"], "tp_switches_paper": table["paper"]["tp_switches"],
               **{f"speedup_{v}": round(base / table[v]["step_time"], 3) for v in ("planner", "paper", "tp2")}}
    for name, t in table.items():
        summary |= {f"{k}_{name}": round(t[k], 3) for k in ("preemptions_short", "preemptions_long",
                                                             "rollout_short", "rollout_long", "step_time")}
    print(json_line(summary))  # NaN (no long round timed): null
