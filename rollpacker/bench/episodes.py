"""``python -m rollpacker.bench episodes``: RollPacker over multi-turn episodes, side by side in one run.

Each run is the 2-rank toy job with a toy environment (:class:`HeavyTailEnv`): heavy-tailed turn
counts and a replayed latency per environment step, over one epoch of the same prompts. It runs
under each of ``--policies`` (default ``sync``, ``tail``, ``tail+stream``, ``one_step_off``). Per
policy it prints rollout and step seconds per trained prompt and their speedups, environment wait,
reused prefill, and prompts lost or trained twice. The last line is JSON.

Invariants:

- Same seed, same flags, one run after the other; flags after ``--`` go to every run.
- Every draw of the environment is deterministic in the row, the step and the answer.
- ``tokens_changed`` compares speculation off and on, episode by episode.

Why: episodes wait on environments, not only on engines, and the schedule must win there too.
The environment and the keys: ``docs/benchmarks.md``; the figures: ``docs/results.md``.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollpacker.sim.episodes import latency_sampler

PROG = "python -m rollpacker.bench episodes"


class HeavyTailEnv:
    """The toy task over heavy-tailed turns with replayed step latency (the module docstring)."""

    def __init__(self, row: dict, *, latency: str, alpha: float, max_turns: int):
        from rollpacker.toy.task import PROMPT_PREFIX, PROMPT_SUFFIX

        self.id, self.answer = row["id"], row["answer"]
        self.problem = row["prompt"].removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)
        self.base = min(max_turns, int(random.Random(f"turns/{self.id}").paretovariate(alpha)))
        self.max_turns, self.latency = max_turns, latency_sampler(latency)
        self.need = self.steps = 0

    def reset(self, *, seed: int, options: dict):
        self.steps = 0
        return None, {}

    def step(self, action: str):
        import time

        from rollpacker.toy.task import score

        self.steps += 1
        if self.steps == 1:
            self.need = min(self.max_turns, self.base + zlib.crc32(action.encode()) % 2)
        time.sleep(self.latency(f"{self.id}/{self.steps}/{action}"))
        if self.steps >= self.need:
            return None, float(score(action, self.answer)), True, False, {}
        return self.problem, None, False, False, {}


ENV_FILE = """from rollpacker.bench.episodes import HeavyTailEnv


def make_env(row):
    return HeavyTailEnv(row, latency={latency!r}, alpha={alpha!r}, max_turns={max_turns!r})
"""


@dataclass
class Args:
    policies: str = "sync,tail,tail+stream,one_step_off"
    """Comma-separated policies (as bench schedulers names them); the first is the baseline of the speedups."""
    seed: int = 0
    """Seed of every run (sampling, data order, init)."""
    rows: int = 64
    """Prompts in the epoch every policy trains once (16 steps of P0=4: fewer leave the speedups to chance)."""
    num_prompts: int = 4
    """P0: prompts trained per step."""
    group_size: int = 4
    """R0: episodes per prompt."""
    turn_tokens: int = 32
    """Tokens per model turn at most (rollout.max_new_tokens)."""
    max_turns: int = 8
    """Model turns per episode at most."""
    alpha: float = 1.2
    """Pareto tail index of the turns per row (smaller: a heavier tail)."""
    latency: str = "lognormal:0.3:1.0"
    """Environment latency per step: lognormal:MEAN_SECONDS:SIGMA, or trace:PATH (seconds, one per line)."""
    env_workers: int = 32
    """env.num_workers: environment processes (a worker runs its episodes' steps one at a time). The latency
    is a remote service's: a worker per episode in flight (tail's 25, and the cut ones' last steps), so
    no episode waits behind another's latency."""
    eta_prompts: float = 1.25
    """tail's η_P (--schedule.eta-prompts of the tail policies): prompts launched per short round over P0."""
    eta_responses: float = 1.25
    """tail's η_R (--schedule.eta-responses of the tail policies): episodes launched per prompt over R0."""
    speculative: str = "auto"
    """engine.speculative of every run; tokens_changed compares it with off."""
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    preset: str = "toy-cpu"
    """Preset of every run."""
    train_shard_size: int = 1
    """--train.train-shard-size of every run (stream training frees whole training replicas)."""

    def __post_init__(self) -> None:
        for name in ("rows", "num_prompts", "group_size", "turn_tokens", "max_turns", "env_workers", "nproc"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.alpha <= 0:
            raise ValueError(f"--alpha must be positive, got {self.alpha}")
        latency_sampler(self.latency)


def job(args: Args, env_file: Path, policy_flags: list[str], run_dir: Path, run_args: list[str],
        speculative: str = "") -> list[dict]:
    """One run to its end (speculation ``speculative``, empty: ``args.speculative``); its metrics records."""
    from rollpacker.jobflags import job_argv

    flags = [*policy_flags, "--env.factory", f"{env_file}:make_env", "--env.max-turns", str(args.max_turns),
             "--env.max-tokens", str(args.turn_tokens * args.max_turns), "--env.num-workers", str(args.env_workers),
             "--rollout.max-new-tokens", str(args.turn_tokens), "--data.num-toy-prompts", str(args.rows),
             "--rollout.num-prompts", str(args.num_prompts), "--rollout.group-size", str(args.group_size),
             "--num-epochs", "1", "--num-steps", "1000", "--eval-every", "0", "--checkpoint-every", "0",
             "--metrics.samples-every", "1", "--engine.speculative", speculative or args.speculative]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "rollpacker.run", *job_argv(args, [*flags, *run_args], [], args.seed, str(run_dir))]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "samples").glob("step_*.jsonl"))
            for line in path.read_text().splitlines()]


