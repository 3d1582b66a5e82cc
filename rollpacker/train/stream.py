"""Stream training (paper §4.4, Algorithm 1): ranks freed from rollout train while it goes on.

During a round, the controller (rank 0) watches the fraction of the round's prompts that are
complete. At each 5% milestone from 20% to 50% (with at least 5% new completions since the last
look) it considers scaling rollout down to the first half of its replicas:

- **Which ranks**: the second half of the rollout replicas, whole replicas only. The freed ranks
  must also be whole FSDP shard groups of the trainer, or they could not compute gradients on
  their own; when the meshes do not allow that, no scale-down is ever attempted (the reason is
  logged once and :attr:`StreamTrainer.refused` says why).
- **When**: only if the remaining requests' projected KV peak fits the remaining replicas'
  caches (:func:`peak_kv_tokens`, from the lengths of the responses finished so far in rounds of
  the same kind).
  ``stream.trigger`` instead scales down unconditionally at a fixed fraction. At most once per
  round. ``stream.criterion throughput`` (ours, not the paper's) also asks whether it pays: the
  rollout time that consolidating the running requests on the kept replicas adds, projected from
  the engine step times the controller measured at its polls (:class:`StepCost`, a + c·batch) and
  the same length projection, must be less than the training the freed ranks take off the step's
  end. The paper's GPUs decode memory-bound, where a step barely grows with the batch and the KV
  fit is the binding limit; on CPU cores a step grows with the batch and the KV fit alone scales
  down into a slower round. This decision is :class:`ScaleDown`, plain Python.
- **Migration**: the freed replicas' requests are aborted and resumed on the others by
  recomputation (the engine contract's partial outputs).
- **Streaming**: the freed ranks release their KV cache and fetch the complete, scored groups
  from rank 0 as they arrive: whenever they have trained the last batch, rank 0 sends every group
  completed since (or once, capped, with ``stream.fetch_cap``), over point-to-point sends that
  never block the controller. They compute gradients with no gradient sync and no
  optimizer step (:meth:`Trainer.accumulate`).
- **Finish**: when rollout ends, the groups not fetched yet are spread over every rank, and one
  :meth:`Trainer.step` reduces all gradients and divides them by the step's global count: the
  update equals the synchronous one.

Stream training needs each group's advantages when the group completes, so batch-level
advantage normalization is rejected (``Config`` says why).

A round meets stream training through its hooks (:class:`~rollpacker.schedule.round.RoundHooks`):
:meth:`StreamTrainer.begin_round` gives rank 0 a :class:`StreamRound` (a :class:`PipeRound` with
RolloutPipe). It decides the scale-down, times the migration and feeds the freed ranks. The
controller's exchange and the simulator (``rollpacker.sim``) drive the same class; the simulator
on simulated time.

**RolloutPipe** (``schedule.pipe``, ``pipe=True`` here) is the same machinery with the pools fixed
for the whole run: the ranks a scale-down would free are the train pool, which never rolls out
(their engines stay released) and serves from every round's start; there is no scale-down
decision and no migration (the controller routes requests to the rollout pool only), and the
same pull protocol feeds each complete, scored group FIFO as soon as the train pool is free.
How it differs from the paper (which has no public code):

- groups that complete while the train pool is busy wait at rank 0, in completion order, and go
  as one batch when it is free; those not taken when rollout ends are trained by every rank in
  the step's final :meth:`Trainer.step` rather than by the train pool alone;
- the rollout pool joins that final step (its gradient all-reduce and optimizer step): FSDP2/HSDP
  needs every rank, and it keeps one copy of the weights, pushed in-process to the engines, with
  no trainer-to-rollout transfer. So the train pool must be whole training replicas
  (``train.train_shard_size`` dividing its first rank), or the run is refused at start;
- frontier-group dispatch is the engines' admission order (``Request.priority`` = the group's
  slot); an engine with room for the whole round admits everything at once and it changes nothing.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import pickle
import time
from typing import Any, Callable, Protocol

from rollpacker.schedule.base import Group
from rollpacker.schedule.round import RoundHooks, RoundState, kept_replicas
from rollpacker.train.config import StreamConfig

logger = logging.getLogger(__name__)

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
            self.fired = completed >= self.fixed * total
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


class ScaleDown:
    """Rank 0's scale-down decision (Algorithm 1, lines 13–17): when to look (:class:`Trigger`) and
    whether the running requests' projected KV peak fits the kept replicas. No tensors, no ranks:
    :class:`StreamTrainer` holds one, and the simulator drives the same class."""

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

    def start_round(self, kind: str) -> None:
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


class GroupSink(Protocol):
    """Where a stream round sends the complete, scored groups: the freed ranks, or the simulator's record."""

    def ready(self) -> bool:
        """Whether the freed ranks have trained the last batch sent."""
        ...

    def send(self, groups: list[Group]) -> None: ...

    def close(self) -> None:
        """The round is over: nothing more will be sent."""
        ...


