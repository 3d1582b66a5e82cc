"""``python -m rollpacker.sim episodes``: what RollPacker buys over multi-turn episodes at cluster scale.

The preset's model, P0, R0 and TP on ``--gpus`` GPUs; every response an episode of
:class:`~rollpacker.sim.episodes.EpisodeWorkload` (turns per episode, per-turn lengths of the length
mixture cut at the per-turn cap, observation tokens, environment latency per step on
``--num-workers`` workers), given as distributions or taken from a run (``--fit RUN_DIR``: its turn
counts, observation tokens and mean step latency). Each policy (``sync``, ``tail``, ``tail+stream``)
is simulated on the same seed; rollout and step seconds per trained prompt (tail's long rounds train
more prompts than a step's P0), and their speedups over the first policy. Last line JSON:
``rollout_speedup_<policy>``, ``step_speedup_<policy>`` (``+`` written ``_``), ``rollout_s_<policy>``,
``step_s_<policy>`` (per step), ``session_evictions_<policy>`` (resident sessions evicted for KV, per
step), ``turns_mean``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import tyro

from rollpacker.sim.episodes import EpisodeWorkload

VARIANTS = {"stream": {"stream": True, "reward_scheduler": True}, "paper": {}, "warm": {"warm": True}}
"""A policy's ``+VARIANT`` (one or more): the simulator's settings it turns on (``tail+paper``: the paper's η_P
and η_L; ``+warm``: environments warmed ahead)."""


@dataclass(kw_only=True)
class EpisodesArgs:
    preset: str = "qwen2.5-7b-8k"
    """Preset: the model (by name), P0, R0, TP and the per-turn cap (rollout.max_new_tokens)."""
    model: str = ""
    """The model simulated ("": the one the preset's name starts with), for a preset named otherwise."""
    gpus: int = 128
    """GPUs of the job."""
    policies: str = "sync,tail,tail+stream"
    """Comma-separated policies (POLICY, POLICY+stream, tail+paper: the paper's policy alone, +warm: environments
    warmed ahead); the first is the baseline of the speedups."""
    num_steps: int = 10
    """Steps simulated per policy (tail: two periods of 4 short rounds and a long one): a quick look; policies a
    few percent apart need 40 (docs/simulator.md)."""
    num_prompts: int = 0
    """P0 (0: the preset's)."""
    group_size: int = 0
    """R0 (0: the preset's)."""
    turn_tokens: int = 0
    """Tokens per model turn at most (0: the preset's rollout.max_new_tokens)."""
    workload: Annotated[EpisodeWorkload, tyro.conf.OmitArgPrefixes] = EpisodeWorkload(
        latency="lognormal:2.0:1.0", obs_tokens=256, num_workers=512)
    """The episodes (flags without a prefix: --turns, --latency, --obs-tokens, --num-workers, ...)."""
    fit: str = ""
    """A run directory (metrics.jsonl and samples/ of a run with episodes): turns, observations and latency from it."""
    seed: int = 0
    eta_prompts: float = 0.0
    """tail's η_P (prompts launched per short round over P0) for the tail policies, as ``bench episodes`` sets it
    (0: the policy's, 1.25)."""
    eta_responses: float = 0.0
    """tail's η_R (episodes launched per prompt over R0) for the tail policies (0: the policy's default, 1)."""
    eta_long: float = 0.0
    """tail's η_L (prompts launched per long round over P0) for tail (0: the policy's, 1;
    tail+paper: always 1)."""

    def __post_init__(self) -> None:
        for name in ("gpus", "num_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def episodes(self) -> EpisodeWorkload:
        """The workload, or the one fitted from ``--fit``'s run."""
        if not self.fit:
            return self.workload
        from rollpacker.sim.episodes import fit_run

        return fit_run(Path(self.fit), self.workload)


def config(args: EpisodesArgs, policy: str):
    """The :class:`~rollpacker.sim.simulate.SimConfig` of ``policy`` on the preset."""
    from rollpacker.schedule.config import POLICY_CONFIGS
    from rollpacker.sim.simulate import preset_config

    name, *variants = policy.split("+")
    if name not in POLICY_CONFIGS or not set(variants) <= set(VARIANTS) or "paper" in variants and name != "tail":
        raise ValueError(f"--policies: unknown policy {policy!r}: write POLICY, POLICY+stream, POLICY+warm or "
                         f"tail+paper, POLICY one of {', '.join(POLICY_CONFIGS)}")
    from rollpacker.schedule.tail import eta_overrides

    etas = eta_overrides(args.eta_prompts, args.eta_responses, args.eta_long, paper="paper" in variants)
    schedule = POLICY_CONFIGS[name](**(etas if name == "tail" else {}))
    cfg = preset_config(args.preset, args.model or None)
    rollout = replace(cfg.rollout, num_prompts=args.num_prompts or cfg.rollout.num_prompts,
                      group_size=args.group_size or cfg.rollout.group_size,
                      max_new_tokens=args.turn_tokens or cfg.rollout.max_new_tokens)
    settings = {key: value for v in variants for key, value in VARIANTS[v].items()}
    return replace(cfg, gpus=args.gpus, rollout=rollout, schedule=schedule, num_steps=args.num_steps,
                   seed=args.seed, **settings)


def per_prompt(results) -> dict[str, float]:
    """Rollout and step seconds per trained prompt, and per step, over the steps simulated."""
    prompts = sum(len(r.record.groups) for r in results)
    rollout, step = sum(r.rollout_s for r in results), sum(r.step_s for r in results)
    return {"rollout_s": rollout / prompts, "step_s": step / prompts, "rollout_step_s": rollout / len(results),
            "step_step_s": step / len(results), "prompts": prompts,
            "turns": sum(o.num_turns for r in results for g in r.record.groups for o in g.outputs),
            "evictions": sum(r.record.num_session_evictions for r in results) / len(results)}


def main(argv: list[str]) -> dict:
    from rollpacker.sim.simulate import simulate

    args = tyro.cli(EpisodesArgs, args=argv, prog="python -m rollpacker.sim episodes")
    try:
        workload = args.episodes()
        runs = {p: config(args, p) for p in args.policies.split(",")}
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    results = {p: per_prompt(simulate(cfg, record=True, env_workload=workload)) for p, cfg in runs.items()}
    return report(args, runs, workload, results)


def shape(workload: EpisodeWorkload) -> str:
    """The turns and latency of ``workload``, in words."""
    if workload.workload:
        return f"workload {workload.workload} (mean step {workload.shape.mean_step():.3g} s)"
    return f"turns {workload.turns} (+1 at p={workload.extra_turn}), latency {workload.latency}"


def report(args: EpisodesArgs, runs: dict, workload: EpisodeWorkload, results: dict[str, dict]) -> dict:
    """The table, and the JSON summary."""
    cfg = next(iter(runs.values()))
    base = results[next(iter(results))]
    print(f"{cfg.model} on {cfg.gpus} {cfg.hardware} GPUs, {cfg.num_replicas} replicas of TP {cfg.tp}; P0="
          f"{cfg.rollout.num_prompts}, R0={cfg.rollout.group_size} episodes, up to {cfg.rollout.max_new_tokens} "
          f"tokens a turn; {shape(workload)} on "
          f"{workload.num_workers} workers, {workload.obs_tokens} observation tokens, "
          f"{'resident' if workload.resident else 'no resident'} sessions; {args.num_steps} steps")
    print(f"{'policy':<14}{'rollout s/step':>16}{'step s/step':>13}{'rollout s/prompt':>18}{'step s/prompt':>15}"
          f"{'speedup rollout':>17}{'step':>7}{'evictions/step':>16}")
    figures = {"model": cfg.model, "gpus": cfg.gpus, "tp": cfg.tp}
    for p, r in results.items():
        print(f"{p:<14}{r['rollout_step_s']:>16.1f}{r['step_step_s']:>13.1f}{r['rollout_s']:>18.2f}{r['step_s']:>15.2f}"
              f"{base['rollout_s'] / r['rollout_s']:>16.2f}x{base['step_s'] / r['step_s']:>6.2f}x"
              f"{r['evictions']:>16.0f}")
        name = p.replace("+", "_")
        figures |= {f"rollout_s_{name}": round(r["rollout_step_s"], 2), f"step_s_{name}": round(r["step_step_s"], 2),
                    f"session_evictions_{name}": round(r["evictions"], 1)}
        if r is not base:
            figures |= {f"rollout_speedup_{name}": round(base["rollout_s"] / r["rollout_s"], 3),
                        f"step_speedup_{name}": round(base["step_s"] / r["step_s"], 3)}
    trained = sum(r["prompts"] for r in results.values()) * cfg.rollout.group_size
    figures["turns_mean"] = round(sum(r["turns"] for r in results.values()) / trained, 3)
    return figures
