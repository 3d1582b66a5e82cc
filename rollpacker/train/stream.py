"""Stream training's transport (paper §4.4): rank 0 feeds complete groups to the ranks a
scale-down freed, which accumulate their gradients while rollout goes on.

- Rank 0 sends each batch of samples over point-to-point sends on ``Meshes.stream_group`` and never
  blocks: one batch is in flight at a time; the next goes once the freed ranks say "send more".
- The freed ranks release their KV cache, receive, and accumulate gradients without gradient sync
  and without an optimizer step (:meth:`Trainer.accumulate`).
- When rollout ends, what was not fetched is trained by every rank. One :meth:`Trainer.step`
  reduces all gradients over the step's global count: the update equals the synchronous one.

The decisions (when to scale down, what to feed) are rank 0's, in
:mod:`rollpacker.schedule.scale_down`; the round (:class:`~rollpacker.schedule.round.Round`) runs
them. RolloutPipe (``pipe``) is the same transport with the pools fixed for the whole run.
The design and how it departs from the paper: ``docs/stream.md``.
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import Any

from rollpacker.schedule.scale_down import PipeRound, ScaleDownDecider, StreamConfig, StreamRound

logger = logging.getLogger(__name__)


class StreamTrainer:
    """Both ends of stream training: rank 0 feeds (a :class:`~rollpacker.exchange.GroupSink`) and
    holds the :class:`ScaleDownDecider` decider; the freed ranks serve."""

    def __init__(self, config: StreamConfig, trainer, meshes, *, kv_capacity_tokens: int, max_new_tokens: int,
                 pipe: bool = False):
        self.config, self.trainer, self.meshes = config, trainer, meshes
        self.pipe = pipe
        """RolloutPipe: the freed ranks are a train pool that serves from every round's start."""
        self.max_new_tokens = max_new_tokens
        self.decider = self._decider(kv_capacity_tokens)
        """The decision (rank 0): trigger, length histories, KV projection."""
        self.hooks: StreamRound | None = None
        """Rank 0: the hooks of the last round (:meth:`round_hooks`)."""
        self.round_start = 0.0
        self._pending: list[tuple[Any, Any]] = []  # (isend/irecv work, its tensor)
        self._ack: Any = None
        """The freed ranks' "send more" for the batch in flight (rank 0), None when none is in flight."""
        self.training = 0.0
        """Training time of this rank during the round under way (freed ranks)."""
        self.seconds = 0.0
        """Training time of this rank during the last round (freed ranks), as :meth:`after_step` took it."""

    def _decider(self, kv_capacity_tokens: int) -> ScaleDownDecider:
        topology = self.meshes.topology
        if topology.refused and self.meshes.rank == 0:
            logger.warning("stream training: no scale-down will happen: %s", topology.refused)
        return ScaleDownDecider(self.config, num_replicas=topology.num_replicas, kv_capacity_tokens=kv_capacity_tokens,
                         max_new_tokens=self.max_new_tokens, refused=topology.refused)

    @property
    def ranks(self) -> list[int]:
        """The ranks a scale-down frees: the second half of the rollout replicas."""
        return self.meshes.topology.freed_ranks

    @property
    def freed(self) -> bool:
        return self.meshes.freed

    @property
    def refused(self) -> str:
        """Why no scale-down will ever happen ("" when one may)."""
        return self.decider.refused

    def retarget(self, kv_capacity_tokens: int) -> None:
        """Engines rebuilt at another TP: the replicas changed; the length histories carry over."""
        histories = self.decider.histories
        self.decider = self._decider(kv_capacity_tokens)
        self.decider.histories = histories

    def round_hooks(self) -> StreamRound:
        """Rank 0, before a round: its hooks (RolloutPipe's with ``pipe``), kept for :meth:`after_step`."""
        self.hooks = (PipeRound if self.pipe else StreamRound)(self.decider)
        self.round_start = time.time()
        return self.hooks

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
            self.training += time.perf_counter() - start
            if self.meshes.rank == self.ranks[0]:  # send more (rank 0 has posted its receive)
                dist.send(torch.ones(1, dtype=torch.int64), 0, group=self.meshes.stream_group)

    # -- every rank ----------------------------------------------------------------------------

    def after_step(self, train_seconds: float) -> dict[str, float]:
        """Collective, after the step's optimizer step: the training the freed ranks did under
        rollout. On rank 0, the decider learns what the step saved (from the round's hooks: its kind,
        whether it scaled down; ``train_seconds``: the final step's), and the ``stream/`` and
        ``pipe/`` metrics come back. Every send of the round is received by then."""
        self.seconds, self.training = self.training, 0.0
        hidden = self.meshes.gather(self.seconds)
        self.await_sends()
        if self.meshes.rank != 0:
            return {}
        hidden = max(hidden)
        saved = hidden * len(self.ranks) / self.meshes.world_size  # taken off the final step
        self.decider.learn(self.hooks.kind, train_seconds + saved, saved if self.hooks.scaled_down else None)
        stats = {"stream/train_seconds": hidden}  # train time hidden under rollout
        if self.pipe:
            stats |= pipe_stats(time.time() - self.round_start, hidden, train_seconds)
        return stats

    def await_sends(self) -> None:
        """Wait for the round's sends to be received; the next round starts afresh."""
        for work, _ in self._pending:
            work.wait()
        self._pending, self._ack = [], None


def pipe_stats(rollout_to_train_end: float, hidden: float, final_train: float) -> dict[str, float]:
    """RolloutPipe's metrics: ``pipe/rollout_to_train_end``, seconds from the round's start (rollout
    start) to the end of the optimizer step; ``pipe/trainer_wait_ratio``, the fraction of that span
    the train pool was not training: neither on streamed groups (``hidden``, its busiest rank) nor in
    the final step (``final_train``, which every rank joins)."""
    busy = min(hidden + final_train, rollout_to_train_end)
    return {"pipe/rollout_to_train_end": rollout_to_train_end,
            "pipe/trainer_wait_ratio": 1.0 - busy / rollout_to_train_end if rollout_to_train_end > 0 else 0.0}