class StreamRound(RoundHooks):
    """Stream training's hooks for one round, on rank 0 (plain Python: the simulator drives it too).

    It asks the :class:`ScaleDown` whether to scale down, times the migration, and feeds the
    complete, scored groups to ``sink``. ``clock`` gives the time (simulated in the simulator).
    """

    def __init__(self, decider: ScaleDown, sink: GroupSink, state: RoundState,
                 clock: Callable[[], float] = time.time):
        self.decider, self.sink, self.clock = decider, sink, clock
        decider.start_round(state.plan.kind)
        self.migration_s: float | None = None
        """Seconds from the scale-down until the migrated requests were back (None: not yet)."""
        self.migrated_tokens = 0
        """Tokens the migration recomputes (prompt and generated)."""
        self.fetching = False
        """Whether complete groups still go to the freed ranks."""
        self.num_streamed = 0

    def on_poll(self, running: float, step_seconds: float) -> None:
        self.decider.step_cost.observe(running, step_seconds)

    def on_finished(self, lengths: list[int]) -> None:
        self.decider.history.extend(lengths)

    def on_aborted(self, state: RoundState, outputs: list[Any]) -> list[Any]:
        """The migrated outputs, to resume on the kept replicas by recomputation. The migration ends
        at the first report that brings none of them: they are back and prefilled."""
        if self.scaled_at is not None and self.migration_s is None and not any(o.id in state.migrating
                                                                                for o in outputs):
            self.migration_s = self.clock() - self.scaled_at
        resume = [o for o in outputs if o.id in state.migrating and o.id in state.outstanding
                  and o.finish_reason == "abort"]  # not one its engine finished before the abort reached it
        self.migrated_tokens += sum(len(o.prompt_ids) + len(o.token_ids) for o in resume)
        state.migrating -= {o.id for o in outputs}
        return resume

    def maybe_scale_down(self, state: RoundState, generated: Callable[[], list[tuple[int, int]]]) -> list[str] | None:
        """Once per round, when the :class:`ScaleDown` says so: the freed replicas' requests, which migrate."""
        if self.scaled_at is not None or not state.outstanding:
            return None
        if not self.decider.consider(state.num_complete, state.plan.keep, generated):
            return None
        self.scaled_at, self.fetching = self.clock(), True
        self.completed_frac = state.num_complete / state.plan.keep
        return state.scale_down(self.decider.kept_replicas)

    def feed(self, state: RoundState) -> None:
        """Send the complete, scored groups once the freed ranks have trained the last batch.
        A one-shot fetch (``stream.fetch_cap``) happens once."""
        if not self.fetching or not self.sink.ready():
            return
        cap = self.decider.config.fetch_cap
        ready = state.take_complete(cap)
        if ready:
            self.sink.send(ready)
            self.num_streamed += len(ready)
        self.fetching = not cap

    def finish(self) -> dict[str, float]:
        """The round's ``stream/`` metrics and migration time; the decider learns the migration's rate."""
        if self.scaled_at is not None:
            self.sink.close()
            self.decider.learn_migration(self.migration_s or 0.0, self.migrated_tokens)
        stats = {"stream/scaled_down": float(self.completed_frac is not None),
                 "stream/trigger_completed_frac": self.completed_frac or 0.0,
                 "time/migration": self.migration_s or 0.0,
                 "stream/streamed_groups": float(self.num_streamed)}
        return stats | {f"stream/projected_{k}_s": v for k, v in self.decider.last.items()}  # the last look's


