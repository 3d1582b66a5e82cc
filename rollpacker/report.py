"""Plots of one run's ``metrics.jsonl``: step time by stage, response lengths, reward.

    python -m rollpacker.report RUN_DIR

writes ``RUN_DIR/plots/`` (step time, response lengths, reward, reward functions, evaluation, the environments'
counts, and ``samples.md``) and prints their paths. It also prints what the newest whole checkpoint says of
the prompts (:func:`prompt_ledger`).

Invariants:

- A plot whose metrics appear in no step is skipped with a note, not drawn empty.
- When a step was logged twice (a resumed run), its last line wins.
- The prompt ledger is checked against the prompts ``metrics.jsonl`` counts as trained.

Why: a run directory alone must show what the run did, and that every prompt trained exactly once.
Each plot: ``docs/your-task.md`` (Metrics to watch).
"""

from __future__ import annotations

import collections
import json
import math
import re
import sys
from dataclasses import dataclass
from numbers import Real
from pathlib import Path

import tyro

from rollpacker.reward.functions import OWN

STAGES = ("time/rollout", "time/reward", "time/train", "time/weight_sync")
LENGTHS = "rollout/response_lengths"
REWARDS = ("reward/mean", "reward/accuracy", "eval/accuracy")
SMOOTH = 10


class ReportError(Exception):
    """A run directory or metrics file that cannot be read; the message names the path/line."""


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def _plotted(value: object) -> bool:
    """A point a plot shows: a finite number (a NaN or infinite loss, reward or eval is left out of the plot, which
    cannot scale its axis to one; metrics.jsonl keeps it)."""
    return _is_number(value) and math.isfinite(value)


def read_metrics(path: Path) -> list[dict]:
    """The records of ``path``, one per step, sorted by step."""
    by_step: dict[int, dict] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # the line a running (or crashed) run is writing: the job drops it too
                    print(f"note: {where}: left out, unfinished (a run writing it, or one that stopped mid-line)",
                          file=sys.stderr)
                    break
                raise ReportError(f"{where}: not valid JSON ({e.msg}); fix or delete the line") from None
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                raise ReportError(f'{where}: expected a JSON object with an integer "step"')
            for key, value in record.items():
                if (key.startswith("time/") or key in REWARDS) and value is not None and not _is_number(value):
                    raise ReportError(f"{where}: {key} should be a number, got {value!r}")
                if key == LENGTHS and not (isinstance(value, list) and all(map(_is_number, value))):
                    raise ReportError(f"{where}: {key} should be a list of numbers")
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]


def _bar_width(steps: list[int]) -> float:
    gaps = [b - a for a, b in zip(steps, steps[1:])]
    return 0.8 * min(gaps, default=1)


WITHIN = ("time/reward_exposed", "time/migration")
"""``time/`` metrics inside another stage: the wait for the last scores (reward), the stream trainer's moves
(rollout)."""
UNDER_TRAINING = ("time/rollout", "time/reward")
"""one_step_off's (a record with ``time/wait_prev_gen``): its batch's, run under the last step's training."""


def stacked(record: dict) -> dict[str, float]:
    """The record's stages that add up to its ``time/step``."""
    left_out = {*WITHIN, *(UNDER_TRAINING if "time/wait_prev_gen" in record else ())}
    return {k: v for k, v in record.items()
            if k.startswith("time/") and k != "time/step" and k not in left_out and _plotted(v)}


def plot_step_time(records: list[dict], ax) -> bool:
    records = [r for r in records if stacked(r)]  # not the final evaluation's record, a step of no stage
    stages = [stacked(r) for r in records]
    present = {k for stage in stages for k in stage}
    keys = [k for k in STAGES if k in present] + sorted(present - set(STAGES))
    if not keys:
        return False
    steps = [r["step"] for r in records]
    bottom = [0.0] * len(records)
    for key in keys:
        values = [stage.get(key, 0.0) for stage in stages]
        ax.bar(steps, values, bottom=bottom, width=_bar_width(steps), label=key)
        bottom = [b + v for b, v in zip(bottom, values)]
    totals = [(r["step"], r["time/step"]) for r in records if _plotted(r.get("time/step"))]
    if totals:
        ax.plot(*zip(*totals), "k.", label="time/step")
    ax.set(xlabel="step", ylabel="seconds", title="step time by stage")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return True


