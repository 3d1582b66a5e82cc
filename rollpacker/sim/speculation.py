"""Speculative decoding in the simulator: TorchEngine's ``engine.speculative auto`` as a cost.

A verify iteration runs ``k + 1`` tokens of each running request. A request with a draft of ``m``
tokens emits ``1 + a + ... + a^m`` in expectation, ``a`` the acceptance rate, ``m`` the smaller of
``k`` and what the drafter's match holds; one without a draft (no match) emits one. As the engine
does, each iteration takes the ``k`` (0 included) that gives the most tokens per second.
:class:`SpeculativeCost` charges each of a replica's token-iterations the best verify step's time
over its expected tokens.

Invariants:

- Speculation changes only time: lengths, preemptions and policy decisions stay as without it.
- One :class:`Drafts` per step (acceptance rate, share of requests drafted for, draft length), from
  flags or replayed from a run's ``metrics.jsonl``.

Why figures and not drafts: what the drafts' text gives is a property of the workload, not of the
hardware. What it leaves out of the engine: ``docs/speculative.md`` (In the simulator).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rollpacker.rollout.config import MAX_SPEC_TOKENS

ACCEPT_RATE = "rollout/spec_accept_rate"
DRAFTED = "rollout/spec_drafted_frac"
"""A run's share of verified rows that had a draft (TorchEngine's; the others emit one token each)."""
DRAFT_LEN = "rollout/spec_draft_len"
"""A run's draft tokens verified per row that had a draft."""
DRAFT_MS = "rollout/spec_draft_ms"
"""A run's ms a draft asked of the drafter cost: like the acceptance rate, what the drafts' text makes it."""


@dataclass(kw_only=True)
class SpecSimConfig:
    enabled: bool = False
    """Simulate speculative decoding (TorchEngine's engine.speculative auto) on every replica."""
    accept_rate: float = 0.6
    """Chance a draft token is kept once every one before it was (rollout/spec_accept_rate; see docs/speculative.md)."""
    drafted: float = 0.93
    """Share of the running requests a verify iteration has a draft for (rollout/spec_drafted_frac; sim validate's
    tail+spec runs measured 0.91-0.94); the rest emit one token each."""
    draft_len: float = 3.3
    """Mean tokens a draft holds (rollout/spec_draft_len; those runs: 2.2-3.5): the drafter's matches run out
    (0: max_tokens, always)."""
    trace: str = ""
    """A run's metrics.jsonl: replay its steps' rollout/spec_accept_rate, spec_drafted_frac and spec_draft_len
    (where a line has them: else the flags') in turn."""
    max_tokens: int = 8
    """Most draft tokens per request and iteration (engine.spec_max_tokens)."""
    draft_us: float = 20.0
    """Host microseconds of drafting for one request per verify iteration."""

    def __post_init__(self) -> None:
        if not 0 <= self.accept_rate < 1:
            raise ValueError(f"speculation.accept_rate must be in [0, 1), got {self.accept_rate}")
        if not 0 <= self.drafted <= 1:
            raise ValueError(f"speculation.drafted must be in [0, 1], got {self.drafted}")
        if self.draft_len < 0:
            raise ValueError(f"speculation.draft_len must be >= 0 (0: max_tokens), got {self.draft_len}")
        if not 1 <= self.max_tokens <= MAX_SPEC_TOKENS:
            raise ValueError(f"speculation.max_tokens must be in 1..{MAX_SPEC_TOKENS}, got {self.max_tokens}")
        if self.draft_us < 0:
            raise ValueError(f"speculation.draft_us must be >= 0, got {self.draft_us}")

    def drafts(self) -> list[Drafts]:
        """The drafts of each step, cycled: the trace's, or the flags'."""
        flags = Drafts(self.accept_rate, self.drafted, self.draft_len or math.inf)
        return read_drafts(self.trace, flags) if self.trace else [flags]

    def cost(self, base, drafts: Drafts, draft_s: float | None = None):
        """``base`` as replicas see it: speculative, with ``drafts``, when enabled (``draft_s``: the
        drafter's seconds per request, ``draft_us`` unless given)."""
        if not self.enabled:
            return base
        return SpeculativeCost(base, drafts, self.max_tokens, self.draft_us * 1e-6 if draft_s is None else draft_s)


@dataclass(frozen=True)
class Drafts:
    """What a step's drafts give, as a run measured them (or flags say)."""

    accept_rate: float
    """Chance a draft token is kept once every one before it was."""
    drafted: float = 1.0
    """Share of the running requests with a draft."""
    length: float = math.inf
    """Mean tokens in a draft: a verify step of ``k`` draft tokens verifies ``min(k, length)`` of a request's."""

    @classmethod
    def measured(cls, record: dict, default: Drafts) -> Drafts:
        """A step's drafts from its metrics ``record`` (a step that verified nothing: none accepted); what the
        record lacks (a run from before it was measured) from ``default``."""
        return cls(min(float(record.get(ACCEPT_RATE, 0.0)), 0.99),  # a rate of 1 would make a draft's tokens endless
                   float(record.get(DRAFTED, default.drafted)), float(record.get(DRAFT_LEN, default.length)))

    def tokens(self, k: int) -> float:
        """Tokens a running request emits on average in a verify step of ``k`` draft tokens."""
        m, a = min(k, self.length), self.accept_rate
        return 1 + self.drafted * ((1 - a ** (m + 1)) / (1 - a) - 1)  # 1 + a + ... + a^m for a fractional m too


def read_drafts(path: str | Path, default: Drafts) -> list[Drafts]:
    """The :class:`Drafts` of every line of a run's metrics that has ``rollout/spec_accept_rate``, in order
    (``default``: what a line lacks)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"acceptance trace: no such file: {path}")
    steps = []
    for line_no, text in enumerate(path.read_text().splitlines(), start=1):
        try:
            record = json.loads(text) if text.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
        if isinstance(record, dict) and ACCEPT_RATE in record:
            steps.append(Drafts.measured(record, default))
    if not steps:
        raise ValueError(f"{path}: no line has {ACCEPT_RATE} (a run with --engine.speculative auto on TorchEngine)")
    return steps


@dataclass(frozen=True)
class SpeculativeCost:
    """A replica's cost model with speculation: each token-iteration costs the best verify step's
    time over the tokens it emits per request, on average over the requests with a draft and those
    without (see the module docstring)."""

    base: object
    """A :class:`~rollpacker.sim.cost.CostModel` or :class:`~rollpacker.sim.cost.ProfiledCost`."""
    drafts: Drafts
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
            out.append((verify + num_running * self.draft_s) / self.drafts.tokens(k))
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
