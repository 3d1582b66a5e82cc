"""Speculative decoding in the simulator: TorchEngine's ``engine.speculative auto`` as a cost.

A verify iteration runs ``k + 1`` tokens of each running request and emits ``1 + a + ... + a^k``
in expectation, ``a`` the acceptance rate. As the engine does, each iteration takes the ``k``
(0 included) that gives the most tokens per second. :class:`SpeculativeCost` charges each of a
replica's token-iterations the best verify step's time over its expected tokens.

Invariants:

- Speculation changes only time: lengths, preemptions and policy decisions stay as without it.
- One acceptance rate per step, from a flag or replayed from a run's ``metrics.jsonl``.

Why a rate and not drafts: what the drafts' text gives is a property of the workload, not of the
hardware. What it leaves out of the engine: ``docs/speculative.md`` (In the simulator).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollpacker.rollout.config import MAX_SPEC_TOKENS
from rollpacker.rollout.spec_cost import expected_tokens

ACCEPT_RATE = "rollout/spec_accept_rate"
DRAFT_MS = "rollout/spec_draft_ms"
"""A run's ms a draft asked of the drafter cost: like the acceptance rate, what the drafts' text makes it."""


@dataclass(kw_only=True)
class SpecSimConfig:
    enabled: bool = False
    """Simulate speculative decoding (TorchEngine's engine.speculative auto) on every replica."""
    accept_rate: float = 0.6
    """Chance a draft token is kept once every one before it was (rollout/spec_accept_rate; see docs/speculative.md)."""
    trace: str = ""
    """A run's metrics.jsonl: replay its steps' rollout/spec_accept_rate in turn instead of accept_rate."""
    max_tokens: int = 8
    """Most draft tokens per request and iteration (engine.spec_max_tokens)."""
    draft_us: float = 20.0
    """Host microseconds of drafting for one request per verify iteration."""

    def __post_init__(self) -> None:
        if not 0 <= self.accept_rate < 1:
            raise ValueError(f"speculation.accept_rate must be in [0, 1), got {self.accept_rate}")
        if not 1 <= self.max_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculation.max_tokens must be in 1..{MAX_SPEC_TOKENS}, got {self.max_tokens}")
        if self.draft_us < 0:
            raise ValueError(f"speculation.draft_us must be >= 0, got {self.draft_us}")

    def rates(self) -> list[float]:
        """The acceptance rate of each step, cycled: the trace's, or ``accept_rate``."""
        return read_accept_rates(self.trace) if self.trace else [self.accept_rate]

    def cost(self, base, rate: float, draft_s: float | None = None):
        """``base`` as replicas see it: speculative at ``rate`` when enabled (``draft_s``: the drafter's
        seconds per request, ``draft_us`` unless given)."""
        if not self.enabled:
            return base
        return SpeculativeCost(base, rate, self.max_tokens, self.draft_us * 1e-6 if draft_s is None else draft_s)


def read_accept_rates(path: str | Path) -> list[float]:
    """``rollout/spec_accept_rate`` of every line of a run's metrics that has one, in order."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"acceptance trace: no such file: {path}")
    rates = []
    for line_no, text in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
        if isinstance(record, dict) and ACCEPT_RATE in record:
            rates.append(min(float(record[ACCEPT_RATE]), 0.99))
    if not rates:
        raise ValueError(f"{path}: no line has {ACCEPT_RATE} (a run with --engine.speculative auto on TorchEngine)")
    return rates


@dataclass(frozen=True)
class SpeculativeCost:
    """A replica's cost model with speculation: each token-iteration costs the best verify step's
    time over the tokens it emits per request (see the module docstring)."""

    base: object
    """A :class:`~rollpacker.sim.cost.CostModel` or :class:`~rollpacker.sim.cost.ProfiledCost`."""
    accept_rate: float
    max_tokens: int
    draft_s: float

    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens()

    def draft_len(self, num_running: int, context: int) -> int:
        """The draft length the first iteration of ``num_running`` requests at ``context`` takes."""
        return int(np.argmin([t[0] for t in self._per_token(num_running, context, 1)]))

    def _per_token(self, num_running: int, context: int, num_iters: int) -> list[np.ndarray]:
        """Seconds per emitted token-iteration at each draft length 0 .. max_tokens."""
        out = [self.base.iteration_times(num_running, context, num_iters)]
        for k in range(1, self.max_tokens + 1):
            verify = self.base.iteration_times(num_running, context, num_iters, queries=k + 1)
            out.append((verify + num_running * self.draft_s) / expected_tokens(self.accept_rate, k))
        return out

    def iteration_times(self, num_running: int, context: int, num_iters: int, prefill_tokens: int = 0,
                        prefill_sq: int = 0) -> np.ndarray:
        """As :meth:`CostModel.iteration_times`, per token generated by every running request."""
        times = np.min(self._per_token(num_running, context, num_iters), axis=0)
        if prefill_tokens:  # the prefill is not sped up: added as the base model charges it
            times[0] += (self.base.iteration_times(num_running, context, 1, prefill_tokens, prefill_sq)[0]
                         - self.base.iteration_times(num_running, context, 1)[0])
        return times


def tail_s(busy: list[list[tuple[float, float, int]]], rollout_s: float, threshold: int = 8) -> float:
    """Seconds at the end of a round in which no replica ran more than ``threshold`` requests
    (``busy``: each replica's (start, end, running requests) runs, as :class:`RoundRecord` records them)."""
    crowded = max((end for runs in busy for _, end, running in runs if running > threshold), default=0.0)
    return max(0.0, rollout_s - crowded)
