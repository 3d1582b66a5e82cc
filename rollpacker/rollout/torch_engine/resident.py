"""TorchEngine's resident sessions: the KV of a finished request kept for its episode's next turn.

- A request with ``Request.session`` that finishes leaves its blocks behind, holding the K/V of its
  prompt and all its tokens but the last (whose K/V no forward computed), under its session key.
- The next request of that session reuses the blocks of the longest common prefix of its prompt and
  those tokens (all but its last prompt token, whose logits the prefill must compute); the other
  blocks are freed.
- Under memory pressure the engine evicts sessions, least recently kept first, before it preempts
  a running request. A session whose next turn is already queued goes last: while requests run,
  admission waits for their blocks rather than evict it. ``end_session`` frees one;
  ``release_memory`` and ``update_weights`` free all (their K/V would be stale).

This module is bookkeeping only: it hands the engine the blocks to free.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass


@dataclass
class Resident:
    tokens: list[int]
    """The tokens whose K/V ``blocks`` hold, in order."""
    blocks: list[int]


class Sessions:
    """Resident sessions by key, least recently kept first."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.resident: dict[str, Resident] = {}

    def __len__(self) -> int:
        return len(self.resident)

    def keep(self, session: str, tokens: list[int], blocks: list[int]) -> list[int]:
        """Keep ``blocks`` (holding ``tokens``' K/V) for ``session``; the blocks of what it held before."""
        freed = self.drop(session)
        self.resident[session] = Resident(tokens, blocks)
        return freed

    def match(self, session: str | None, tokens: list[int]) -> tuple[int, int]:
        """For a request of ``session`` over ``tokens``: how many leading tokens' K/V it can reuse (all but
        its last at most), and how many blocks the session holds now."""
        held = self.resident.get(session) if session is not None else None
        if held is None:
            return 0, 0
        limit, n = min(len(held.tokens), len(tokens) - 1), 0
        while n < limit and held.tokens[n] == tokens[n]:
            n += 1
        return n, len(held.blocks)

    def take(self, session: str | None, num_tokens: int) -> tuple[list[int], list[int]]:
        """Hand ``session``'s blocks over to its next request, which reuses ``num_tokens`` tokens: the blocks
        it keeps, and the others (to free)."""
        held = self.resident.pop(session, None) if session is not None else None
        if held is None:
            return [], []
        keep = -(-num_tokens // self.block_size)
        return held.blocks[:keep], held.blocks[keep:]

    def evict(self, spare: Container[str] = ()) -> list[int] | None:
        """Evict the least recently kept session not in ``spare``: its blocks, or None if there is none."""
        for session in self.resident:
            if session not in spare:
                return self.resident.pop(session).blocks
        return None

    def drop(self, session: str) -> list[int]:
        """End ``session``: the blocks it held (none if it was not resident)."""
        held = self.resident.pop(session, None)
        return held.blocks if held is not None else []

    def clear(self) -> list[int]:
        """End every session: the blocks they held."""
        freed = [b for held in self.resident.values() for b in held.blocks]
        self.resident.clear()
        return freed
