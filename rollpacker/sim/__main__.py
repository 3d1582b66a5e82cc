"""``python -m rollpacker.sim``: simulate an RL job at cluster scale; every command ends with a JSON line.

    python -m rollpacker.sim --preset qwen2.5-14b-16k --gpus 32 schedule:tail [--gantt out.png]
    python -m rollpacker.sim table2 [--num-steps 20]     the paper's Table 2 beside the simulator's
    python -m rollpacker.sim table1 [--num-steps 20]     the calibration against Table 1
    python -m rollpacker.sim fig13c [--num-steps 20]     the calibration against Fig. 13c (adaptive code timeout)
    python -m rollpacker.sim workload [--fit]            the length mixture against the paper's statistics
    python -m rollpacker.sim validate                    the simulator against rollouts measured here
    python -m rollpacker.sim growth                      tail's speedup against the decode step's growth with the batch
    python -m rollpacker.sim spec --preset qwen2.5-7b-8k schedule:tail   speculative decoding off and on
    python -m rollpacker.sim episodes --preset qwen2.5-7b-8k [--gpus 128]   sync vs tail over multi-turn episodes

The first form takes the rollout settings (P0, R0, max_new_tokens, TP) from the preset; ``--gpus``
defaults to the paper's GPU count for the model; every field of :class:`SimConfig` is a flag
(``--rollout.num-prompts 64``, ``schedule:sorted --schedule.sorted-batches 2``,
``--calib.hbm-efficiency 0.7``, ``--lengths.long-fraction 0.1``, ``--trace metrics.jsonl``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace

from rollpacker.errors import UserError
from rollpacker.sim.simulate import preset_config


def _pop_flag(args: list[str], flag: str, default: str | None, keep: bool = False) -> str | None:
    """The value of ``flag`` (``--flag VALUE`` or ``--flag=VALUE``), taken out of ``args`` unless ``keep``."""
    for i, arg in enumerate(args):
        if arg == flag or arg.startswith(f"{flag}="):
            value = arg.partition("=")[2] if "=" in arg else args[i + 1] if i + 1 < len(args) else ""
            if not value:
                raise SystemExit(f"{flag} needs a value")
            if not keep:
                del args[i:i + (1 if "=" in arg else 2)]
            return value
    return default


def parse(argv: list[str]):
    """The :class:`SimConfig` of ``argv`` (``--preset`` then flags), and its ``--gantt`` path and step count."""
    import tyro

    from rollpacker.schedule.config import schedule_args
    from rollpacker.sim.simulate import SimConfig

    args = list(argv)
    preset = _pop_flag(args, "--preset", "qwen2.5-14b-16k")
    gantt = _pop_flag(args, "--gantt", "")
    gantt_steps = _pop_flag(args, "--gantt-steps", "5")
    if not gantt_steps.isdigit() or int(gantt_steps) < 1:
        raise SystemExit(f"--gantt-steps must be a positive integer, got {gantt_steps!r}")
    model = _pop_flag(args, "--model", None, keep=True)  # it names the preset's model too
    default = preset_config(preset, model)
    args = schedule_args(args, default.policy)
    cfg = tyro.cli(SimConfig, default=default, args=args, config=(tyro.conf.CascadeSubcommandArgs,),
                   prog="python -m rollpacker.sim",
                   description=f"Simulate an RL job (preset {preset}; --preset NAME, --gantt out.png, --gantt-steps N, "
                               "or a command: table2, table1, fig13c, workload, validate, growth, spec, episodes).")
    return cfg, gantt, int(gantt_steps)


def run(argv: list[str]) -> dict:
    from rollpacker.sim.simulate import simulate, summarize

    cfg, gantt, gantt_steps = parse(argv)
    results = simulate(cfg, record=bool(gantt))
    if cfg.planner and results:  # the header's TP is the first round's (plan.initial_tp, when given)
        cfg = replace(cfg, rollout=replace(cfg.rollout, tp=results[0].tp))
    cost = cfg.cost()
    pools = f" ({cfg.train_pool} of them train)" if cfg.train_pool < cfg.gpus else ""
    print(f"{cfg.model} on {cfg.gpus} {cfg.hardware} GPUs: {cfg.num_replicas} rollout replicas of TP {cfg.tp}{pools} "
          f"(KV cache {cost.kv_capacity_tokens() / 1e3:,.0f}k tokens each); P0={cfg.rollout.num_prompts}, "
          f"R0={cfg.rollout.group_size}, "
          f"up to {cfg.rollout.max_new_tokens} new tokens; policy {cfg.policy}; {cfg.num_steps} steps "
          f"({'trace ' + cfg.trace if cfg.trace else 'length mixture'})")
    stream = f"{'scaled':>8}{'at':>6}{'hidden':>8}" if cfg.stream else ""
    print(f"{'round':<8}{'steps':>6}{'rollout':>9}{'reward':>8}{'train':>8}{'sync':>7}{'step':>8}{'longest':>9}"
          f"{'preempt':>9}{'bubble':>8}{stream}   (seconds; reward = exposed, after rollout"
          + (f"; {cfg.policy}: step = wait for the batch + train + sync" if cfg.schedule.own_pools else "")
          + ("; scaled = share of steps the stream trainer scaled down, at = prompts complete then, hidden = "
             "train time done under rollout)" if cfg.stream else ")"))
    summary = summarize(results)
    for kind, m in summary.items():
        stream = f"{m['scaled_down']:>8.2f}{m['scaled_frac']:>6.2f}{m['hidden_train_s']:>8.1f}" if cfg.stream else ""
        print(f"{kind:<8}{m['steps']:>6}{m['rollout_s']:>9.1f}{m['reward_s']:>8.1f}{m['train_s']:>8.1f}"
              f"{m['sync_s']:>7.1f}{m['step_s']:>8.1f}{m['max_length']:>9.0f}{m['num_preemptions']:>9.1f}"
              f"{m['bubble_ratio']:>8.2f}{stream}")
    tps = {kind: [r.tp for r in results if r.kind == kind] for kind in summary if kind != "all"}
    if cfg.planner:  # the TP each round kind ran at: the header's is the first
        print("planner (the paper's heuristic: no profile guard in a simulation), rollout TP by step: " + "; ".join(
            f"{kind} {' '.join(map(str, ts))}" for kind, ts in tps.items()))
    if gantt:
        from rollpacker.sim.gantt import plot

        path = plot(results[:gantt_steps], gantt, title=f"{cfg.model}, {cfg.gpus} GPUs, TP {cfg.tp}, {cfg.policy}")
        print(f"gantt chart of the first {min(gantt_steps, len(results))} steps written to {path}")
    figures = {"policy": cfg.policy, "model": cfg.model, "gpus": cfg.gpus, "tp": cfg.tp}
    if cfg.planner:
        figures["tps"] = {kind: sorted(set(ts)) for kind, ts in tps.items()}
    for kind, m in summary.items():
        prefix = "" if kind == "all" else f"{kind}_"
        figures |= {f"{prefix}{k}": round(m[k], 3) for k in ("step_s", "rollout_s", "reward_s", "train_s", "sync_s")}
        if cfg.stream:
            figures |= {f"{prefix}{k}": round(m[k], 3) for k in ("scaled_down", "scaled_frac", "hidden_train_s")}
        if cfg.schedule.own_pools:
            figures[f"{prefix}wait_s"] = round(m["wait_s"], 3)
        figures[f"{prefix}steps"] = m["steps"]
    return figures


def spec(argv: list[str]) -> dict:
    """The job of ``argv`` (the first form's flags) simulated with speculative decoding off and on:
    rollout, tail phase (no replica running more than 8 requests) and step, per step and side by side."""
    import numpy as np

    from rollpacker.sim.simulate import simulate
    from rollpacker.sim.speculation import tail_s

    cfg, gantt, _ = parse(argv)
    if gantt:
        raise SystemExit("spec draws no gantt chart (its table sets its two runs side by side): drop --gantt, or chart "
                         "one with python -m rollpacker.sim, the same flags and --speculation.enabled or not")
    rows = {}
    for name, on in (("off", False), ("on", True)):
        steps = simulate(replace(cfg, speculation=replace(cfg.speculation, enabled=on)), record=True)
        long = [r.rollout_s for r in steps if r.kind == "long"]
        rows[name] = {"rollout_s": np.mean([r.rollout_s for r in steps]), "step_s": np.mean([r.step_s for r in steps]),
                      "tail_s": np.mean([tail_s(r.record.busy, r.rollout_s) for r in steps]),
                      "long_s": np.mean(long) if long else float("nan")}
    s = cfg.speculation
    rate = (f"trace {s.trace}" if s.trace else f"accept rate {s.accept_rate}, drafts for {s.drafted:.0%} of requests"
            + (f" of {s.draft_len:g} tokens on average" if s.draft_len else ""))
    print(f"{cfg.model} on {cfg.gpus} {cfg.hardware} GPUs, TP {cfg.tp}, policy {cfg.policy}, {cfg.num_steps} steps; "
          f"speculation: {rate}, up to {s.max_tokens} draft tokens, {s.draft_us:g} us drafting per request")
    print(f"{'speculation':<13}{'rollout s':>11}{'tail s':>9}{'long round s':>14}{'step s':>9}   (per step; tail: "
          "no replica running more than 8)")
    for name, m in rows.items():
        print(f"{name:<13}{m['rollout_s']:>11.1f}{m['tail_s']:>9.1f}{m['long_s']:>14.1f}{m['step_s']:>9.1f}")
    off, on = rows["off"], rows["on"]
    ratio = lambda k: round(off[k] / on[k], 3) if on[k] > 0 and not np.isnan(on[k]) else None  # noqa: E731
    return {"policy": cfg.policy, "model": cfg.model, "gpus": cfg.gpus, "tp": cfg.tp,
            "accept_rate": None if s.trace else s.accept_rate, "sim_rollout_speedup_spec": ratio("rollout_s"),
            "sim_tail_speedup_spec": ratio("tail_s"), "sim_long_round_speedup_spec": ratio("long_s"),
            "sim_step_speedup_spec": ratio("step_s")}


@dataclass(kw_only=True)
class TableArgs:
    num_steps: int = 20
    """Steps simulated per policy and setting: whole tail-batching periods of 4 short rounds and a long one."""

    def __post_init__(self) -> None:
        if self.num_steps <= 0 or self.num_steps % 5:
            raise ValueError(f"--num-steps must be a positive multiple of 5 (whole periods of 4 short rounds and "
                             f"1 long round), got {self.num_steps}")


@dataclass(kw_only=True)
class WorkloadArgs:
    fit: bool = False
    """Refit the mixture (seeded; about two minutes) instead of showing the defaults' statistics."""
    num_candidates: int = 2000
    """Random candidates of the fit (then 1000 steps of refinement around the best)."""

    def __post_init__(self) -> None:
        if self.num_candidates < 1:
            raise ValueError(f"--num-candidates must be >= 1, got {self.num_candidates}")


def workload(argv: list[str]) -> dict:
    import tyro

    from rollpacker.data.lengths import LengthModel
    from rollpacker.sim.workload import PAPER_LENGTHS, fit_length_model, length_loss, length_stats

    args = tyro.cli(WorkloadArgs, args=argv, prog="python -m rollpacker.sim workload")
    model = fit_length_model(args.num_candidates)[0] if args.fit else LengthModel()
    stats = length_stats(model)
    print(f"length mixture {'fitted' if args.fit else '(defaults)'}: {model}")
    print(f"{'statistic (16k cap)':<40}{'paper':>12}{'model':>10}")
    rows = (("P75 (tokens)", "{}-{}".format(*PAPER_LENGTHS["p75"]), stats["p75"]),
            ("longest / median", "{}-{}".format(*PAPER_LENGTHS["max_over_median"]), stats["max_over_median"]),
            ("cap / longest kept, best short round", f"{PAPER_LENGTHS['short_max_reduction']}",
             stats["short_max_reduction"]),
            ("share of steps reaching the cap", f">={PAPER_LENGTHS['cap_hit_rate']}", stats["cap_hit_rate"]))
    for name, paper, sim in rows:
        print(f"{name:<40}{paper:>12}{sim:>10.2f}")
    return {"loss": round(length_loss(stats), 5), **{k: round(v, 3) for k, v in stats.items()}}


def main(argv: list[str] | None = None) -> None:
    import tyro

    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith(("-", "schedule:")) else ""  # schedule:NAME: the first form
    if command in ("table1", "table2", "fig13c"):
        from rollpacker.sim import paper

        args = tyro.cli(TableArgs, args=argv[1:], prog=f"python -m rollpacker.sim {command}")
        figures = getattr(paper, command)(args.num_steps)
    elif command == "workload":
        figures = workload(argv[1:])
    elif command == "validate":
        from rollpacker.sim import validate

        figures = validate.main(argv[1:])
    elif command == "episodes":
        from rollpacker.sim import episodes_cli

        figures = episodes_cli.main(argv[1:])
    elif command == "growth":
        from rollpacker.sim import growth

        figures = growth.main(argv[1:])
    elif command not in ("", "spec"):
        raise SystemExit(f"unknown command {command!r}: use table2, table1, fig13c, workload, validate, growth, "
                         "spec, episodes, or flags (--help)")
    else:
        try:
            figures = spec(argv[1:]) if command else run(argv)
        except (FileNotFoundError, ValueError, UserError) as e:  # a preset, trace or setup that cannot run: say why
            raise SystemExit(f"error: {e}") from None
    sys.stdout.flush()
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
