"""Model-free drafts for speculative decoding: an n-gram index over the token sequences of one prompt.

A prompt's index holds what this replica has of that prompt: the prompt itself, its requests'
tokens so far (``self`` and ``sibling``), and the controller's :class:`~rollpacker.rollout.engine.DraftContext`.
A draft continues a request's last ``n`` tokens, for the longest ``n`` found elsewhere, with the
continuation most of their occurrences share.

Invariants:

- Memory is bounded: ``max_tokens`` positions per prompt, ``max_matches`` occurrences per n-gram.
  A prompt's index is dropped when its last request leaves.
- Indexing is lazy, so an engine that does not speculate pays nothing.

Why no library: none drafts from one prompt's group of responses, and arctic-inference patches
vLLM. The sources, the rule and the bounds: ``docs/speculative.md``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rollpacker.rollout.engine import DraftContext

_END_BITS = 32
_END_MASK = (1 << _END_BITS) - 1


@dataclass(frozen=True)
class Draft:
    tokens: list[int]
    """Proposed next tokens (at least one)."""
    source: str
    """Where most of the agreeing occurrences come from: prompt, self, sibling or a context's source."""


class _PromptIndex:
    """The n-gram table of one prompt's sequences."""

    def __init__(self, prompt: list[int]):
        self.prompt_len = len(prompt)
        self.seqs: list[list[int]] = [list(prompt)]
        self.sources: list[str | None] = ["prompt"]
        """Per sequence; None for a request's own sequence (sibling or self, by who asks)."""
        self.next_end: list[int] = [0]
        """Per sequence, the next n-gram end position to index."""
        self.table: dict[int, tuple[int, ...]] = {}
        """hash of an n-gram -> its occurrences, packed ``seq << 32 | end`` (the continuation starts at end).
        Tuples of ints, which the garbage collector stops tracking: as lists (or arrays) the hundreds of
        thousands of them made every full collection of the engine's process take ~0.1-0.2 s."""
        self.contexts: set[tuple[str, tuple[int, ...]]] = set()
        """The draft contexts indexed (the siblings of a request bring the same ones)."""
        self.members: dict[str, int] = {}
        """Request id -> its sequence."""
        self.num_indexed = 0


class Drafter:
    """Drafts per request from the sequences of its prompt; see the module docstring."""

    def __init__(self, *, min_n: int = 2, max_n: int = 8, max_matches: int = 8, max_tokens: int = 16384):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"Drafter: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n, self.max_matches, self.max_tokens = min_n, max_n, max_matches, max_tokens
        self.prompts: dict[tuple[int, ...], _PromptIndex] = {}
        self.requests: dict[str, tuple[_PromptIndex, int]] = {}

    def add(self, request_id: str, prompt: list[int], tokens: list[int],
            context: Iterable[DraftContext] = ()) -> None:
        """Index a request: ``tokens`` is its live sequence (prompt, then its tokens as they come; the
        drafter keeps a reference and reads what was appended at the next :meth:`propose`)."""
        key = tuple(prompt)
        index = self.prompts.get(key)
        if index is None:
            index = self.prompts[key] = _PromptIndex(prompt)
        for c in context:
            key = (c.source, tuple(c.token_ids))
            if key not in index.contexts and c.token_ids:
                index.contexts.add(key)
                self._append(index, [*prompt, *c.token_ids], c.source)
        index.members[request_id] = self._append(index, tokens, None)
        self.requests[request_id] = index, index.members[request_id]

    def remove(self, request_id: str) -> None:
        """The request left the engine; its prompt's index goes with its last request."""
        index, _ = self.requests.pop(request_id)
        del index.members[request_id]
        if not index.members:
            del self.prompts[tuple(index.seqs[0])]

    def propose(self, request_id: str, k: int) -> Draft | None:
        """Up to ``k`` tokens to follow the request's sequence, or None when nothing matches."""
        index, me = self.requests[request_id]
        self._catch_up(index)
        seq = index.seqs[me]
        for n in range(min(self.max_n, len(seq)), self.min_n - 1, -1):
            occurrences = index.table.get(hash(tuple(seq[-n:])), ())
            # the latest first; a hash collision only costs a rejected draft (verification decides)
            matches = [(p >> _END_BITS, p & _END_MASK) for p in reversed(occurrences[-self.max_matches:])]
            matches = [(i, end) for i, end in matches if end < len(index.seqs[i])]
            if matches:
                return self._vote(index, me, matches, k)
        return None

    def num_indexed(self) -> int:
        """Positions indexed over all prompts (the memory bound's unit)."""
        return sum(index.num_indexed for index in self.prompts.values())

    def _vote(self, index: _PromptIndex, me: int, matches: list[tuple[int, int]], k: int) -> Draft:
        """The continuation most ``matches`` share, token by token, up to ``k`` tokens."""
        follows = [(index.seqs[i][end:end + k], i) for i, end in matches]
        tokens: list[int] = []
        for d in range(k):
            votes: dict[int, int] = {}
            for f, _ in follows:
                if d < len(f):
                    votes[f[d]] = votes.get(f[d], 0) + 1
            if not votes:
                break
            best = max(votes, key=votes.__getitem__)  # ties: the latest occurrence's token
            tokens.append(best)
            if votes[best] < len(follows):
                follows = [(f, i) for f, i in follows if d < len(f) and f[d] == best]
        sources: dict[str, int] = {}
        for _, i in follows:
            s = index.sources[i] or ("self" if i == me else "sibling")
            sources[s] = sources.get(s, 0) + 1
        return Draft(tokens, max(sources, key=sources.__getitem__))

    def _append(self, index: _PromptIndex, seq: list[int], source: str | None) -> int:
        """Add a sequence to ``index``; its positions from the prompt's end on are indexed lazily."""
        index.seqs.append(seq)
        index.sources.append(source)
        index.next_end.append(index.prompt_len)
        return len(index.seqs) - 1

    def _catch_up(self, index: _PromptIndex) -> None:
        """Index every sequence's positions added since the last call (within the token budget).

        The prompt's n-grams end before its last token (its continuation is the responses'); a
        response sequence's n-grams end at or after the prompt's end, up to its last token (an end
        with no continuation yet is found again once one is appended)."""
        for i, seq in enumerate(index.seqs):
            last = index.prompt_len - 1 if i == 0 else len(seq)
            for end in range(index.next_end[i], last + 1):
                if index.num_indexed >= self.max_tokens:
                    return
                for n in range(self.min_n, min(self.max_n, end) + 1):
                    key = hash(tuple(seq[end - n:end]))
                    occurrences = index.table.get(key, ()) + (i << _END_BITS | end,)
                    index.table[key] = occurrences[-self.max_matches:] if len(occurrences) > 2 * self.max_matches \
                        else occurrences
                index.num_indexed += 1
                index.next_end[i] = end + 1
