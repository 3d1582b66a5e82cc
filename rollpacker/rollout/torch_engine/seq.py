"""A request's state inside TorchEngine: its tokens, KV blocks, running row and draft."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollpacker.rollout.drafter import Draft
from rollpacker.rollout.engine import Output, Request
from rollpacker.rollout.spec_cost import Acceptance


@dataclass(eq=False)
class Seq:
    req: Request
    out: Output
    tokens: list[int]
    """Prompt followed by every generated token."""
    seed: int
    stop_ids: frozenset[int]
    max_len: int
    """Length of ``tokens`` at which the request finishes (max_new_tokens or the context length)."""
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    """Leading tokens whose K/V its blocks held at admission (a resident session's): its prefill computes the rest."""
    prefilled: int = 0
    """Tokens whose K/V its prefill left in the pool (later ones live in the decode workspace)."""
    row: int = -1
    """One of the engine's ``max_num_seqs`` running slots while running; -1 otherwise."""
    weights: int = 0
    """The engine's weight version at its admission: a request running across a weight push leaves no KV resident."""
    group: Any = None
    """The :class:`~rollpacker.rollout.torch_engine.kv.LengthGroup` holding this request's K/V row
    in the decode workspace; None before its first decode step, and once it leaves the running set."""
    slot: int = -1
    """Its row in ``group``."""
    draft: Draft | None = None
    """The draft this decode step verifies (speculation), if any."""
    acceptance: Acceptance = field(default_factory=Acceptance)
    """Its recent draft acceptance (speculation's draft length)."""
