"""The paper's numbers beside the simulator's: Table 1 (the calibration) and Table 2 (the check).

- ``table1``: the veRL baseline of Qwen2.5-14B/16k on 32 H800s, one task at a time, as §2.2
  runs it; the share of rollout, reward and training in a step against Table 1. The training
  efficiency and the reward constants were set so that these match: this is the calibration.
- ``fig13c``: Fig. 13c's adaptive code timeout, Qwen2.5-7B/8k on 16 H800s, code only, tail
  batching with asynchronous scoring: the mean of rollout plus the scoring left after it under
  the fixed 30 s timeout, over the same under the adaptive one, against the paper's 1.6x. The spread of
  sandbox run times (``RewardModel.code_sigma``) was fitted to it (calibration too).
- ``table2``: the §6 setups (7B/8k on 16 GPUs with rollout TP 1, 14B/16k on 32 with TP 2, 32B/32k
  on 64 with TP 2; P0 = 128, R0 = 8, the uniform math/code/judge mix), veRL (``sync``, synchronous
  reward) against tail batching (``tail``), then tail batching with the reward scheduler
  (asynchronous scoring, adaptive code timeouts, judge colocated), then with the parallelism
  planner (the real :class:`~rollpacker.plan.planner.Planner` picks each round's TP from its
  simulated preemptions, starting at §6's TP), then with the stream trainer (the real
  :class:`~rollpacker.schedule.scale_down.ScaleDownDecider` decides each round's scale-down; the freed GPUs
  train on complete groups under the rollout). Speedup = mean step time over the same number of
  steps. Nothing was fitted to Table 2; rows whose parts are not built yet say so.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from rollpacker.config import load_preset
from rollpacker.schedule.config import POLICY_CONFIGS
from rollpacker.schedule.sync import SyncConfig
from rollpacker.schedule.tail import TailConfig
from rollpacker.sim.simulate import SimConfig, simulate, summarize

TABLE1 = {"math": (0.72, 0.05, 0.23), "code": (0.66, 0.13, 0.21), "judge": (0.71, 0.07, 0.22)}
"""Table 1: rollout, reward and training shares of a veRL step, Qwen2.5-14B/16k, 32 H800s."""

FIG13C = 1.6
"""Fig. 13c: the adaptive timeout's speedup of rollout + asynchronous scoring, averaged over all steps."""

TABLE2_ROWS = ("veRL baseline", "+ tail batching", "+ reward scheduler", "+ parallelism planner", "+ stream trainer")
BUILT_ROWS = 5
"""Rows the simulator can build so far: all of them."""
SYNC, TAIL = SyncConfig.name, TailConfig.name
VARIANTS = {SYNC: {}, TAIL: {}, f"{TAIL}+reward": {"reward_scheduler": True},
            f"{TAIL}+reward+planner": {"reward_scheduler": True, "planner": True},
            f"{TAIL}+reward+planner+stream": {"reward_scheduler": True, "planner": True, "stream": True}}
"""The simulated configuration of each built row: the policy, then the stage optimizations."""


@dataclass(frozen=True)
class Setting:
    preset: str
    model: str
    gpus: int
    tp: int
    """Rollout TP of §6 (the presets may hold another)."""
    paper: tuple[float, ...]
    """Table 2's cumulative speedups, one per row."""

    @property
    def label(self) -> str:
        return self.preset.removeprefix("qwen2.5-")

    @property
    def title(self) -> str:
        size, cap = self.label.split("-")
        return f"Qwen2.5-{size.upper()}/{cap}, {self.gpus} GPUs, TP{self.tp}"


SETTINGS = (
    Setting("qwen2.5-7b-8k", "qwen2.5-7b", 16, 1, (1.00, 1.30, 2.01, 2.01, 2.03)),
    Setting("qwen2.5-14b-16k", "qwen2.5-14b", 32, 2, (1.00, 1.48, 1.99, 2.02, 2.22)),
    Setting("qwen2.5-32b-32k", "qwen2.5-32b", 64, 2, (1.00, 2.21, 2.48, 2.52, 2.56)),
)


def setting_config(setting: Setting, policy: str, **overrides) -> SimConfig:
    """The simulator's config of a §6 setup: P0, R0 and max_new_tokens from the repo's preset."""
    rollout = load_preset(setting.preset).rollout
    return SimConfig(model=setting.model, gpus=setting.gpus, rollout=replace(rollout, tp=setting.tp),
                     schedule=POLICY_CONFIGS[policy](), **overrides)