class PipeRound(StreamRound):
    """RolloutPipe's hooks: the pools are fixed. Rollout runs on the kept replicas from the start,
    nothing migrates, the train pool is fed all round, and each request's priority is its slot
    (frontier-group dispatch)."""

    def __init__(self, decider: ScaleDown, sink: GroupSink, state: RoundState,
                 clock: Callable[[], float] = time.time):
        super().__init__(decider, sink, state, clock)
        state.scale_down(decider.kept_replicas)  # nothing launched yet: nothing migrates
        self.scaled_at, self.migration_s, self.fetching = clock(), 0.0, True

    def priority(self, slot: int) -> int:
        return slot


class _ToFreedRanks:
    """The controller's :class:`GroupSink`: each group's trainer samples, to the freed ranks."""

    def __init__(self, stream: StreamTrainer, make_samples: Callable[[Group], list]):
        self.stream, self.make_samples = stream, make_samples

    def ready(self) -> bool:
        return self.stream.ready()

    def send(self, groups: list[Group]) -> None:
        self.stream.feed([s for g in groups for s in self.make_samples(g)])

    def close(self) -> None:
        self.stream.close()


class StreamTrainer:
    """Both ends of stream training: rank 0 decides (its :class:`ScaleDown`) and feeds; the freed ranks serve."""

    def __init__(self, config: StreamConfig, trainer, meshes, *, kv_capacity_tokens: int, max_new_tokens: int,
                 pipe: bool = False):
        self.config, self.trainer, self.meshes = config, trainer, meshes
        self.pipe = pipe
        """RolloutPipe: the freed ranks are a train pool that serves from every round's start."""
        replicas, tp = meshes.num_replicas, meshes.rollout_tp.size()
        kept = kept_replicas(replicas)
        self.ranks = list(range(kept * tp, meshes.world_size))
        """The ranks a scale-down frees: the second half of the rollout replicas."""
        shard = meshes.train.size(1)
        refused = ""
        if replicas < 2:
            refused = f"one rollout replica ({meshes.world_size} ranks, rollout.tp={tp}): nothing to free"
        elif self.ranks[0] % shard:
            refused = (f"freeing ranks {self.ranks[0]}..{self.ranks[-1]} would split a training shard group of "
                       f"{shard} ranks: set train.train_shard_size to a divisor of {self.ranks[0]}")
        if refused and pipe:
            raise ValueError(f"schedule.pipe needs a train pool of whole training replicas: {refused}")
        if refused and meshes.rank == 0:
            logger.warning("stream training: no scale-down will happen: %s", refused)
        self.scale_down = ScaleDown(config, num_replicas=replicas, kv_capacity_tokens=kv_capacity_tokens,
                                    max_new_tokens=max_new_tokens, refused=refused)
        """The decision (rank 0): trigger, length history, KV projection."""
        self._pending: list[tuple[Any, Any]] = []  # (isend/irecv work, its tensor)
        self._ack: Any = None
        """The freed ranks' "send more" for the batch in flight (rank 0), None when none is in flight."""
        self.seconds = 0.0
        """Training time of this rank during the last round (freed ranks)."""

    @property
    def freed(self) -> bool:
        return self.meshes.rank in self.ranks

    @property
    def refused(self) -> str:
        """Why no scale-down will ever happen ("" when one may)."""
        return self.scale_down.refused

    def rebuild(self, kv_capacity_tokens: int) -> StreamTrainer:
        """The stream trainer of engines rebuilt at another TP (collective): its replicas changed;
        the length histories carry over."""
        new = StreamTrainer(self.config, self.trainer, self.meshes, kv_capacity_tokens=kv_capacity_tokens,
                            max_new_tokens=self.scale_down.max_new_tokens, pipe=self.pipe)
        new.scale_down.histories = self.scale_down.histories
        return new

    def start_round(self) -> None:
        """Every rank, before a round: the last round's sends are all received by now."""
        for work, _ in self._pending:
            work.wait()
        self._pending, self._ack = [], None
        self.seconds = 0.0

    def begin_round(self, state: RoundState, make_samples: Callable[[Group], list]) -> StreamRound:
        """Rank 0: the round's hooks (RolloutPipe's with ``pipe``); ``make_samples(group)`` gives a
        complete, scored group's trainer samples."""
        hooks = PipeRound if self.pipe else StreamRound
        return hooks(self.scale_down, _ToFreedRanks(self, make_samples), state)

    # -- rank 0 ------------------------------------------------------------------------------

    def ready(self) -> bool:
        """Whether the freed ranks have trained the last batch sent (asynchronous fetching: one
        batch in flight at a time, so what they have not fetched when rollout ends is trained by
        every rank)."""
        return self._ack is None or self._ack.is_completed()

    def feed(self, samples: list) -> None:
        """Send ``samples`` (a list of trainer Samples; None ends the round) to every freed rank,
        without waiting; for a batch, also post the receive of the freed ranks' "send more"."""
        import torch
        import torch.distributed as dist

        payload = torch.frombuffer(bytearray(pickle.dumps(samples)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        for rank in self.ranks:
            for t in (size, payload):
                self._pending.append((dist.isend(t, rank, group=self.meshes.stream_group), t))
        if samples is not None:
            ack = torch.zeros(1, dtype=torch.int64)
            self._ack = dist.irecv(ack, self.ranks[0], group=self.meshes.stream_group)
            self._pending.append((self._ack, ack))

    def close(self) -> None:
        """End the round's streaming: the freed ranks leave :meth:`serve` once they have trained
        everything sent before (the train step's first collective waits for them)."""
        self.feed(None)

    # -- freed ranks -------------------------------------------------------------------------

    def serve_freed(self, engine) -> None:
        """A rank the scale-down freed (it left the round): its engine's memory released, train on
        what rank 0 streams until the round ends (:meth:`serve`), then the memory back (pipe: kept
        released until the engine rolls out again, for an evaluation)."""
        engine.release_memory()
        self.serve()
        if not self.pipe:
            engine.resume_memory()

    def serve(self) -> None:
        """Receive groups' samples from rank 0 and accumulate their gradients until the round ends."""
        import torch
        import torch.distributed as dist

        while True:
            size = torch.zeros(1, dtype=torch.int64)
            dist.recv(size, 0, group=self.meshes.stream_group)
            payload = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(payload, 0, group=self.meshes.stream_group)
            samples = pickle.loads(payload.numpy().tobytes())
            if samples is None:
                return
            start = time.perf_counter()
            self.trainer.accumulate(samples, self.ranks)
            self.seconds += time.perf_counter() - start
            if self.meshes.rank == self.ranks[0]:  # send more (rank 0 has posted its receive)
                dist.send(torch.ones(1, dtype=torch.int64), 0, group=self.meshes.stream_group)

    # -- every rank ----------------------------------------------------------------------------

    def after_step(self, kind: str, train_seconds: float, round_seconds: float, scaled_down: bool) -> dict[str, float]:
        """Collective, after the step's optimizer step: the training the freed ranks did under
        rollout. On rank 0 (which knows the round's ``kind``, the final step's ``train_seconds``, the
        ``round_seconds`` from rollout start to now and whether it ``scaled_down``), the scale-down
        learns what the step saved, and the ``stream/`` and ``pipe/`` metrics come back."""
        hidden = self.meshes.gather(self.seconds)
        if self.meshes.rank != 0:
            return {}
        hidden = max(hidden)
        saved = hidden * len(self.ranks) / self.meshes.world_size  # taken off the final step
        self.scale_down.learn(kind, train_seconds + saved, saved if scaled_down else None)
        stats = {"stream/train_seconds": hidden}  # train time hidden under rollout
        if self.pipe:
            stats |= pipe_stats(round_seconds, hidden, train_seconds)
        return stats


def pipe_stats(rollout_to_train_end: float, hidden: float, final_train: float) -> dict[str, float]:
    """RolloutPipe's metrics: ``pipe/rollout_to_train_end``, seconds from the round's start (rollout
    start) to the end of the optimizer step; ``pipe/trainer_wait_ratio``, the fraction of that span
    the train pool was not training: neither on streamed groups (``hidden``, its busiest rank) nor in
    the final step (``final_train``, which every rank joins)."""
    busy = min(hidden + final_train, rollout_to_train_end)
    return {"pipe/rollout_to_train_end": rollout_to_train_end,
            "pipe/trainer_wait_ratio": 1.0 - busy / rollout_to_train_end if rollout_to_train_end > 0 else 0.0}
