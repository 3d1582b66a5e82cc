"""Agentic workloads: how many turns an episode takes and how long its environment keeps it waiting.

A :class:`Workload` draws, deterministically from a key, an episode's model turns, each environment
step's seconds and its reset's (a cold start). :data:`WORKLOADS` names the shapes ``bench episodes``
runs (``--workload``):

- ``agentic`` (the default): shaped like coding agents' tool calls (TraceLab: 432k calls, median 0.3 s,
  p90 13.6 s, p99 3.6 min; turns per request p50 2, p90 21, p99 87) under an RL harness's caps.
  Turns are Pareto(α 1.0) per prompt times a lognormal(σ 0.5) per episode, capped at 32; step
  latency is lognormal with σ 2.5 split into a per-prompt factor (σ 1.0: a repository's test suite
  is slow for every episode of its task) and per-call noise (σ 2.3), cut at a timeout of 400 medians
  (0.3 s against a 120 s action cap); a reset is a cold start of median 10 step medians (σ 1.0).
  The median is set so that the mean step is about 1.4 times the toy model's mean decode per turn,
  TraceLab's ratio of tool to generation time.
- ``light``: the shape ``bench episodes`` ran before: Pareto(α 1.2) turns capped at 8 (one more
  for half the episodes), lognormal(mean 0.3 s, σ 1.0) steps, no prompt factor, no cold start.
- ``trace:PATH``: recorded episodes replayed (:func:`trace_workload`).

Invariant: every draw is a function of its key (row, episode, step), so every policy meets the
same environment. Sources and measured shapes: ``docs/benchmarks.md`` (episodes).
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Workload:
    """The shape of an agentic workload (the module docstring)."""

    turn_alpha: float
    """Pareto tail index of a prompt's turns (P(turns >= k) = k^-alpha; smaller: heavier)."""
    max_turns: int
    """Model turns per episode at most."""
    turn_sigma: float = 0.0
    """Lognormal sigma of an episode's factor on its prompt's turns (0: none)."""
    extra_turn: float = 0.0
    """Chance of one more turn per episode."""
    median_s: float = 0.0
    """Median seconds of an environment step."""
    prompt_sigma: float = 0.0
    """Lognormal sigma of a prompt's latency factor (shared by its episodes)."""
    call_sigma: float = 1.0
    """Lognormal sigma of each step's own latency factor."""
    timeout: float = 0.0
    """A step's seconds at most, in medians (0: no timeout)."""
    cold_start: float = 0.0
    """Median seconds of a reset, in step medians (0: resets are free)."""
    cold_sigma: float = 1.0
    """Lognormal sigma of a reset's seconds."""

    def __post_init__(self) -> None:
        if self.turn_alpha <= 0 or self.max_turns < 1 or not 0 <= self.extra_turn <= 1:
            raise ValueError(f"workload: turn_alpha={self.turn_alpha} must be > 0, max_turns={self.max_turns} >= 1, "
                             f"extra_turn={self.extra_turn} in [0, 1]")
        if min(self.turn_sigma, self.median_s, self.prompt_sigma, self.call_sigma, self.timeout, self.cold_start,
               self.cold_sigma) < 0:
            raise ValueError(f"workload: {self}: seconds, sigmas and multiples must be >= 0")

    @property
    def sigma(self) -> float:
        """The step latency's sigma over all prompts and calls."""
        return math.hypot(self.prompt_sigma, self.call_sigma)

    def with_sigma(self, sigma: float) -> Workload:
        """The same workload with its step latency's sigma ``sigma``: the prompt factor kept (up to
        ``sigma``), the per-call noise making up the rest; the median moved so the mean step stays."""
        prompt = min(self.prompt_sigma, sigma)
        call = math.sqrt(max(0.0, sigma ** 2 - prompt ** 2))
        return replace(self, prompt_sigma=prompt, call_sigma=call).with_mean(self.mean_step())

    def with_mean(self, seconds: float) -> Workload:
        """The same shape with its mean step ``seconds`` (the median, and so the timeout and cold starts, scaled)."""
        return replace(self, median_s=self.median_s * seconds / self.mean_step()) if self.median_s else self

    def mean_step(self) -> float:
        """The mean seconds of a step: the lognormal's, less what the timeout cuts off."""
        m, s = self.median_s, self.sigma
        if not (self.timeout and s):
            return m * math.exp(s * s / 2) if s else m * min(1.0, self.timeout or 1.0)
        cut = math.log(self.timeout) / s
        below = (lambda x: 0.5 * math.erfc(-x / math.sqrt(2)))  # the standard normal's cdf
        return m * (math.exp(s * s / 2) * below(cut - s) + self.timeout * (1 - below(cut)))

    def turns(self, row: str, episode: str) -> int:
        """Model turns of episode ``episode`` (its first action) of row ``row``."""
        base = random.Random(f"turns/{row}").paretovariate(self.turn_alpha)
        rng = random.Random(f"turns/{row}/{episode}")
        factor = rng.lognormvariate(0.0, self.turn_sigma) if self.turn_sigma else 1.0
        extra = rng.random() < self.extra_turn
        turns = math.ceil(base * factor) if self.turn_sigma else int(base)
        return min(self.max_turns, max(1, turns) + extra)

    def step_seconds(self, row: str, episode: str, step: int, action: str) -> float:
        """Seconds of step ``step`` (1-based, answering ``action``) of that episode."""
        if not self.median_s:
            return 0.0
        prompt = random.Random(f"latency/{row}").lognormvariate(0.0, self.prompt_sigma) if self.prompt_sigma else 1.0
        call = random.Random(f"{row}/{episode}/{step}/{action}").lognormvariate(0.0, self.call_sigma)
        seconds = self.median_s * prompt * call
        return min(seconds, self.median_s * self.timeout) if self.timeout else seconds

    def reset_seconds(self, row: str) -> float:
        """Seconds of a reset of row ``row``'s environment (a cold start: its task's image)."""
        if not (self.cold_start and self.median_s):
            return 0.0
        return self.median_s * self.cold_start * random.Random(f"reset/{row}").lognormvariate(0.0, self.cold_sigma)