def plot_response_lengths(records: list[dict], ax) -> bool:
    """A box per round (the paper's Fig. 4a); tail batching's long rounds are shaded and red."""
    rows = [(r["step"], r[LENGTHS], r.get("sched/round_kind")) for r in records if r.get(LENGTHS)]
    if not rows:
        return False
    steps, lengths, kinds = zip(*rows)
    width = _bar_width(list(steps))
    boxes = ax.boxplot(lengths, positions=steps, widths=width, manage_ticks=False, patch_artist=True)
    for box, kind in zip(boxes["boxes"], kinds):
        box.set_facecolor("tab:red" if kind == "long" else "tab:blue")
        box.set_alpha(0.6)
    for step, kind in zip(steps, kinds):
        if kind == "long":
            ax.axvspan(step - width / 2, step + width / 2, color="tab:red", alpha=0.12, lw=0)
    if "long" in kinds:
        from matplotlib.patches import Patch

        ax.legend(handles=[Patch(color="tab:blue", alpha=0.6, label="short/sync round"),
                           Patch(color="tab:red", alpha=0.6, label="long round")], fontsize="small")
    ax.set(xlabel="step", ylabel="tokens", title=f"{LENGTHS} per round")
    if all(x > 0 for row in lengths for x in row):
        ax.set_yscale("log")  # the long tail would flatten every box on a linear axis
    ax.set_xlim(min(steps) - 1, max(steps) + 1)
    return True


def plot_reward(records: list[dict], ax) -> bool:
    """Each reward series against step; a long per-step series faint, with its running mean over
    ``SMOOTH`` steps drawn over it (one step's batch is too small to read a trend from); the held-out
    evaluation's as it is (a mean over 10 evaluations was 100 steps at eval_every 10, labelled 10)."""
    drawn = []
    for key in REWARDS:
        points = [(r["step"], r[key]) for r in records if _plotted(r.get(key))]
        if not points or points in drawn:  # reward/mean is reward/accuracy when rewards are 0 or 1
            continue
        if key.startswith("eval/"):
            ax.plot(*zip(*points), marker="o", label=key)
        else:
            _plot_series(ax, points, key)
        drawn.append(points)
    if drawn:
        ax.set(xlabel="step", title="reward")
        ax.legend(fontsize="small")
    return bool(drawn)


def _plot_series(ax, points: list[tuple[int, float]], label: str) -> None:
    """``points`` against step: with markers, or, past 50 points, faint under their running mean over ``SMOOTH``."""
    steps, values = zip(*points)
    if len(points) <= 50:
        ax.plot(steps, values, marker="o", label=label)
        return
    [line] = ax.plot(steps, values, alpha=0.3, lw=0.8)
    means = [sum(values[max(0, i - SMOOTH + 1) : i + 1]) / min(i + 1, SMOOTH) for i in range(len(values))]
    ax.plot(steps, means, color=line.get_color(), lw=2, label=f"{label} ({SMOOTH}-step mean)")


INFO = re.compile(r"(?:env|eval)/(?:.+/)?info/.+_frac")
"""The share of episodes in which an environment counted something (:func:`rollpacker.env.info.info_metrics`)."""


