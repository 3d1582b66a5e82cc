"""``python -m rollpacker.bench episodes``: RollPacker over multi-turn episodes, side by side in one run.

Each run is the 2-rank toy job with a toy environment (:class:`WorkloadEnv`) shaped as ``--workload``
(:mod:`rollpacker.sim.agentic`; agentic by default): heavy-tailed turns, environment latency and cold
starts, over ``--epochs`` of the same prompts. It runs under each of ``--policies`` (default ``sync``,
``tail``, ``tail+warm``: environments warmed ahead, ``tail+stream``, ``one_step_off``) for each of ``--seeds``.
Per seed and policy it prints rollout and step seconds per trained prompt and their speedups, environment wait,
reused prefill, and prompts lost or trained twice. The last line is JSON: the seeds' mean speedups, summed counts.

Invariants:

- Same seed, same flags, one run after the other; flags after ``--`` go to every run.
- Every draw of the environment is deterministic in the row, the step and the answer.
- ``tokens_changed`` compares speculation off and on, episode by episode.

Why: episodes wait on environments, not only on engines, and the schedule must win there too.
The environment and the keys: ``docs/benchmarks.md``; the figures: ``docs/results.md``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from rollpacker.bench import json_line, seed_list

PROG = "python -m rollpacker.bench episodes"


class WorkloadEnv:
    """The toy task over a workload's turns and latencies (:mod:`rollpacker.sim.agentic`): each answer but the
    last gets the problem again; the reward is the toy task's score of the last answer."""

    def __init__(self, row: dict, workload, log: str = ""):
        from rollpacker.toy.task import PROMPT_PREFIX, PROMPT_SUFFIX

        self.row, self.answer, self.workload = str(row["id"]), row["answer"], workload
        self.problem = row["prompt"].removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX)
        self.episode, self.need, self.steps = "", 0, 0
        self.log = Path(log) / f"{self.row}-{uuid.uuid4().hex}" if log else None
        if self.log:  # bench faults: every environment made is closed, no worker outlives the run
            self.log.with_suffix(".made").write_text(str(os.getpid()))

    def reset(self, *, seed: int, options: dict):
        time.sleep(self.workload.reset_seconds(self.row))
        self.steps = 0
        return None, {}

    def step(self, action: str):
        from rollpacker.toy.task import score

        self.steps += 1
        if self.steps == 1:  # an episode is named by its first answer: siblings differ, every policy meets the same
            self.episode, self.need = action, self.workload.turns(self.row, action)
        time.sleep(self.workload.step_seconds(self.row, self.episode, self.steps, action))
        if self.steps >= self.need:
            return None, float(score(action, self.answer)), True, False, {}
        return self.problem, None, False, False, {}

    def close(self) -> None:
        if self.log:
            self.log.with_suffix(".closed").touch()


ENV_FILE = """from rollpacker.bench.episodes import WorkloadEnv, bench_workload

WORKLOAD = bench_workload({workload!r}, sigma={sigma!r}, max_turns={max_turns!r}, median_s={median_s!r})


def make_env(row):
    return WorkloadEnv(row, WORKLOAD, log={log!r})
"""


def write_env_file(args: Args, folder: Path) -> Path:
    """The environment factory of ``args``' workload, written into ``folder`` as the runs' ``--env.factory``."""
    path = folder / "workload_env.py"
    path.write_text(ENV_FILE.format(workload=args.workload, sigma=args.sigma, max_turns=args.max_turns,
                                    median_s=args.median_s, log=""))
    return path


def bench_workload(spec: str, *, sigma: float = 0.0, max_turns: int = 0, median_s: float = 0.0):
    """Workload ``spec`` (``agentic``, ``light``, ``trace:PATH``) with the given latency sigma, turn cap and
    median step (0: its own); a trace takes none of them."""
    from dataclasses import replace

    from rollpacker.sim.agentic import Workload, workload

    shape = workload(spec)
    if not isinstance(shape, Workload):
        if sigma or max_turns or median_s:
            raise ValueError(f"--workload {spec}: a trace replays its own turns and seconds; drop --sigma, "
                             "--max-turns and --median-s")
        return shape
    shape = shape.with_sigma(sigma) if sigma else shape
    return replace(shape, max_turns=max_turns or shape.max_turns, median_s=median_s or shape.median_s)


