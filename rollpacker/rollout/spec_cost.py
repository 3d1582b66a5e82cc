"""When speculation pays: the engine's measured verify-step cost and the draft length it implies.

The cost table gives a verify step's time over ``n`` running requests and ``k`` draft tokens
(``k = 0``: a plain step). Each step takes the ``k`` that maximizes expected tokens per
millisecond, at each request's own measured acceptance rate.

Invariants:

- ``k = 0`` is always a candidate: no draft where the table says it does not pay.
- Above ``max_rows`` running requests nothing is drafted.
- :class:`Realized` has the last word: where drafted steps realize fewer tokens per second than
  plain ones, ``auto`` backs off, for longer at each failure.

Why both a table and a check: the table is measured once on an idle engine, and a loaded machine
costs what the table cannot see. The rule step by step: ``docs/speculative.md`` (When it runs).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass

DECAY = 0.8
"""Weight of a request's earlier verify steps in its acceptance rate, per verify step."""
FADE = 0.95
"""The same, per step that verified nothing for it: old evidence fades, so a request is drafted for again."""


@dataclass(frozen=True)
class SpecCost:
    """Verify-step milliseconds against running requests and draft tokens per request."""

    rows: tuple[int, ...]
    """Running requests measured, increasing."""
    draft_lens: tuple[int, ...]
    """Draft tokens per request measured, increasing, from 0 (a plain decode step)."""
    ms: tuple[tuple[float, ...], ...]
    """``ms[i][j]``: one step of ``rows[i]`` requests with ``draft_lens[j]`` draft tokens each."""
    draft_ms: float = 0.0
    """The drafter's time for one request's draft."""

    def __post_init__(self) -> None:
        if not self.draft_lens or self.draft_lens[0] != 0 or len(self.ms) != len(self.rows):
            raise ValueError(f"SpecCost: draft_lens must start at 0 and ms have one row per rows entry, got {self}")

    @classmethod
    def smoothed(cls, rows: tuple[int, ...], draft_lens: tuple[int, ...], ms: list[list[float]],
                 draft_ms: float = 0.0) -> SpecCost:
        """A table made non-decreasing in the draft length (a longer draft never measures as cheaper)."""
        table = [list(r) for r in ms]
        for r in table:
            for j in range(1, len(r)):
                r[j] = max(r[j], r[j - 1])
        return cls(tuple(rows), tuple(draft_lens), tuple(tuple(r) for r in table), draft_ms)

    def step_ms(self, n: int, k: int) -> float:
        """Interpolated time of a step of ``n`` requests with ``k`` draft tokens each."""
        return _interpolate(self.rows, n, [_interpolate(self.draft_lens, k, r) for r in self.ms])

    def plain_ms(self, n: int) -> float:
        """The time of a plain step of ``n`` requests, in proportion to ``n`` beyond the largest measured."""
        return self.step_ms(n, 0) * max(1.0, n / self.rows[-1])

    @property
    def max_rows(self) -> int:
        """The most running requests at which some draft, always accepted, pays its step and drafting (0: never)."""
        paying = [n for n, r in zip(self.rows, self.ms)
                  if any(t + n * self.draft_ms < (k + 1) * r[0] for k, t in zip(self.draft_lens[1:], r[1:]))]
        return max(paying, default=0)

    def worth_drafting(self, num_running: int, acceptance: list[float], k_max: int) -> bool:
        """Whether ``k_max``-token drafts for every running request, accepted at these rates, would
        pay for their drafting and their verify step at the best draft length."""
        n = num_running
        plain = n / self.step_ms(n, 0)
        return any(sum(expected_tokens(a, k) for a in acceptance) / (self.step_ms(n, k) + n * self.draft_ms) > plain
                   for k in range(1, k_max + 1))

    def draft_len(self, num_running: int, drafts: list[tuple[int, float]], k_max: int) -> int:
        """The draft tokens per request that maximize expected tokens per millisecond this step.

        ``drafts``: ``(draft length, acceptance rate)`` of the requests that have a draft; the other
        running requests emit one token whatever ``k`` is."""
        best_k, best = 0, num_running / self.step_ms(num_running, 0)
        for k in range(1, k_max + 1):
            tokens = num_running - len(drafts) + sum(expected_tokens(a, min(k, n)) for n, a in drafts)
            rate = tokens / self.step_ms(num_running, k)
            if rate > best:
                best_k, best = k, rate
        return best_k