def table1(num_steps: int = 10) -> dict:
    """Simulated stage shares of the veRL baseline per task, beside Table 1. Returns the JSON figures."""
    setting = SETTINGS[1]
    print(f"Table 1: stage shares of a veRL step, {setting.model}/16k on {setting.gpus} H800s (TP {setting.tp}), "
          f"mean of {num_steps} steps")
    print(f"{'task':<8}{'rollout':>18}{'reward':>18}{'train':>18}{'step (s)':>10}")
    print(f"{'':<8}" + f"{'paper':>9}{'sim':>9}" * 3)
    figures = {}
    for task, paper in TABLE1.items():
        base = setting_config(setting, SYNC, num_steps=num_steps)
        cfg = replace(base, reward=replace(base.reward, tasks=(task,)))
        mean = summarize(simulate(cfg))["all"]
        sim = [mean[k] / mean["step_s"] for k in ("rollout_s", "reward_s", "train_s")]
        print(f"{task:<8}" + "".join(f"{p:>9.0%}{s:>9.1%}" for p, s in zip(paper, sim)) + f"{mean['step_s']:>10.1f}")
        figures[task] = {"rollout": round(sim[0], 4), "reward": round(sim[1], 4), "train": round(sim[2], 4),
                         "step_s": round(mean["step_s"], 2)}
    return figures


def fig13c(num_steps: int = 20) -> dict:
    """Rollout + exposed scoring with the fixed and the adaptive code timeout, beside Fig. 13c."""
    setting = SETTINGS[0]
    print(f"Fig. 13c: rollout + scoring left after it, {setting.model}/8k on {setting.gpus} H800s (TP {setting.tp}), "
          f"code only, tail batching, asynchronous scoring, mean of {num_steps} steps")
    means = {}
    for name, adaptive in (("fixed", False), ("adaptive", True)):
        base = setting_config(setting, TAIL, num_steps=num_steps, reward_scheduler=True, adaptive_timeouts=adaptive)
        results = simulate(replace(base, reward=replace(base.reward, tasks=("code",))))
        means[name] = {kind: statistics.mean(r.rollout_s + r.reward_s for r in results if kind in ("all", r.kind))
                       for kind in ("short", "long", "all")}
    print(f"{'timeout':<10}" + "".join(f"{k + ' (s)':>12}" for k in means["fixed"]))
    for name, row in means.items():
        print(f"{name:<10}" + "".join(f"{v:>12.1f}" for v in row.values()))
    speedup = means["fixed"]["all"] / means["adaptive"]["all"]
    print(f"adaptive speedup, all steps: paper {FIG13C:.1f}x, sim {speedup:.2f}x")
    return {"speedup": round(speedup, 3), "paper": FIG13C,
            **{f"{name}_{k}_s": round(v, 2) for name, row in means.items() for k, v in row.items()}}


def table2(num_steps: int = 20) -> dict:
    """Table 2 beside the simulated speedups of the built rows; returns the JSON figures."""
    sims: dict[str, dict] = {}
    for s in SETTINGS:
        means = {v: summarize(simulate(setting_config(s, v.split("+")[0], num_steps=num_steps, **kw)))["all"]
                 for v, kw in VARIANTS.items()}
        sims[s.label] = {"speedup": [means[SYNC]["step_s"] / means[v]["step_s"] for v in VARIANTS], "means": means}
    print(f"Table 2: cumulative end-to-end speedup over veRL, paper vs simulated (H800, P0=128, R0=8, math/code/judge "
          f"mix, mean step time over {num_steps} steps)")
    print(f"{'':<24}" + "".join(f"{s.title:>30}" for s in SETTINGS))
    print(f"{'':<24}" + f"{'paper':>10}{'sim':>9}{'error':>11}" * len(SETTINGS))
    rows, max_err = {}, 0.0
    for i, name in enumerate(TABLE2_ROWS):
        cells = ""
        for s in SETTINGS:
            paper = s.paper[i]
            if i >= BUILT_ROWS:
                cells += f"{paper:>9.2f}x{'not yet':>20}"
                continue
            sim = sims[s.label]["speedup"][i]
            err = sim / paper - 1
            max_err = max(max_err, abs(err))
            rows.setdefault(s.label, {})[name] = {"paper": paper, "sim": round(sim, 3), "rel_error": round(err, 4)}
            cells += f"{paper:>9.2f}x{sim:>8.2f}x{err:>+10.1%}"
        print(f"{name:<24}{cells}")
    w = max(map(len, VARIANTS)) + 2
    for s in SETTINGS:
        print(f"\n{'mean step (s), ' + s.label:<24}" + "".join(f"{v:>{w}}" for v in VARIANTS))
        for stage in ("step_s", "rollout_s", "reward_s", "train_s", "sync_s", "hidden_train_s"):
            print(f"{'  ' + stage[:-2]:<24}" + "".join(f"{sims[s.label]['means'][v][stage]:>{w}.1f}" for v in VARIANTS))
        print(f"{'  scaled down (share)':<24}" + "".join(f"{sims[s.label]['means'][v]['scaled_down']:>{w}.2f}"
                                                       for v in VARIANTS))
    step_s = {s.label: {v: round(sims[s.label]["means"][v]["step_s"], 2) for v in VARIANTS} for s in SETTINGS}
    streamed = [v for v, kw in VARIANTS.items() if kw.get("stream")]
    stream = {s.label: {k: round(sims[s.label]["means"][v][k], 3) for k in ("scaled_down", "scaled_frac",
                                                                            "hidden_train_s")}
              for s in SETTINGS for v in streamed}
    return {"max_rel_error": round(max_err, 4), "rows": rows, "step_s": step_s, "stream": stream,
            "num_steps": num_steps}
