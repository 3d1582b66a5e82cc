"""Stream training's decisions on rank 0, as plain Python (paper §4.4, Algorithm 1).

- :class:`ScaleDownDecider` decides whether rollout moves onto the kept replicas: when to look
  (:class:`Trigger`), whether the running requests' projected KV peak fits there
  (:func:`peak_kv_tokens`), and, with ``stream.criterion throughput``, whether it pays
  (:class:`StepCost`, :func:`decode_seconds`). It lives across rounds.
- :class:`StreamRound` is one round's :class:`~rollpacker.schedule.round.RoundHooks`: it feeds
  the history, asks the decider, and says which complete groups go to the freed ranks.
- :class:`PipeRound` is RolloutPipe's: scaled down from the start, fed all round, frontier first.

Invariants: no tensors, no ranks, no clock. The job's stream trainer
(:mod:`rollpacker.train.stream`) and the simulator drive the very same classes through
:class:`~rollpacker.schedule.round.Round`. How it departs from the paper: ``docs/stream.md``.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
from dataclasses import dataclass
from typing import Callable, Literal

from rollpacker.choices import check_choices
from rollpacker.schedule.base import provisioned
from rollpacker.schedule.round import RoundHooks, RoundState, ScaledDown
from rollpacker.topology import kept_replicas

logger = logging.getLogger(__name__)

@dataclass(kw_only=True)
class StreamConfig:
    """Stream training (paper §4.4): ranks freed from rollout train on finished groups meanwhile."""

    enabled: bool = False
    """Scale rollout down to half its replicas once enough prompts are complete; the freed ranks train."""
    trigger: float = 0.0
    """0: adaptive (docs/stream.md); else scale down unconditionally at this completed fraction."""
    fetch_cap: float = 0.0
    """0: fetch every group as it completes; else fetch once, at most this fraction of the round's groups."""
    length_quantile: float = 0.9
    """KV projection: a running request ends at this quantile of past lengths longer than its own so far."""
    criterion: Literal["kv", "throughput"] = "throughput"
    """Adaptive trigger: kv (the paper's KV fit) or throughput (the KV fit, and it must pay; docs/stream.md)."""

    def __post_init__(self) -> None:
        check_choices(self, "stream")
        for name in ("trigger", "fetch_cap"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"stream.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 < self.length_quantile <= 1:
            raise ValueError(f"stream.length_quantile must be in (0, 1], got {self.length_quantile}")


MILESTONES = (4, 10)
"""Scale-down looks happen between 4/20 and 10/20 of the round's prompts complete, in steps of 1/20."""


class Trigger:
    """When rank 0 looks at a scale-down: Algorithm 1's lines 13–15 (adaptive), or once at a fixed fraction."""

    def __init__(self, fixed: float = 0.0):
        self.fixed = fixed
        self.reset()

    def reset(self) -> None:
        self.milestone = 0
        self.checked = 0
        self.fired = False

    def due(self, completed: int, total: int) -> bool:
        if total <= 0 or self.fired:
            return False
        if self.fixed:
            self.fired = completed >= provisioned(self.fixed, total)
            return self.fired
        milestone = completed * 20 // total
        if not MILESTONES[0] <= milestone <= MILESTONES[1] or completed * 20 > total * MILESTONES[1]:
            return False
        if milestone <= self.milestone or (completed - self.checked) * 20 < total:
            return False
        self.milestone, self.checked = milestone, completed
        return True


def steps_left(requests: list[tuple[int, int]], history: list[int], max_new_tokens: int,
               quantile: float = 0.9) -> list[int]:
    """Decode steps each of ``requests`` — ``(prompt tokens, tokens generated so far)`` — is projected
    to run: to the ``quantile`` of the past response lengths longer than what it has generated
    (``max_new_tokens`` when none is longer)."""
    longer = sorted(history)
    left = []
    for _, generated in requests:
        tail = longer[bisect.bisect_right(longer, generated):]
        end = tail[min(len(tail) - 1, int(quantile * len(tail)))] if tail else max_new_tokens
        left.append(max(1, min(end, max_new_tokens) - generated))
    return left


def decode_seconds(left: list[int], replicas: int, step_seconds: Callable[[float], float]) -> float:
    """Seconds until the last request finishes when requests with ``left`` decode steps each run
    spread evenly over ``replicas`` replicas, every engine step costing ``step_seconds(requests
    running on one replica)``."""
    total, done = 0.0, 0
    for i, end in enumerate(sorted(left)):
        if end > done:  # from step `done` to `end`, the requests from the i-th shortest on run
            total += (end - done) * step_seconds(math.ceil((len(left) - i) / replicas))
            done = end
    return total


class StepCost:
    """An engine step's seconds as a function of the requests running on a replica, ``a + c·b``,
    fitted by least squares to what the controller measured at its recent polls (on CPU a decode
    step grows with the batch; on GPU it barely does, until compute binds)."""

    def __init__(self, maxlen: int = 512):
        self.points: collections.deque[tuple[float, float]] = collections.deque(maxlen=maxlen)

    def observe(self, running: float, seconds: float) -> None:
        """One poll: ``seconds`` per engine step with ``running`` requests per replica."""
        if running > 0 and seconds > 0:
            self.points.append((running, seconds))

    def fit(self) -> tuple[float, float] | None:
        """``(a, c)``, or None until the polls span at least two batch sizes."""
        if len(self.points) < 4:
            return None
        n = len(self.points)
        mb = sum(b for b, _ in self.points) / n
        mt = sum(t for _, t in self.points) / n
        var = sum((b - mb) ** 2 for b, _ in self.points)
        if var <= 0:
            return None
        c = max(0.0, sum((b - mb) * (t - mt) for b, t in self.points) / var)
        return max(0.0, mt - c * mb), c


def peak_kv_tokens(requests: list[tuple[int, int]], history: list[int], max_new_tokens: int,
                   quantile: float = 0.9) -> int:
    """Projected peak of the KV tokens that ``requests`` — ``(prompt tokens, tokens generated so
    far)`` each, all running from now on — hold together until they finish.

    Each request is projected to end at the ``quantile`` of the past response lengths longer than
    what it has generated (``max_new_tokens`` when none is longer). A request holds prompt plus
    generated tokens and grows by one per step until it ends, when it frees everything.
    """
    finals = [(prompt + generated, left) for (prompt, generated), left in
              zip(requests, steps_left(requests, history, max_new_tokens, quantile))]
    # At t steps from now, the requests with more than t steps left hold sum(held) + t each.
    finals.sort(key=lambda r: -r[1])
    peak, held = 0, 0
    for count, (tokens, left) in enumerate(finals, 1):
        held += tokens
        peak = max(peak, held + count * (left - 1))  # just before the count-th longest has left steps
    return peak


class ScaleDownDecider:
    """Rank 0's scale-down decision (Algorithm 1, lines 13–17): when to look (:class:`Trigger`) and
    whether the running requests' projected KV peak fits the kept replicas. It lives across rounds
    (the length histories, what the throughput criterion learned): the stream trainer holds one,
    the simulator another."""

    def __init__(self, config: StreamConfig, *, num_replicas: int, kv_capacity_tokens: int, max_new_tokens: int,
                 refused: str = ""):
        self.config = config
        self.kv_capacity_tokens, self.max_new_tokens = kv_capacity_tokens, max_new_tokens
        """KV tokens of one replica; the longest response."""
        self.trigger = Trigger(config.trigger)
        self.histories: dict[str, collections.deque[int]] = {}
        """Per round kind: lengths of the responses finished so far, this round's included (short
        rounds cut their tail, long rounds are the tail: their lengths do not predict each other)."""
        self.history: collections.deque[int] = collections.deque()
        """The history of the current round's kind."""
        self.kept_replicas = kept_replicas(num_replicas)
        """Replicas that go on rolling out after a scale-down: the first half (the second half is freed)."""
        self.refused = refused or ("" if num_replicas >= 2 else "one rollout replica: nothing to free")
        """Why no scale-down will ever happen ("" when one may)."""
        self.num_replicas = num_replicas
        self.step_cost = StepCost()
        """Engine step seconds by running requests per replica, measured by the controller (criterion throughput)."""
        # What the throughput criterion learns from the run (see learn and pays):
        self.train_seconds = 0.0
        """The last step's training time on every rank, had nothing been streamed."""
        self.realized: dict[str, float] = {}
        """Per round kind: the training the last scale-down took off the step's end."""
        self.migration_seconds_per_token = 0.0
        """The last migration's time over the tokens it recomputed (prompt and generated)."""
        self.kind = ""
        self.last: dict[str, float] = {}
        """The last look's projections (seconds): rollout left as it is and scaled down, migration, training saved."""

    def new_round(self, kind: str) -> None:
        self.trigger.reset()
        self.kind, self.last = kind, {}
        self.history = self.histories.setdefault(kind, collections.deque(maxlen=4096))

    def consider(self, completed: int, total: int, requests: Callable[[], list[tuple[int, int]]]) -> bool:
        """Whether to scale down now, given the round's progress (``completed`` of ``total``
        prompts) and the requests still running (``requests()`` gives ``(prompt tokens, generated
        tokens)`` of each)."""
        if self.refused or not self.trigger.due(completed, total):
            return False
        if self.config.trigger:
            return True
        running = requests()
        peak = peak_kv_tokens(running, list(self.history), self.max_new_tokens, self.config.length_quantile)
        fits = peak <= self.kv_capacity_tokens * self.kept_replicas
        logger.debug("stream: %d/%d complete, projected KV peak %d tokens on %d replicas of %d: %s", completed,
                     total, peak, self.kept_replicas, self.kv_capacity_tokens, "fits" if fits else "stay")
        if not fits or self.config.criterion == "kv":
            return fits
        return self.pays(running)

    def pays(self, running: list[tuple[int, int]]) -> bool:
        """``criterion`` throughput: whether the rollout time the scale-down adds is less than the
        training it takes off the step's end. Added: the running requests' projected decode on the
        kept replicas against all of them (:func:`decode_seconds` at the measured step costs), plus
        recomputing the freed replicas' share of their tokens at the last migration's rate.
        Saved: what the freed share of the ranks trains meanwhile, at most the step's training, and
        at most what the last scale-down of this round kind really saved (groups complete late in
        a round, so the freed ranks idle at first). Without two measured batch sizes yet, it scales
        down (the KV criterion alone); a kind that has not scaled down yet has nothing realized."""
        fit = self.step_cost.fit()
        if fit is None:
            return True
        a, c = fit
        freed = (self.num_replicas - self.kept_replicas) / self.num_replicas
        left = steps_left(running, list(self.history), self.max_new_tokens, self.config.length_quantile)
        stay = decode_seconds(left, self.num_replicas, lambda b: a + c * b)
        scaled = decode_seconds(left, self.kept_replicas, lambda b: a + c * b)
        migration = self.migration_seconds_per_token * freed * sum(p + g for p, g in running)
        saved = min(self.train_seconds, scaled * freed, self.realized.get(self.kind, math.inf))
        self.last = {"stay": stay, "scaled": scaled, "migration": migration, "saved": saved}
        logger.debug("stream: rollout left %.3f s, %.3f s + %.3f s migration scaled down; training saved %.3f s",
                     stay, scaled, migration, saved)
        return scaled + migration - stay < saved

    def learn(self, kind: str, train_seconds: float, saved: float | None) -> None:
        """After a round of ``kind``: the step's training time on every rank had nothing been
        streamed, and, when it scaled down, the training the freed ranks took off the step's end."""
        self.train_seconds = train_seconds
        if saved is not None:
            self.realized[kind] = saved

    def learn_migration(self, seconds: float, tokens: int) -> None:
        if tokens:
            self.migration_seconds_per_token = seconds / tokens


class StreamRound(RoundHooks):
    """Stream training's hooks for one round: the decider hears every poll and finished length,
    says when to scale down, and the complete, scored groups go to the freed ranks from then on
    (once, capped, with ``stream.fetch_cap``)."""

    def __init__(self, decider: ScaleDownDecider):
        self.decider = decider
        self.state: RoundState | None = None
        self.kind = ""
        """The round's kind (``RoundPlan.kind``)."""
        self.fetching = False
        """Whether complete groups still go to the freed ranks."""
        self.scaled_down = False
        """Set at :meth:`finish`: the decider scaled this round down."""

    def begin(self, state: RoundState) -> bool:
        self.state, self.kind = state, state.plan.kind
        self.decider.new_round(self.kind)
        return False

    def on_poll(self, running: float, step_seconds: float) -> None:
        self.decider.step_cost.observe(running, step_seconds)

    def on_finished(self, lengths: list[int]) -> None:
        self.decider.history.extend(lengths)

    def scale_down_now(self, generated: Callable[[], list[tuple[int, int]]]) -> bool:
        """When the :class:`ScaleDownDecider` says so, given the round's progress; feeding starts."""
        state = self.state
        self.fetching = self.decider.consider(state.num_complete, state.plan.keep, generated)
        return self.fetching

    def fetch(self, ready: bool) -> float | None:
        """Feed once the freed ranks have trained the last batch; a one-shot fetch
        (``stream.fetch_cap``) happens once, when a scored group is there to take."""
        if not self.fetching or not ready:
            return None
        cap = self.decider.config.fetch_cap
        if cap and not self.state.scored_complete():
            return None  # the groups complete at the scale-down may not be scored yet
        self.fetching = not cap
        return cap

    def finish(self, scaled: ScaledDown | None, num_fed: int) -> dict[str, float]:
        """The round's ``stream/`` metrics and migration time; the decider learns the migration's rate."""
        if scaled is not None:
            self.decider.learn_migration(scaled.migration_s or 0.0, scaled.migrated_tokens)
        frac = scaled.completed_frac if scaled else None
        self.scaled_down = frac is not None
        stats = {"stream/scaled_down": float(self.scaled_down), "stream/trigger_completed_frac": frac or 0.0,
                 "time/migration": (scaled.migration_s or 0.0) if scaled else 0.0,
                 "stream/streamed_groups": float(num_fed)}
        return stats | {f"stream/projected_{k}_s": v for k, v in self.decider.last.items()}  # the last look's


class PipeRound(StreamRound):
    """RolloutPipe's hooks: the pools are fixed. Rollout runs on the kept replicas from the start,
    nothing migrates, the train pool is fed all round, and each request's priority is its slot
    (frontier-group dispatch)."""

    def begin(self, state: RoundState) -> bool:
        super().begin(state)
        self.fetching = True
        return True

    def priority(self, slot: int) -> int:
        return slot

    def fetch(self, ready: bool) -> float | None:
        return 0.0 if ready else None  # every group, all round (stream.fetch_cap is the stream trainer's)

    def scale_down_now(self, generated: Callable[[], list[tuple[int, int]]]) -> bool:
        return False
