"""The parallelism planner: which rollout TP each step runs at (paper §4.2).

:func:`best_tp` picks the first TP from the profile. After every step, the online heuristic
doubles TP on a jump in preemptions and halves it after quiet steps. The profile guard vetoes a
change the profile estimates slower.

Invariants:

- A TP divides the world size and the model's KV heads, and never crosses a node.
- Short, long and sync rounds keep their own TP and history (``plan.per_kind``).
- Every change comes with a sentence of the numbers that triggered it, which the run logs.
- Pure logic: no torch, no processes.

Why: KV pressure changes from step to step and by round kind. A larger TP relieves it at a cost
in communication. The thresholds, and what is ours and not the paper's: ``docs/planner.md``.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rollpacker.errors import UserError
from rollpacker.plan.config import PlanConfig


def candidate_tps(world: int, num_kv_heads: int, max_tp: int, node: int = 0) -> list[int]:
    """The TP sizes a world of ``world`` ranks can run: divisors of the world and of the KV heads, up to ``max_tp``;
    with ``node`` (ranks per node), divisors of it too, so that no replica spans two nodes."""
    return [t for t in range(1, min(world, max_tp) + 1)
            if world % t == 0 and num_kv_heads % t == 0 and (not node or node % t == 0)]


def usable_tps(world: int, num_kv_heads: int, plan: PlanConfig) -> list[int]:
    """The job's :func:`candidate_tps` within one node (torchrun's LOCAL_WORLD_SIZE), up to ``plan.max_tp``."""
    node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return candidate_tps(world, num_kv_heads, plan.max_tp or node, node=node)


@dataclass
class _Kind:
    tp: int
    history: list[int] = field(default_factory=list)
    """Preemptions of the last steps of this kind."""
    quiet: int = 0
    """Consecutive steps without preemption."""


class Planner:
    def __init__(self, config: PlanConfig, candidates: list[int], initial: int, *, profile: dict | None = None,
                 world: int = 0, prompt_len: int = 0, max_num_seqs: int = 0):
        if initial not in candidates:
            raise UserError(f"plan: initial TP {initial} (plan.initial_tp) is not one of the TPs usable here, "
                            f"{candidates} (divisors of the world and of the model's KV heads, within a node and "
                            "plan.max_tp, whose KV cache holds the longest request): set plan.initial_tp to one of "
                            "them, or 0 to start at the profile's best")
        self.config, self.candidates, self.initial = config, candidates, initial
        self.kinds: dict[str, _Kind] = {}
        self.start: _Kind | None = None
        """The state each kind's first round starts from, where a resume gave one for every kind (else ``initial``)."""
        self.profile, self.world, self.prompt_len, self.max_num_seqs = profile, world, prompt_len, max_num_seqs
        """The profile the planner estimates rounds from (None: no estimates), and with it the world size, the
        data's mean prompt length and ``engine.max_num_seqs``."""

    def observe_round(self, kind: str, preemptions: int, num_requests: int, mean_length: int) -> str | None:
        """:meth:`observe`, with the profile's estimate of the same round (its requests, the data's
        prompt length, its mean response length) at each TP."""
        profile = self.profile
        estimate = None if profile is None else lambda tp: round_seconds(
            profile["tp"][str(tp)], self.world, tp, num_requests, self.prompt_len, mean_length,
            max_num_seqs=self.max_num_seqs)
        return self.observe(kind, preemptions, estimate)

    def _state(self, kind: str) -> _Kind:
        key = kind if self.config.per_kind else "all"
        if key not in self.kinds:  # a kind's first round: from the start, or the state a resume gave every kind
            self.kinds[key] = _Kind(**asdict(self.start)) if self.start else _Kind(self.initial)
        return self.kinds[key]

    def tp_for(self, kind: str) -> int:
        """The TP for the next round of ``kind``."""
        return self._state(kind).tp

    def observe(self, kind: str, preemptions: int, estimate: Callable[[int], float] | None = None) -> str | None:
        """Take a finished round's preemption count; returns why the TP of ``kind`` rounds changes (or
        why the change was vetoed), or None. ``estimate(tp)``, the profile's seconds for the round at
        ``tp``, vetoes a change it says is slower (``plan.profile_guard``)."""
        c, s = self.config, self._state(kind)
        level = statistics.mean(s.history) if s.history else 0.0
        new, why = s.tp, ""
        if preemptions > c.raise_factor * level:
            s.quiet = 0
            new = next((t for t in self.candidates if t >= 2 * s.tp), s.tp)
            why = f"{preemptions} preemptions > {c.raise_factor} x recent level {level:.1f}"
        elif preemptions == 0:
            s.quiet += 1
            if s.quiet >= c.quiet_steps:
                s.quiet = 0
                new = max((t for t in self.candidates if t <= s.tp // 2), default=s.tp)
                why = f"{c.quiet_steps} consecutive {kind} rounds without preemption"
        else:
            s.quiet = 0
        s.history = [*s.history, preemptions][-c.recent_steps:]
        if new == s.tp:
            return None
        if estimate is not None and c.profile_guard and estimate(new) > estimate(s.tp):
            return (f"{kind} rounds: rollout TP stays {s.tp} ({why}): the profile estimates the round at "
                    f"{estimate(new):.3g} s at TP {new} against {estimate(s.tp):.3g} s")
        old, s.tp = s.tp, new
        return f"{kind} rounds: rollout TP {old} -> {new}: {why}"

    def state_dict(self) -> dict[str, Any]:
        return {"kinds": {k: asdict(v) for k, v in self.kinds.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """The checkpoint's state, under this run's settings: with ``plan.per_kind`` changed, the kinds' states become
        one (the largest TP's) or each kind starts from the one; a TP no longer usable (``plan.max_tp`` lowered)
        becomes the largest usable below it. What it changed, a sentence each, and the TP each kind resumes at."""
        saved, notes = {k: _Kind(**v) for k, v in state["kinds"].items()}, []
        if not self.config.per_kind and set(saved) - {"all"}:
            kind, one = max(saved.items(), key=lambda item: item[1].tp)
            each = ", ".join(f"{k} {s.tp}" for k, s in saved.items())
            notes.append(f"plan: the checkpoint kept a TP per round kind ({each}); plan.per_kind is off: every round "
                         f"resumes at {kind}'s")
            saved = {"all": one}
        elif self.config.per_kind and "all" in saved:
            notes.append(f"plan: the checkpoint kept one TP for every round ({saved['all'].tp}); plan.per_kind is on: "
                         "each kind resumes from it")
            self.start, saved = saved["all"], {}
        resumed = [*saved.items(), *([("every", self.start)] if self.start else [])]
        for k, s in resumed:
            if s.tp not in self.candidates:
                tp = max((t for t in self.candidates if t <= s.tp), default=self.candidates[0])
                notes.append(f"plan: the checkpoint's TP {s.tp} for {k} rounds is not usable here (usable: "
                             f"{self.candidates}): they resume at TP {tp}")
                s.tp = tp
        self.kinds = saved
        return [*notes, "plan: resumed at TP " + ", ".join(f"{s.tp} for {k} rounds" for k, s in resumed)]


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through sorted points, extended linearly past both ends; past the last, never
    below it (a noisy profile's falling last segment priced a larger batch's step at 0 ms)."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(1, sum(v <= x for v in xs)), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return max(y, ys[-1]) if x > xs[-1] else y


def decode_ms(entry: dict, batch: float, context: float) -> float:
    """A profiled TP's decode step time at ``batch`` running requests of ``context`` tokens (interpolated)."""
    points = entry["decode_ms"]  # {context: {batch: ms}}, as written by rollpacker.profile
    contexts = sorted(int(c) for c in points)
    per_context = []
    for c in contexts:
        batches = sorted(int(b) for b in points[str(c)])
        per_context.append(_interp(batches, [points[str(c)][str(b)] for b in batches], batch))
    return _interp(contexts, per_context, context)


def round_seconds(entry: dict, world: int, tp: int, num_requests: int, prompt_len: int, new_tokens: int, *,
                  max_num_seqs: int) -> float:
    """Estimated rollout time of ``num_requests`` requests of ``prompt_len + new_tokens`` tokens at ``tp``: in
    waves of as many as a replica's KV cache holds, ``max_num_seqs`` at most (``engine.max_num_seqs``)."""
    per_replica = math.ceil(num_requests / (world // tp))
    fits = max(1, min(entry["kv_capacity_tokens"] // (prompt_len + new_tokens), max_num_seqs))
    batch = min(per_replica, fits)
    waves = math.ceil(per_replica / batch)
    return waves * new_tokens * decode_ms(entry, batch, prompt_len + new_tokens / 2) / 1e3


def best_tp(profile: dict, candidates: list[int], num_requests: int, prompt_len: int,
            new_tokens: int, *, max_num_seqs: int) -> tuple[int, dict[int, float]]:
    """The profiled TP with the shortest estimated round without tail batching, and every estimate."""
    world = profile["key"]["world"]
    estimates = {t: round_seconds(profile["tp"][str(t)], world, t, num_requests, prompt_len, new_tokens,
                                  max_num_seqs=max_num_seqs)
                 for t in candidates if str(t) in profile["tp"]}
    if not estimates:
        raise ValueError(f"plan: the profile has none of the usable TPs {candidates} (it has {sorted(profile['tp'])})")
    return min(estimates, key=lambda t: (estimates[t], t)), estimates
