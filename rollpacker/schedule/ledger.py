"""The sample ledger: where every prompt of every epoch is, so that none is lost or trained twice.

A prompt's identity is ``(epoch, row)``: the row of the dataset and the epoch of the sampler that
drew it. Undrawn prompts are the sampler's business (its position); once drawn, a prompt is in
exactly one state here: in flight, deferred (the long-prompt queue, FIFO), trained or filtered
(zero reward variance). The ledger is plain data, saved in every checkpoint; loading puts the
prompts that were in flight at the front of the queue, so a save taken mid-round loses nothing.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

Key = tuple[int, int]
STATES = ("in_flight", "deferred", "trained", "filtered")


class Ledger:
    def __init__(self) -> None:
        self.state: dict[Key, str] = {}
        self.queue: deque[Key] = deque()
        """The deferred prompts, oldest first."""

    def __deepcopy__(self, memo: dict) -> Ledger:
        """Keys and states are immutable: a copy copies the containers, not each key (``env.warm`` plans each
        next round on a copy of the policy: a deep copy took 1 s at 500k prompts drawn)."""
        new = memo[id(self)] = Ledger()
        new.state, new.queue = dict(self.state), deque(self.queue)
        return new

    def launch(self, key: Key) -> None:
        """``key`` goes in flight: freshly drawn, or taken from the front of the queue."""
        if self.state.get(key, "deferred") != "deferred":
            raise ValueError(f"ledger: prompt {key} is {self.state[key]}, it cannot be launched again")
        if self.state.get(key) == "deferred":
            self.queue.remove(key)
        self.state[key] = "in_flight"

    def settle(self, key: Key, state: str, *, front: bool = False) -> None:
        """An in-flight prompt ends the round ``state``: trained, filtered or deferred (queued last; ``front``:
        first)."""
        if state not in STATES[1:]:
            raise ValueError(f"ledger: unknown state {state!r}")
        if self.state.get(key) != "in_flight":
            raise ValueError(f"ledger: prompt {key} is {self.state.get(key, 'not drawn')}, not in flight")
        self.state[key] = state
        if state == "deferred":
            self.queue.appendleft(key) if front else self.queue.append(key)

    def counts(self) -> Counter:
        return Counter(self.state.values())

    def rows(self, epoch: int, state: str) -> list[int]:
        """The rows of ``epoch`` in ``state``, sorted."""
        return sorted(row for (e, row), s in self.state.items() if e == epoch and s == state)

    def check(self, sampler) -> None:
        """Raise unless the ledger and the sampler account for every prompt exactly once."""
        drawn = Counter(e for e, _ in self.state)
        for epoch in range(sampler.epoch + 1):
            expected = sampler.sizes[epoch] if epoch < sampler.epoch else sampler.position
            if drawn.get(epoch, 0) != expected:
                raise AssertionError(f"ledger: epoch {epoch} has {drawn.get(epoch, 0)} drawn prompts, "
                                     f"the sampler drew {expected}")
        queued = [k for k, s in self.state.items() if s == "deferred"]
        if sorted(queued) != sorted(self.queue) or len(set(self.queue)) != len(self.queue):
            raise AssertionError("ledger: the long-prompt queue and the deferred prompts differ")

    def state_dict(self) -> dict[str, Any]:
        in_flight = [list(k) for k, s in self.state.items() if s == "in_flight"]
        return {
            "queue": in_flight + [list(k) for k in self.queue],
            "trained": [list(k) for k, s in self.state.items() if s == "trained"],
            "filtered": [list(k) for k, s in self.state.items() if s == "filtered"],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; prompts saved in flight come back deferred, at the front of the queue."""
        self.state, self.queue = {}, deque()
        for name in ("trained", "filtered", "queue"):
            for epoch, row in state[name]:
                key = (int(epoch), int(row))
                if key in self.state:
                    raise ValueError(f"ledger checkpoint lists prompt {key} twice ({self.state[key]} and {name})")
                self.state[key] = "deferred" if name == "queue" else name
                if name == "queue":
                    self.queue.append(key)