@dataclass
class Args:
    policies: str = "sync,tail,tail+warm,tail+stream,one_step_off"
    """Comma-separated policies (as bench schedulers names them); the first is the baseline of the speedups.
    ``tail+paper``: the paper's long rounds (exactly P0) whatever ``--eta-long`` says;
    a ``+warm`` suffix: environments warmed ahead (--env.warm)."""
    seeds: str = "0"
    """Comma-separated seeds (sampling, data order, init); each runs every policy, the JSON holds their means."""
    workload: str = "agentic"
    """The environment's shape (rollpacker.sim.agentic): agentic (coding agents' tool calls, the default),
    light (the lighter shape of earlier results) or trace:PATH (recorded episodes, JSON lines)."""
    sigma: float = 0.0
    """The step latency's lognormal sigma (0: the workload's; the mean step stays)."""
    max_turns: int = 0
    """Model turns per episode at most (0: the workload's)."""
    median_s: float = 0.0
    """The median environment step in seconds (0: the workload's)."""
    rows: int = 64
    """Prompts in the epoch every policy trains once (16 steps of P0=4: fewer leave the speedups to chance)."""
    epochs: int = 1
    """Epochs over the prompts (every policy trains each prompt once an epoch)."""
    num_prompts: int = 4
    """P0: prompts trained per step."""
    group_size: int = 4
    """R0: episodes per prompt."""
    turn_tokens: int = 32
    """Tokens per model turn at most (rollout.max_new_tokens)."""
    env_workers: int = 32
    """env.num_workers: environment processes (a worker runs its episodes' steps one at a time). The latency
    is a remote service's: a worker per episode in flight (tail's 25, and the cut ones' last steps), so
    no episode waits behind another's latency."""
    eta_prompts: float = 0.0
    """tail's η_P (--schedule.eta-prompts of the tail policies): prompts launched per short round over P0 (0: the
    policy's, 1.25; raced at 2, the agent learned its tool later: bench parity)."""
    eta_responses: float = 0.0
    """tail's η_R (--schedule.eta-responses of the tail policies): episodes launched per prompt over R0 (0: the
    policy's default over episodes, 1: keeping a group's first episodes would bias what it learns, bench parity)."""
    eta_long: float = 0.0
    """tail's η_L (--schedule.eta-long): prompts launched per long round over P0 (0: the policy's, 1;
    tail+paper: always 1)."""
    speculative: str = "auto"
    """engine.speculative of every run; tokens_changed compares it with off."""
    nproc: int = 2
    """Ranks (torchrun --nproc_per_node)."""
    preset: str = "toy-cpu"
    """Preset of every run."""
    train_shard_size: int = 1
    """--train.train-shard-size of every run (stream training frees whole training replicas)."""

    def __post_init__(self) -> None:
        for name in ("rows", "epochs", "num_prompts", "group_size", "turn_tokens", "env_workers", "nproc"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if min(self.sigma, self.max_turns, self.median_s) < 0:
            raise ValueError("--sigma, --max-turns and --median-s must be >= 0 (0: the workload's)")
        seed_list(self.seeds)
        self.shape  # noqa: B018 (a bad workload says so now)
        for policy in self.policies.split(","):  # a bad one was met after the runs of those before it
            run_flags(self, policy)

    @property
    def shape(self):
        """The workload with this run's overrides."""
        return bench_workload(self.workload, sigma=self.sigma, max_turns=self.max_turns, median_s=self.median_s)


def job(args: Args, seed: int, env_file: Path, policy_flags: list[str], run_dir: Path, run_args: list[str],
        speculative: str = "") -> list[dict]:
    """One run to its end (speculation ``speculative``, empty: ``args.speculative``); its metrics records."""
    from rollpacker.jobflags import job_argv

    turns = args.shape.max_turns
    flags = [*policy_flags, "--env.factory", f"{env_file}:make_env", "--env.max-turns", str(turns),
             "--env.max-tokens", str(args.turn_tokens * turns), "--env.num-workers", str(args.env_workers),
             "--rollout.max-new-tokens", str(args.turn_tokens), "--data.num-toy-prompts", str(args.rows),
             "--rollout.num-prompts", str(args.num_prompts), "--rollout.group-size", str(args.group_size),
             "--num-epochs", str(args.epochs), "--num-steps", "1000", "--eval-every", "0", "--checkpoint-every", "0",
             "--metrics.samples-every", "1", "--engine.speculative", speculative or args.speculative]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "rollpacker.run", *job_argv(args, [*flags, *run_args], [], seed, str(run_dir))]
    print("$", " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def samples(run_dir: Path) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "samples").glob("step_*.jsonl"))
            for line in path.read_text().splitlines()]


