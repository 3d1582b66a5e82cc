"""The sample ledger: where every prompt of every epoch is, so that none is lost or trained twice.

A prompt's identity is ``(epoch, row)``: the row of the dataset and the epoch of the sampler that
drew it. Undrawn prompts are the sampler's business (its position); once drawn, a prompt is in
exactly one state here: in flight, deferred (the long-prompt queue, FIFO), trained or filtered
(zero reward variance). An epoch whose every prompt was drawn and ended trained or filtered folds
into its counts (:meth:`Ledger.fold`): a long run keeps no key per prompt of its past epochs. The
ledger is plain data, saved in every checkpoint; loading puts the prompts that were in flight at
the front of the queue, so a save taken mid-round loses nothing.
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
        self.folded: dict[int, Counter] = {}
        """The states of each epoch folded, counted."""
        self._drawn: Counter = Counter()
        self._open: Counter = Counter()
        """Keys in ``state`` by epoch: all of them, and those in flight or deferred."""

    def __deepcopy__(self, memo: dict) -> Ledger:
        """Keys and states are immutable: a copy copies the containers, not each key (``env.warm`` plans each
        next round on a copy of the policy: a deep copy took 1 s at 500k prompts drawn)."""
        new = memo[id(self)] = Ledger()
        new.state, new.queue = dict(self.state), deque(self.queue)
        new.folded = {epoch: Counter(counts) for epoch, counts in self.folded.items()}
        new._drawn, new._open = Counter(self._drawn), Counter(self._open)
        return new

    def launch(self, key: Key) -> None:
        """``key`` goes in flight: freshly drawn, or taken from the front of the queue."""
        if self.state.get(key, "deferred") != "deferred" or key[0] in self.folded:
            raise ValueError(f"ledger: prompt {key} is {self.state.get(key, 'trained or filtered')}, it cannot be "
                             "launched again")
        if self.state.get(key) == "deferred":
            self.queue.remove(key)
        else:
            self._drawn[key[0]] += 1
            self._open[key[0]] += 1
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
        else:
            self._open[key[0]] -= 1

    def fold(self, sampler) -> None:
        """Fold into counts each epoch that ``sampler`` drew whole and whose every prompt ended trained or filtered
        (10 epochs of 128k rows kept 1.28M keys, 14.8 MiB in each checkpoint; folded, the last epoch's 1.5 MiB)."""
        done = {e for e, n in self._drawn.items() if e < sampler.epoch and n == sampler.sizes[e] and not self._open[e]}
        if not done:
            return
        for epoch in done:
            self.folded[epoch] = Counter()
            del self._drawn[epoch], self._open[epoch]
        for key, state in self.state.items():
            if key[0] in done:
                self.folded[key[0]][state] += 1
        self.state = {key: state for key, state in self.state.items() if key[0] not in done}

    def counts(self) -> Counter:
        return sum(self.folded.values(), Counter(self.state.values()))

    def check(self, sampler) -> None:
        """Raise unless the ledger and the sampler account for every prompt exactly once."""
        drawn = Counter(e for e, _ in self.state) + Counter({e: counts.total() for e, counts in self.folded.items()})
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
            "folded": [[epoch, counts["trained"], counts["filtered"]] for epoch, counts in sorted(self.folded.items())],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore; prompts saved in flight come back deferred, at the front of the queue."""
        self.state, self.queue, self._drawn, self._open = {}, deque(), Counter(), Counter()
        self.folded = {int(epoch): Counter(trained=int(trained), filtered=int(filtered)) + Counter()
                       for epoch, trained, filtered in state.get("folded", ())}  # + Counter(): drops zero counts
        for name in ("trained", "filtered", "queue"):
            for epoch, row in state[name]:
                key = (int(epoch), int(row))
                if key in self.state:
                    raise ValueError(f"ledger checkpoint lists prompt {key} twice ({self.state[key]} and {name})")
                if key[0] in self.folded:
                    raise ValueError(f"ledger checkpoint lists prompt {key} of epoch {key[0]}, which it folded")
                self.state[key] = "deferred" if name == "queue" else name
                self._drawn[key[0]] += 1
                if name == "queue":
                    self.queue.append(key)
                    self._open[key[0]] += 1