def summarize(args: Args, records: list[dict], run_dir: Path) -> dict[str, float]:
    """Per trained prompt over the steps after the first; prompts lost and trained twice over the epoch."""
    steps = [r for r in records if "time/step" in r]
    timed = steps[1:] or steps
    prompts = sum(r["sched/trained_prompts"] for r in timed)
    trained = Counter(s["row"] for s in samples(run_dir))
    groups = {row: n / args.group_size for row, n in trained.items()}
    return {"rollout_s": sum(r["time/rollout"] for r in timed) / prompts,
            "step_s": sum(r["time/step"] for r in timed) / prompts,
            "env_wait_s": statistics.mean(r.get("rollout/env_wait_s", 0.0) for r in timed),
            "turns": statistics.mean(r.get("env/turns_mean", 0.0) for r in timed),
            "reused_prefill": sum(r.get("rollout/reused_prefill_tokens", 0) for r in steps),
            "steps": len(steps), "prompts": sum(r["sched/trained_prompts"] for r in steps),
            "lost": args.rows - len(groups), "twice": round(sum(max(0.0, n - 1) for n in groups.values()))}


def tokens_changed(args: Args, env_file: Path, work: Path, run_args: list[str]) -> tuple[int, int]:
    """Two rollout-only sync steps, speculation off and ``args.speculative``: (tokens of the episodes whose
    text differs, episodes compared)."""
    runs = {}
    for spec in ("off", args.speculative):
        run_dir = work / f"spec_{spec}"
        job(args, env_file, ["schedule:sync"], run_dir, [*run_args, "--train.skip", "--num-steps", "2"], spec)
        runs[spec] = sorted((s["step"], s["row"], s["completion"], s["length"]) for s in samples(run_dir))
    off, on = runs["off"], runs[args.speculative]
    unmatched = off[len(on):] + on[len(off):]
    changed = sum(max(a[3], b[3]) for a, b in zip(off, on) if a != b) + sum(s[3] for s in unmatched)
    return changed, len(off)


def tail_flags(args: Args, policy: str) -> list[str]:
    """The tail policies' over-provisioning."""
    if policy.partition("+")[0] != "tail":
        return []
    return ["--schedule.eta-prompts", str(args.eta_prompts), "--schedule.eta-responses", str(args.eta_responses)]


ROWS = [("rollout s / prompt", "rollout_s", ".3f"), ("step s / prompt", "step_s", ".3f"),
        ("env wait s / step", "env_wait_s", ".3f"), ("turns / episode", "turns", ".2f"),
        ("prefill tokens reused", "reused_prefill", ".0f"), ("steps", "steps", ".0f"),
        ("prompts trained", "prompts", ".0f"), ("prompts lost", "lost", ".0f"), ("trained twice", "twice", ".0f")]


def report(args: Args, results: dict[str, dict], changed: int, compared: int) -> dict:
    """The table, and the JSON summary."""
    policies, base = list(results), results[next(iter(results))]
    width = max(14, *(len(p) + 2 for p in policies))
    print(f"\n{args.preset}, {args.nproc} ranks, seed {args.seed}, {args.rows} prompts x {args.group_size} "
          f"episodes, latency {args.latency}, alpha {args.alpha}, tail's eta {args.eta_prompts}/{args.eta_responses}, "
          f"speculative {args.speculative}:")
    print(f"{'':<24}" + "".join(f"{p:>{width}}" for p in policies))
    for label, key, fmt in ROWS[:2]:
        print(f"{label:<24}" + "".join(f"{format(r[key], fmt):>{width}}" for r in results.values()))
        print(f"{'  speedup':<24}" + "".join(f"{base[key] / r[key]:>{width - 1}.2f}x" for r in results.values()))
    for label, key, fmt in ROWS[2:]:
        print(f"{label:<24}" + "".join(f"{format(r[key], fmt):>{width}}" for r in results.values()))
    print(f"tokens changed by speculation ({args.speculative} vs off, sync, {compared} episodes): {changed}")
    summary = {}
    for p, r in list(results.items())[1:]:
        name = p.replace("+", "_")
        summary |= {f"rollout_speedup_{name}": round(base["rollout_s"] / r["rollout_s"], 3),
                    f"step_speedup_{name}": round(base["step_s"] / r["step_s"], 3)}
    summary |= {f"env_wait_s_{p.replace('+', '_')}": round(r["env_wait_s"], 3) for p, r in results.items()}
    return summary | {"tokens_changed": changed, "prompts_lost": sum(r["lost"] for r in results.values()),
                      "prompts_trained_twice": sum(r["twice"] for r in results.values())}


def main(argv: list[str] | None = None) -> None:
    import tyro

    from rollpacker.jobflags import policy_args, split_run_args

    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog=PROG, description=__doc__.splitlines()[0])
    with tempfile.TemporaryDirectory(prefix="rollpacker-episodes-") as tmp:
        work = Path(tmp)
        env_file = work / "heavy_env.py"
        env_file.write_text(ENV_FILE.format(latency=args.latency, alpha=args.alpha, max_turns=args.max_turns))
        results = {p: summarize(args, job(args, env_file, policy_args(p) + tail_flags(args, p), work / p, run_args),
                                work / p) for p in args.policies.split(",")}
        changed, compared = tokens_changed(args, env_file, work, run_args) if args.speculative != "off" else (0, 0)
    print(json.dumps(report(args, results, changed, compared)), flush=True)