AGENTIC_MEDIAN_S = 0.004
"""``agentic``'s median step: its mean step (0.056 s with the timeout) about 1.4 times the toy model's decode
per turn in ``bench episodes``, 0.03-0.05 s (docs/results.md)."""

WORKLOADS = {
    "agentic": Workload(turn_alpha=1.0, max_turns=32, turn_sigma=0.5, median_s=AGENTIC_MEDIAN_S, prompt_sigma=1.0,
                        call_sigma=2.3, timeout=400.0, cold_start=10.0),
    "light": Workload(turn_alpha=1.2, max_turns=8, extra_turn=0.5, median_s=0.3 * math.exp(-0.5), call_sigma=1.0),
}


@dataclass(frozen=True)
class TraceWorkload:
    """Recorded episodes replayed (:func:`trace_workload`): a row replays one prompt's episodes, an episode
    one of them (chosen by its key); each step takes its recorded seconds."""

    prompts: tuple[tuple[tuple[tuple[float, ...], float], ...], ...]
    """Per prompt: its episodes, each (seconds of every step, seconds of its reset)."""

    @property
    def max_turns(self) -> int:
        return max(len(steps) for episodes in self.prompts for steps, _ in episodes)

    def _episode(self, row: str, episode: str) -> tuple[tuple[float, ...], float]:
        episodes = self.prompts[zlib.crc32(f"prompt/{row}".encode()) % len(self.prompts)]
        return episodes[zlib.crc32(f"episode/{row}/{episode}".encode()) % len(episodes)]

    def turns(self, row: str, episode: str) -> int:
        return len(self._episode(row, episode)[0])

    def step_seconds(self, row: str, episode: str, step: int, action: str) -> float:
        steps = self._episode(row, episode)[0]
        return steps[min(step, len(steps)) - 1]

    def reset_seconds(self, row: str) -> float:
        return self._episode(row, "")[1]

    def mean_step(self) -> float:
        """The mean seconds of a recorded step."""
        steps = [s for episodes in self.prompts for steps, _ in episodes for s in steps]
        return sum(steps) / len(steps)


def trace_workload(path: str) -> TraceWorkload:
    """``PATH``: JSON lines, one recorded episode each: ``{"steps": [seconds of each environment step],
    "reset": seconds (optional), "prompt": its task (optional; episodes of one prompt are replayed together)}``;
    a bad file: ValueError saying the fix."""
    file, fix = Path(path), 'one JSON object a line: {"steps": [0.4, 12.0], "reset": 2.0, "prompt": "repo-1"}'
    if not file.is_file():
        raise ValueError(f"--workload trace:{path}: no file there ({fix})")
    prompts: dict[str, list] = {}
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record["steps"], list):  # a string's characters read as steps
                raise TypeError
            steps, reset = tuple(float(s) for s in record["steps"]), float(record.get("reset", 0.0))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"--workload trace:{path}, line {n}: {fix}") from None
        if not steps or not all(0 <= s < math.inf for s in (*steps, reset)):  # NaN and inf hung the simulation
            raise ValueError(f"--workload trace:{path}, line {n}: an episode needs one step at least, seconds finite "
                             "and >= 0")
        prompts.setdefault(str(record.get("prompt", n)), []).append((steps, reset))
    if not prompts:
        raise ValueError(f"--workload trace:{path}: the file is empty ({fix})")
    return TraceWorkload(tuple(tuple(episodes) for episodes in prompts.values()))


def workload(spec: str) -> Workload | TraceWorkload:
    """``agentic``, ``light`` or ``trace:PATH`` -> the workload; anything else: ValueError saying the fix."""
    if spec.startswith("trace:"):
        return trace_workload(spec.removeprefix("trace:"))
    if spec not in WORKLOADS:
        raise ValueError(f"--workload {spec!r}: write {', '.join(WORKLOADS)} or trace:PATH (JSON lines of episodes)")
    return WORKLOADS[spec]