def plot_env_info(records: list[dict], ax) -> bool:
    """The share of episodes in which the environments counted something vs step: ``env/info/K_frac``
    (training, solid) and ``eval/[SOURCE/]info/K_frac`` (held out, dashed), e.g. a ToolEnv's episodes
    that called a tool (``tool_calls_frac``) and that had a call fail (``tool_errors_frac``)."""
    keys = sorted({k for r in records for k, v in r.items() if INFO.fullmatch(k) and _plotted(v)},
                  key=lambda k: (k.startswith("eval/"), k))
    for i, key in enumerate(keys):
        points = [(r["step"], r[key]) for r in records if _plotted(r.get(key))]
        if key.startswith("eval/"):
            ax.plot(*zip(*points), marker="o", linestyle="--", color=f"C{i % 10}", label=key)
        else:
            _plot_series(ax, points, key)
    if keys:
        ax.set(xlabel="step", ylabel="share of episodes", ylim=(-0.02, 1.02),
               title="what the environments counted: training (env/, solid) and held out (eval/, dashed)")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return bool(keys)




def plot_reward_functions(records: list[dict], ax) -> bool:
    """Each function's mean reward (``reward/NAME``, where it applied) vs step, and on a second axis
    the responses whose reward failed (``reward/errors``): what a task's author tunes on."""
    names = sorted({k[7:] for r in records for k, v in r.items()
                    if k.startswith("reward/") and k[7:] not in OWN and _plotted(v)})
    errors = [(r["step"], r["reward/errors"]) for r in records if _plotted(r.get("reward/errors"))]
    if not names and not any(e for _, e in errors):
        return False
    for name in names:
        points = [(r["step"], r[f"reward/{name}"]) for r in records if _plotted(r.get(f"reward/{name}"))]
        ax.plot(*zip(*points), marker="o" if len(points) <= 50 else None, label=f"reward/{name}")
    ax.set(xlabel="step", ylabel="mean reward where it applied", title="reward functions")
    if errors:
        twin = ax.twinx()
        steps = [s for s, _ in errors]
        twin.bar(steps, [e for _, e in errors], width=_bar_width(steps), color="tab:red", alpha=0.3,
                 label="reward/errors")
        twin.set_ylabel("responses whose reward failed")
        twin.legend(fontsize="small", loc="upper right")
    if names:
        ax.legend(fontsize="small", loc="upper left")
    return True


