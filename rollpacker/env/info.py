"""Episodes' step infos as metrics: what an environment counts (a ToolEnv's calls and failed calls).

Each episode sums the numbers of its environment's step infos per key
(:attr:`~rollpacker.env.episode.Episode.info`). :func:`info_metrics` turns a round's episodes
into, per key ``K``, ``PREFIX/info/K`` (its mean per episode) and ``PREFIX/info/K_frac`` (the
share of episodes where it is above 0), and the same per data source
(``PREFIX/SOURCE/info/...``) when sources are given. With ``env.tools``, every episode counts
``tool_calls`` and ``tool_errors`` from 0 (:data:`TOOL_INFO`), so the metrics are there at every step,
0 included.
"""

from __future__ import annotations

from typing import Any, Sequence

TOOL_INFO = ("tool_calls", "tool_errors")
"""The counters a :class:`~rollpacker.env.tools.ToolEnv` step reports: calls run, and calls that failed (answered
``error: ...``, or a :class:`~rollpacker.env.tools.Failed` result: the built-in python's program that raised)."""


def info_metrics(outputs: Sequence[Any], prefix: str, sources: Sequence[str | None] | None = None
                 ) -> dict[str, float]:
    """``PREFIX/info/K`` and ``PREFIX/info/K_frac`` over ``outputs`` (responses: their ``info``; none when no
    environment counted anything), and per data source (``sources``: one per output, None for a row without one)."""
    groups = {prefix: [o.info for o in outputs]}
    for source in sorted({s for s in sources or () if s is not None}, key=str):  # 2024 beside "math"
        groups[f"{prefix}{source}/"] = [o.info for o, s in zip(outputs, sources) if s == source]
    out = {}
    for where, group in groups.items():
        for key in sorted({k for info in group for k in info}):
            values = [info.get(key, 0.0) for info in group]
            out[f"{where}info/{key}"] = sum(values) / len(values)
            out[f"{where}info/{key}_frac"] = sum(v > 0 for v in values) / len(values)
    return out


def selection_metrics(groups: Sequence[Any], cut: Sequence[Any]) -> dict[str, float]:
    """What keep-first keeps, per step: over the trained groups some of whose episodes were cut, the
    kept episodes' and the cut ones' means of turns, model tokens, tool calls and environment seconds
    (``sched/kept/K``, ``sched/cut/K``; a cut episode counts up to its cut), and how many were cut
    (``sched/cut_episodes``). ``groups``: the step's; ``cut``: the round's cut responses."""
    def group(o) -> str:
        return o.id.rpartition(":")[0]  # STEP:SLOT of response id STEP:SLOT:K

    trained = {group(o) for g in groups for o in g.outputs}
    cut = [o for o in cut if group(o) in trained]
    of_cut = {group(o) for o in cut}
    kept = [o for g in groups for o in g.outputs if group(o) in of_cut]
    out = {"sched/cut_episodes": float(len(cut))}
    for name, episodes in (("kept", kept), ("cut", cut)) if cut else ():
        for key, value in (("turns", lambda o: o.num_turns), ("model_tokens", lambda o: o.num_model_tokens),
                           ("tool_calls", lambda o: o.info.get("tool_calls", 0.0)),
                           ("env_seconds", lambda o: o.env_seconds)):
            out[f"sched/{name}/{key}"] = sum(map(value, episodes)) / len(episodes)
    return out
