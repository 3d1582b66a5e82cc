"""What earlier rounds generated for each prompt: drafts for speculative decoding, and a length
estimate for longest-first dispatch.

:class:`DraftMemory` keeps, per dataset row, a few responses under two sources: ``partial`` (what
rounds generated while not training the prompt) and ``epoch`` (the responses of the round that
last trained it). The longest ``partial`` response bounds the prompt's length
(:meth:`DraftMemory.length_bound`).

Invariants:

- Plain data on rank 0: token ids, no tensors, no engine.
- Bounded: ``max_responses`` per source and row, ``max_tokens`` in all; the oldest rows go first.
- Saved in the controller's checkpoint, so a resumed run drafts and dispatches as an uninterrupted one.

Why: a prompt comes back in later rounds, and what it generated before drafts what it generates
again. The sources and their lifetimes: ``docs/speculative.md``.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import Any, Iterable

SOURCES = ("partial", "epoch")


class DraftMemory:
    def __init__(self, *, max_responses: int = 4, max_tokens: int = 1 << 22, keep_tokens: bool = True):
        """``keep_tokens`` False keeps only lengths (the simulator: no tokens, longest-first only)."""
        if max_responses < 1 or max_tokens < 1:
            raise ValueError(f"DraftMemory: max_responses={max_responses} and max_tokens={max_tokens} must be >= 1")
        self.max_responses, self.max_tokens, self.keep_tokens = max_responses, max_tokens, keep_tokens
        self.rows: OrderedDict[int, dict[str, list[array]]] = OrderedDict()
        """Row -> source -> responses (token ids; without ``keep_tokens``, ``[length]``), longest first."""
        self.num_tokens = 0

    def contexts(self, row: int) -> list[tuple[str, tuple[int, ...]]]:
        """``(source, token ids)`` of every response kept for ``row``."""
        kept = self.rows.get(row, {})
        return [(source, tuple(tokens)) for source in SOURCES for tokens in kept.get(source, ())]

    def length_bound(self, row: int) -> int:
        """The longest ``partial`` response of ``row`` (0: none)."""
        return max((_length(t, self.keep_tokens) for t in self.rows.get(row, {}).get("partial", ())), default=0)

    def end_round(self, outputs: Iterable[tuple[int, Any]], trained: set[int]) -> None:
        """A round ended: ``(row, output)`` of every response it generated (finished or aborted; an
        output has ``token_ids`` and ``finish_reason``), and the rows it trained."""
        by_row: dict[int, list[Any]] = {}
        for row, out in outputs:
            if len(out.token_ids):
                by_row.setdefault(row, []).append(out)
        for row, outs in by_row.items():
            kept = self.rows.pop(row, {})
            self.num_tokens -= sum(self._size(t) for ts in kept.values() for t in ts)
            if row in trained:
                kept = {"epoch": [self._keep(o) for o in outs if o.finish_reason != "abort"]}
            else:
                kept["partial"] = kept.get("partial", []) + [self._keep(o) for o in outs]
            kept = {s: sorted(ts, key=lambda t: -_length(t, self.keep_tokens))[:self.max_responses]
                    for s, ts in kept.items() if ts}
            if kept:
                self.rows[row] = kept  # the newest last
                self.num_tokens += sum(self._size(t) for ts in kept.values() for t in ts)
        while self.num_tokens > self.max_tokens and self.rows:
            _, dropped = self.rows.popitem(last=False)
            self.num_tokens -= sum(self._size(t) for ts in dropped.values() for t in ts)

    def _keep(self, out: Any) -> array:
        return array("i", out.token_ids if self.keep_tokens else [len(out.token_ids)])

    def _size(self, tokens: array) -> int:
        return _length(tokens, self.keep_tokens)

    def state_dict(self) -> dict[str, Any]:
        """Plain data: ``[row, {source: [token ids (or [length]), ...]}]`` oldest first, and which they are."""
        return {"keep_tokens": self.keep_tokens, "rows": [[row, {s: [list(t) for t in ts] for s, ts in kept.items()}]
                                                          for row, kept in self.rows.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """``state``; one saved in the other mode (speculation turned on or off at the resume): token ids become
        their lengths, and lengths, which hold no tokens to draft, are left out."""
        saved = state.get("keep_tokens", self.keep_tokens)  # a checkpoint from before it said: this mode's
        if saved and not self.keep_tokens:
            convert = (lambda t: array("i", [len(t)]))
        elif not saved and self.keep_tokens:
            self.rows, self.num_tokens = OrderedDict(), 0
            return
        else:
            convert = (lambda t: array("i", t))
        self.rows = OrderedDict((int(row), {s: [convert(t) for t in ts] for s, ts in kept.items()})
                                for row, kept in state["rows"])
        self.num_tokens = sum(self._size(t) for kept in self.rows.values() for ts in kept.values() for t in ts)


def _length(tokens: array, keep_tokens: bool) -> int:
    return len(tokens) if keep_tokens else tokens[0]
