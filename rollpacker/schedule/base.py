"""The scheduling-policy contract: what the controller asks a policy, and what it is told.

A policy decides which prompts a round launches and how many responses each, reacts to every
finished response (keep it, abort its siblings, end the round), and says at the end of the round
which groups are trained. It never touches tensors or engines: the controller (``controller.py``)
turns its decisions into engine calls on the right replicas, and the trainer never learns how
samples were scheduled.

One round = one RL step. The controller calls, on rank 0 only:

1. ``start_round(step) -> Round``: the prompts to launch (dataset indices) and responses each;
2. ``on_finished(prompt, response_index, output) -> Decision`` for every response that finishes,
   in arrival order: request ids to abort now, and whether the round is over;
3. ``end_round(outputs) -> list of groups to train`` once the round is over and every still-running
   request has been aborted (their partial outputs are passed in, so a policy can defer, resume or
   drop them, and must account for every prompt it launched).

Policies are checkpointed with ``state_dict``/``load_state_dict`` (plain Python data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Round:
    kind: str
    """"sync", "short" or "long": how this round was scheduled (logged as sched/round_kind)."""
    prompts: list[int]
    """Dataset indices of the prompts to launch."""
    num_responses: int
    """Responses launched per prompt."""


@dataclass
class Decision:
    abort: list[str] = field(default_factory=list)
    """Request ids to abort now."""
    round_done: bool = False
    """True when the round is over: everything still running gets aborted."""


@dataclass
class Group:
    """A prompt and the responses of it to train on (the outputs carry token ids and log-probs)."""

    prompt: int
    outputs: list[Any]


def request_id(step: int, prompt: int, response: int) -> str:
    return f"{step}:{prompt}:{response}"


class Policy(Protocol):
    name: str

    def start_round(self, step: int) -> Round: ...

    def on_finished(self, prompt: int, response: int, output: Any) -> Decision: ...

    def end_round(self, aborted: list[Any]) -> list[Group]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