def summarize(args: Args, records: list[dict], run_dir: Path) -> dict[str, float]:
    """Per trained prompt over the steps after the first (NaN: they trained none); prompts lost and trained twice
    over the epochs (of the samples trained: a filtered group's are written too)."""
    steps = [r for r in records if "time/step" in r]
    timed = steps[1:] or steps
    prompts = sum(r["sched/trained_prompts"] for r in timed)
    trained = Counter(s["row"] for s in samples(run_dir) if s["trained"])
    groups = [n / args.group_size for n in trained.values()] + [0.0] * (args.rows - len(trained))  # once an epoch
    return {"rollout_s": sum(r["time/rollout"] for r in timed) / prompts if prompts else math.nan,
            "step_s": sum(r["time/step"] for r in timed) / prompts if prompts else math.nan,
            "env_wait_s": statistics.mean(r.get("rollout/env_wait_s", 0.0) for r in timed),
            "turns": statistics.mean(r.get("env/turns_mean", 0.0) for r in timed),
            "reused_prefill": sum(r.get("rollout/reused_prefill_tokens", 0) for r in steps),
            "steps": len(steps), "prompts": sum(r["sched/trained_prompts"] for r in steps),
            "lost": round(sum(max(0.0, args.epochs - n) for n in groups)),
            "twice": round(sum(max(0.0, n - args.epochs) for n in groups))}


def tokens_changed(args: Args, seed: int, env_file: Path, work: Path, run_args: list[str]) -> tuple[int, int]:
    """Two rollout-only sync steps, speculation off and ``args.speculative``: (tokens of the episodes whose
    text differs, episodes compared)."""
    runs = {}
    for spec in ("off", args.speculative):
        run_dir = work / f"spec_{spec}"
        job(args, seed, env_file, ["schedule:sync"], run_dir, [*run_args, "--train.skip", "--num-steps", "2"], spec)
        runs[spec] = [(s["step"], s["row"], s["completion"], s["length"]) for s in samples(run_dir)]
    return changed_tokens(runs["off"], runs[args.speculative]), len(runs["off"])


def changed_tokens(off: list[tuple], on: list[tuple]) -> int:
    """Of two runs' episodes ``(step, row, completion, length)``: those of a text the other run's same row has too
    match; the rest pair within their (step, row), each pair counting its longer, and what is left its own."""
    left: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for side, unmatched in enumerate((Counter(off) - Counter(on), Counter(on) - Counter(off))):
        for (step, row, _, length), n in sorted(unmatched.items()):
            left.setdefault((step, row), ([], []))[side].extend([length] * n)
    return sum(sum(map(max, a, b)) + sum(a[len(b):]) + sum(b[len(a):]) for a, b in left.values())


PAPER = "+paper"
"""A tail row's suffix: the paper's policy alone (long rounds of exactly P0 prompts), the ablation's first row."""
WARM = "+warm"
"""A row's suffix: environments warmed ahead (``--env.warm``)."""


def run_flags(args: Args, policy: str) -> list[str]:
    """The flags of row ``policy``: its policy's (tail's over-provisioning as the bench sets it), and
    ``--env.warm`` with ``+warm``."""
    from rollpacker.jobflags import policy_args
    from rollpacker.schedule.tail import eta_overrides

    name = policy.replace(PAPER, "").replace(WARM, "")
    warm = ["--env.warm"] if WARM in policy else []
    if name.partition("+")[0] != "tail":
        if PAPER in policy:  # dropped, unsaid
            raise SystemExit(f"{PROG}: --policies {policy}: {PAPER} is tail's (the paper's over-provisioning)")
        return policy_args(name) + warm
    etas = eta_overrides(args.eta_prompts, args.eta_responses, args.eta_long, paper=PAPER in policy)
    return policy_args(name) + warm + [flag for key, value in etas.items()
                                       for flag in (f"--schedule.{key.replace('_', '-')}", str(value))]