def eval_series(records: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """``eval/[SOURCE/]pass@k`` and ``eval/[SOURCE/]mean@n`` by key, as (step, value) points."""
    pattern = re.compile(r"eval/(?:.+/)?(pass|mean)@\d+")
    keys = sorted({k for r in records for k, v in r.items() if pattern.fullmatch(k) and _plotted(v)})
    return {k: [(r["step"], r[k]) for r in records if _plotted(r.get(k))] for k in keys}


def plot_eval(records: list[dict], ax) -> bool:
    """Held-out pass@k (solid) and mean@n (dashed) vs step, overall (``all``) and per data source."""
    series = eval_series(records)
    if not series:
        return False
    for key, points in series.items():
        source, metric = key[5:].rpartition("/")[::2]
        ax.plot(*zip(*points), marker="o", linestyle="--" if metric.startswith("mean") else "-",
                label=f"{source or 'all'} {metric}")
    ys = [y for points in series.values() for _, y in points]  # mean@n: a reward may be below 0 or above 1
    ax.set(xlabel="step", title="held-out evaluation: pass@k (solid), mean@n (dashed)",
           ylim=(min(0.0, *ys) - 0.02, max(1.0, *ys) + 0.02))
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return True


PLOTS = {
    "step_time.png": (plot_step_time, "time/* metrics"),
    "response_lengths.png": (plot_response_lengths, LENGTHS),
    "reward.png": (plot_reward, " or ".join(REWARDS)),
    "reward_functions.png": (plot_reward_functions, "reward/NAME or reward/errors"),
    "eval.png": (plot_eval, "eval/pass@k or eval/mean@n"),
    "env_info.png": (plot_env_info, "env/info/K_frac or eval/info/K_frac (episodes' step infos)"),
}


SHOWN_CHARS = 600
"""Characters of a prompt or completion shown in samples.md (the samples file has them whole)."""


def _step_of(path: Path) -> int:
    number = path.stem.removeprefix("step_")
    return int(number) if number.isdigit() else -1


def _cut(text: object) -> str:
    text = text if isinstance(text, str) else json.dumps(text)  # chat messages as JSON
    return text[:SHOWN_CHARS] + (" [...]" if len(text) > SHOWN_CHARS else "")


def write_samples(run_dir: Path, out: Path) -> bool:
    """``out``: a few responses of the newest ``run_dir/samples/step_N.jsonl`` (False: there is none)."""
    files = sorted((run_dir / "samples").glob("step_*.jsonl"), key=_step_of)
    if not files:
        return False
    samples = []
    for lineno, line in enumerate(files[-1].read_text(encoding="utf-8").splitlines(keepends=True), 1):
        if not line.strip():
            continue
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError as e:
            if not line.endswith("\n"):  # a run writing it, or one that stopped mid-line
                print(f"note: {files[-1]}:{lineno}: left out, unfinished", file=sys.stderr)
                break
            raise ReportError(f"{files[-1]}:{lineno}: not valid JSON ({e.msg}); fix or delete the line") from None
    if not samples:
        return False
    scored = [x for x in samples if _is_number(x["reward"])] or samples  # a null reward: a failed score
    picks = {"best reward": max(scored, key=lambda x: x["reward"] or 0.0),
             "worst reward": min(scored, key=lambda x: x["reward"] or 0.0),
             "longest": max(samples, key=lambda x: x["length"]), "shortest": min(samples, key=lambda x: x["length"])}
    lines = [f"# Samples of step {samples[0]['step']} ({len(samples)} responses in {files[-1]})", ""]
    for title, x in picks.items():
        reward = f"{x['reward']:.3g}" if _is_number(x["reward"]) else "none"
        lines += [f"## {title}: reward {reward}, {x['length']} tokens, {x['finish_reason']}", "",
                  f"rewards: {json.dumps(x.get('rewards', {}))}", "", "prompt, as the engine got it:", "", "```",
                  _cut(x.get("prompt_text", x["prompt"])), "```", "",
                  *(_episode(x) if "turns" in x else ["completion:", "", "```", _cut(x["completion"]), "```", ""])]
    out.write_text("\n".join(lines), encoding="utf-8")
    return True


def _episode(x: dict) -> list[str]:
    """An episode's sample as markdown lines: each turn with its role and whether it was trained."""
    lines = [f"episode: {x['num_turns']} model turns, ended {x['end']}"
             + (f" ({x['end_detail']})" if x.get("end_detail") else "")
             + f"; {x['model_tokens']} model tokens (trained), {x['env_tokens']} environment tokens (not trained); "
             f"environment reward {x['env_reward']:.3g}", ""]
    for turn in x["turns"]:
        lines += [f"{turn['role']}, {turn['tokens']} tokens, {'trained' if turn['trained'] else 'not trained'}:", "",
                  "```", _cut(turn["text"]), "```", ""]
    return lines


def prompt_ledger(run_dir: Path, records: list[dict]) -> str:
    """What the newest whole checkpoint's sample ledger says of each epoch's prompts, checked against the
    trained prompts metrics.jsonl counts up to that checkpoint ("" without a checkpoint)."""
    from rollpacker import checkpoint

    try:
        newest = checkpoint.newest_whole(run_dir, announce=False)
    except checkpoint.CheckpointError as e:
        return f"prompts: {e}"
    if newest is None:
        return ""
    state = checkpoint.train_state(newest)
    policy, step = state.get("policy", {}), state["step"]
    if records and (first := min(r["step"] for r in records)) > 0:  # resumed here from another run's checkpoint
        return (f"prompts (checkpoint {newest}, step {step}): not checked, as metrics.jsonl starts at step {first} "
                "(a run resumed here from another's checkpoint: that run's metrics.jsonl holds the rest)")
    counted = sum(r.get("sched/trained_prompts", 0) for r in records if r["step"] < step)
    failed = sum(r.get("sched/failed_prompts", 0) for r in records if r["step"] < step)
    lost = (f"\n  {failed:g} of them trained nothing: every episode of theirs failed in its environment "
            "(env/errors; the step's samples say why)") if failed else ""
    where = f"prompts (checkpoint {newest}, step {step}, schedule:{policy.get('name')})"
    sampler = policy.get("sampler", {})
    sizes = sampler.get("sizes") or [sampler.get("num_rows", 0)] * (sampler.get("epoch", 0) + 1)  # rows per epoch
    if "ledger" not in policy:  # sync trains every prompt it draws, once, but for those the filter drops
        drawn = sum(sizes[:-1]) + sampler.get("position", 0)
        filtered = sum(r.get("sched/filtered", 0) for r in records if r["step"] < step)
        verdict = ("each once" if drawn == counted + filtered else
                   f"but metrics.jsonl counts {counted} trained" + (f" and {filtered} filtered" if filtered else ""))
        what = f"{counted} trained and {filtered} filtered" if filtered else "trained"
        return f"{where}: {drawn} drawn in order and {what}, {verdict}{lost}"
    ledger = policy["ledger"]
    trained = collections.Counter(tuple(k) for k in ledger["trained"])
    lines = [f"{where}: {sum(trained.values())} trained ({counted} in metrics.jsonl), "
             f"{len(ledger['queue'])} deferred, {len(ledger['filtered'])} filtered"]
    for epoch in sorted({e for e, _ in trained}):
        rows = collections.Counter({r: n for (e, r), n in trained.items() if e == epoch})
        twice = sorted(r for r, n in rows.items() if n > 1)
        lines.append(f"  epoch {epoch}: {len(rows)} of {sizes[epoch]} rows trained; "
                     + (f"twice: {twice}" if twice else "none twice"))
    if sum(trained.values()) != counted:
        lines.append(f"  metrics.jsonl counts {counted} prompts trained before step {step}: not each once")
    return "\n".join(lines) + lost


def write_report(run_dir: Path) -> tuple[list[Path], list[dict]]:
    """Write the plots of ``run_dir`` into ``run_dir/plots``; returns the paths written and the records read."""
    if run_dir.is_file():
        raise ReportError(f"{run_dir} is a file; pass the run's output directory ({run_dir.resolve().parent}?)")
    if not run_dir.is_dir():
        raise ReportError(f"run directory {run_dir} does not exist; pass the run's output directory")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"{path} not found; is {run_dir} a rollpacker run directory?")
    records = read_metrics(path)
    if not records:
        raise ReportError(f"{path} has no records yet")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = run_dir / "plots"
    written = []
    try:
        out_dir.mkdir(exist_ok=True)
        for name, (plot, needs) in PLOTS.items():
            fig, ax = plt.subplots(figsize=(10, 4.5))
            try:
                if plot(records, ax):
                    fig.savefig(out_dir / name, dpi=100, bbox_inches="tight")
                    written.append(out_dir / name)
                else:
                    print(f"skipped {name}: no step has {needs}", file=sys.stderr)
            finally:
                plt.close(fig)
        if write_samples(run_dir, out_dir / "samples.md"):
            written.append(out_dir / "samples.md")
        else:
            print("skipped samples.md: no samples (run with --metrics.samples-every N)", file=sys.stderr)
    except OSError as e:
        raise ReportError(f"{out_dir}: cannot write the plots there ({e.strerror or e}); it must be a directory "
                          "this user can write") from None
    return written, records


@dataclass
class Args:
    """Plot a run's metrics.jsonl into RUN_DIR/plots/."""

    run_dir: tyro.conf.Positional[Path]
    """A run directory holding metrics.jsonl."""


def main(argv: list[str] | None = None) -> int:
    run_dir = tyro.cli(Args, args=argv, prog="python -m rollpacker.report").run_dir
    try:
        paths, records = write_report(run_dir)  # read once: a torn last line's note is said once
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(p)
    ledger = prompt_ledger(run_dir, records)
    if ledger:
        print(ledger)
    return 0


if __name__ == "__main__":
    sys.exit(main())