def _interpolate(xs: tuple[int, ...], x: float, values) -> float:
    """Piecewise-linear ``values`` at ``x``, held constant beyond the ends of ``xs``."""
    if x <= xs[0]:
        return values[0]
    if x >= xs[-1]:
        return values[-1]
    i = bisect_right(xs, x) - 1
    return values[i] + (x - xs[i]) / (xs[i + 1] - xs[i]) * (values[i + 1] - values[i])


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one request emits from a ``k``-token draft: ``1 + a + ... + a^k``."""
    return sum(acceptance**i for i in range(k + 1))


@dataclass
class Acceptance:
    """One request's decayed draft hits and trials."""

    hits: float = 0.0
    trials: float = 0.0

    @property
    def rate(self) -> float:
        return (self.hits + 1) / (self.trials + 2)

    def update(self, drafted: int, accepted: int) -> None:
        """After a verify step in which ``accepted`` of ``drafted`` draft tokens were kept."""
        self.hits = DECAY * self.hits + accepted
        self.trials = DECAY * self.trials + accepted + (accepted < drafted)

    def fade(self) -> None:
        """After a step that verified no draft for this request."""
        self.hits *= FADE
        self.trials *= FADE


WINDOW = 8
"""Drafted decode steps ``auto`` times together before it compares them with its plain steps."""
BACKOFF = 32
"""Decode steps ``auto`` drafts nothing after drafting did not pay; doubled each time it fails again, up to 32x."""
PROBE = WINDOW
"""While drafting pays, one plain step before every this many drafted steps keeps the plain rate that of the batch
sizes and machine load of now."""
RATE_DECAY = 0.7
"""Weight of earlier plain steps in ``auto``'s plain rate, per plain step (the machine's load moves)."""


class Realized:
    """``auto``'s measured payoff: whether the next decode step may draft, from the tokens per second
    its drafted and plain decode steps realized.

    A step's tokens are normalized by the cost table's plain step at its batch size (``tokens *
    plain_ms(n) / n``: a plain step counts its table time), so steps of different batch sizes
    compare by how much faster or slower than the table's plain steps they ran. Drafting starts once
    a plain step was timed; after ``WINDOW`` drafted steps it compares their rate with the plain
    steps' (decayed) rate and, if lower, drafts nothing for ``BACKOFF * 2^failures`` steps. While
    drafting pays, one plain step before every ``PROBE`` drafted ones keeps the plain rate current.
    Every rank of a TP group measures its own steps; the comparison's outcome is TP rank 0's (``agree``),
    so the ranks draft at the same steps."""

    def __init__(self, agree: Callable[[bool], bool] | None = None) -> None:
        """``agree``: the decision every rank of a TP group takes (TP rank 0's), given this rank's."""
        self.agree = agree
        self.plain = [0.0, 0.0]
        """[normalized tokens, seconds] of plain steps, decayed by RATE_DECAY per plain step."""
        self.window = [0.0, 0.0]
        """[normalized tokens, seconds] of the drafted steps since the last comparison."""
        self.window_steps = self.drafted_since_plain = self.failures = 0
        self.num_steps = 0
        self.hold_until = 0
        """The decode step before which nothing is drafted."""
        self.num_backoffs = 0
        """Times drafting was found not to pay (each starts a back-off)."""

    def allows(self) -> bool:
        """Whether the next decode step may draft."""
        return self.plain[1] > 0 and self.num_steps >= self.hold_until and self.drafted_since_plain < PROBE

    def record(self, n: int, drafted: bool, tokens: int, seconds: float, plain_ms: float) -> None:
        """After a decode step of ``n`` running requests that emitted ``tokens`` in ``seconds`` (``drafted``:
        it asked the drafter, whatever came of it); ``plain_ms``: the cost table's plain step at ``n``
        (:meth:`SpecCost.plain_ms`)."""
        self.num_steps += 1
        work = tokens * plain_ms / n
        if not drafted:
            self.plain = [RATE_DECAY * self.plain[0] + work, RATE_DECAY * self.plain[1] + seconds]
            self.drafted_since_plain = 0
            return
        self.drafted_since_plain += 1
        self.window = [self.window[0] + work, self.window[1] + seconds]
        self.window_steps += 1
        if self.window_steps < WINDOW:
            return
        paid = self.window[0] * self.plain[1] > self.plain[0] * self.window[1]  # drafted rate > plain rate
        if self.agree is not None:
            paid = self.agree(paid)
        self.window, self.window_steps = [0.0, 0.0], 0
        if paid:
            self.failures = 0
            return
        self.hold_until = self.num_steps + BACKOFF * 2 ** min(self.failures, 5)
        self.failures += 1
        self.num_backoffs += 1
