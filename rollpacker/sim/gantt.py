"""A Gantt-style PNG of simulated steps: per replica, when it decodes and how full its batch is."""

from __future__ import annotations

from pathlib import Path

STAGE_COLORS = {"reward": "tab:orange", "train": "tab:green", "sync": "tab:purple"}


def plot(results, path: str | Path, title: str = "") -> Path:
    """One row per replica: rollout activity (shade = running requests / the round's busiest),
    then the reward, train and sync stages over all rows (one_step_off's rollout under the last step's
    training); the steps end to end, each ``step_s`` long. ``results`` need their round records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if any(r.record is None or r.record.busy is None for r in results):
        raise ValueError("gantt: simulate with record=True to keep each round's activity")
    num_replicas = len(results[0].record.busy)
    fig, ax = plt.subplots(figsize=(14, 1.5 + 0.18 * num_replicas))
    offset = last_train_s = 0.0
    for r in results:
        # one_step_off (wait_s set) rolls out and scores while the last batch trains, then trains after its wait
        rolled = offset - last_train_s if r.wait_s is not None else offset
        peak = max((b for busy in r.record.busy for _, _, b in busy), default=1)
        for i, busy in enumerate(r.record.busy):
            bars = [(rolled + s, e - s) for s, e, _ in busy]
            shades = [(0.12, 0.35, 0.7, 0.15 + 0.85 * b / peak) for _, _, b in busy]
            ax.broken_barh(bars, (i - 0.4, 0.8), facecolors=shades, linewidth=0)
        trained = offset + (r.wait_s if r.wait_s is not None else r.rollout_s + r.reward_s)
        for stage, start, seconds in (("reward", rolled + r.rollout_s, r.reward_s), ("train", trained, r.train_s),
                                      ("sync", trained + r.train_s, r.sync_s)):
            ax.axvspan(start, start + seconds, color=STAGE_COLORS[stage], alpha=0.35, linewidth=0,
                       label=stage if r is results[0] else None)
        ax.axvline(offset, color="black", linewidth=0.6)
        ax.text(offset, num_replicas - 0.3, f" {r.step} {r.kind}", fontsize=7, va="bottom")
        offset, last_train_s = offset + r.step_s, r.train_s
    ax.set_xlim(0, offset)
    ax.set_ylim(-0.6, num_replicas + 0.4)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("engine replica")
    ax.set_title(title or "simulated steps (blue: decoding, darker = fuller batch)")
    ax.legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