ROWS = [("rollout s / prompt", "rollout_s", ".3f"), ("step s / prompt", "step_s", ".3f"),
        ("env wait s / step", "env_wait_s", ".3f"), ("turns / episode", "turns", ".2f"),
        ("prefill tokens reused", "reused_prefill", ".0f"), ("steps", "steps", ".0f"),
        ("prompts trained", "prompts", ".0f"), ("prompts lost", "lost", ".0f"), ("trained twice", "twice", ".0f")]


def report(args: Args, seed: int, results: dict[str, dict], changed: int, compared: int) -> dict:
    """One seed's table, and its summary."""
    policies, base = list(results), results[next(iter(results))]
    width = max(14, *(len(p) + 2 for p in policies))
    etas = "/".join(str(eta or "default") for eta in (args.eta_prompts, args.eta_responses, args.eta_long))
    print(f"\n{args.preset}, {args.nproc} ranks, seed {seed}, {args.rows} prompts x {args.group_size} episodes, "
          f"workload {args.workload} ({args.shape}), tail's eta P/R/L {etas}, speculative {args.speculative}:")
    print(f"{'':<24}" + "".join(f"{p:>{width}}" for p in policies))
    for label, key, fmt in ROWS[:2]:
        print(f"{label:<24}" + "".join(f"{format(r[key], fmt):>{width}}" for r in results.values()))
        print(f"{'  speedup':<24}" + "".join(f"{base[key] / r[key]:>{width - 1}.2f}x" for r in results.values()))
    for label, key, fmt in ROWS[2:]:
        print(f"{label:<24}" + "".join(f"{format(r[key], fmt):>{width}}" for r in results.values()))
    print(f"tokens changed by speculation ({args.speculative} vs off, sync, {compared} episodes): {changed}")
    return speedups(results) | {"tokens_changed": changed}


def speedups(results: dict[str, dict]) -> dict:
    """The headline figures of one seed's runs (the first policy the baseline): each other policy's rollout and
    step speedups, each policy's environment wait, prompts lost and trained twice."""
    base, summary = results[next(iter(results))], {}
    for p, r in list(results.items())[1:]:
        name = p.replace("+", "_")
        summary |= {f"rollout_speedup_{name}": round(base["rollout_s"] / r["rollout_s"], 3),
                    f"step_speedup_{name}": round(base["step_s"] / r["step_s"], 3)}
    summary |= {f"env_wait_s_{p.replace('+', '_')}": round(r["env_wait_s"], 3) for p, r in results.items()}
    return summary | {"prompts_lost": sum(r["lost"] for r in results.values()),
                      "prompts_trained_twice": sum(r["twice"] for r in results.values())}


def mean_summary(summaries: list[dict]) -> dict:
    """The seeds' summaries as one: speedups and waits their mean, counts their sum."""
    counts = ("tokens_changed", "prompts_lost", "prompts_trained_twice")
    out = {key: round(statistics.mean(s[key] for s in summaries), 3) for key in summaries[0] if key not in counts}
    return out | {key: sum(s[key] for s in summaries) for key in counts} | {"seeds": len(summaries)}


def main(argv: list[str] | None = None) -> None:
    import tyro

    from rollpacker.jobflags import split_run_args

    own, run_args = split_run_args(sys.argv[1:] if argv is None else argv)
    args = tyro.cli(Args, args=own, prog=PROG, description=__doc__.splitlines()[0])
    summaries = []
    with tempfile.TemporaryDirectory(prefix="rollpacker-episodes-") as tmp:
        env_file = write_env_file(args, Path(tmp))
        for seed in seed_list(args.seeds):
            work = Path(tmp) / f"seed{seed}"
            results = {p: summarize(args, job(args, seed, env_file, run_flags(args, p), work / p, run_args), work / p)
                       for p in args.policies.split(",")}
            changed, compared = (tokens_changed(args, seed, env_file, work, run_args) if args.speculative != "off"
                                 else (0, 0))
            summaries.append(report(args, seed, results, changed, compared))
    summary = mean_summary(summaries)  # NaN where a run trained no prompt: null, as JSON has no NaN
    print(json_line(summary), flush=True)
