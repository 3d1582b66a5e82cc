"""The scheduling-policy contract: what the controller asks a policy, and what it is told.

A policy decides which prompts a round launches and how many responses each. It hears every
finished response and answers (abort siblings, launch more, end the round). At the end it says
which groups train. One round is one RL step: ``start_round``, then ``on_finished`` per response
in finish order, then ``end_round``, all on rank 0.

Invariants:

- A policy never touches tensors or engines; the round turns its decisions into engine calls.
- The trainer never learns how samples were scheduled.
- ``end_round`` accounts for every prompt launched: trained, deferred or filtered.
- ``RoundPlan.carried`` and ``Group.staleness`` are additive: a policy that leaves them empty is on-policy.

Why: decisions as plain data let the exchange and the simulator run the very same policy. A
policy's settings are a :class:`PolicyConfig` beside it. Each call in detail, and how to add a
policy: ``docs/extending.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from rollpacker.errors import UserError


@dataclass
class RoundPlan:
    kind: str
    """"sync", "short", "long" or "sorted": how this round was scheduled (logged as sched/round_kind)."""
    prompts: list[int]
    """Dataset rows of the prompts to launch; slot i is ``prompts[i]``."""
    num_responses: int
    """Responses launched per prompt (also for prompts launched later in the round)."""
    keep: int
    """Prompts the round will complete and train (its progress is measured against this)."""
    carried: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(slot, response) -> its output from an earlier round: partial ones are resumed, finished ones
    are not launched (only scored again). Empty: every response starts afresh."""
    resets: str | None = None
    """Names its prompt groups for their environments' reset seeds in place of the step (``RESETS:SLOT``):
    the held-out round's "eval", so every evaluation opens the same episodes. None: ``STEP:SLOT``, each
    round's episodes new."""

    def group(self, step: int, slot: int) -> str:
        """Prompt group ``slot``'s name: its episodes' environments reset with the seed of this name."""
        return f"{step if self.resets is None else self.resets}:{slot}"


@dataclass
class Group:
    """A prompt and the responses of it to train on (the outputs carry token ids and log-probs)."""

    prompt: int
    """Dataset row."""
    outputs: list[Any]
    rewards: list[float | None]
    """One per output; None where scoring failed."""
    epoch: int = 0
    streamed: bool = False
    """Set by the controller when the stream trainer took it during the round."""
    staleness: list[int] = field(default_factory=list)
    """One per output: RL steps since its oldest token was sampled (empty: all 0, on-policy)."""


@dataclass
class PolicyDecision:
    abort: list[str] = field(default_factory=list)
    """Request ids to abort now."""
    launch: list[int] = field(default_factory=list)
    """Dataset rows to launch now, ``RoundPlan.num_responses`` responses each; they take the next slots."""
    complete: list[Group] = field(default_factory=list)
    """Groups that became complete with this response: final, ``end_round`` returns them."""
    filtered: list[Group] = field(default_factory=list)
    """Groups the zero-variance filter dropped with this response, with their rewards (``data.retire_solved``
    reads them)."""
    round_done: bool = False
    """True when the round is over: everything still running gets aborted."""


def request_id(step: int, slot: int, response: int) -> str:
    return f"{step}:{slot}:{response}"


def provisioned(eta: float, n: int) -> int:
    """⌈η·n⌉ for a decimal η: 1.1 x 100 is 110 (the float product, 110.00000000000001, would round up to 111)."""
    return math.ceil(round(eta * n, 9))


def zero_variance(outputs: list[Any], rewards: list[float | None]) -> bool:
    """True when every response of a group scored the same: GRPO gets no signal from it (DAPO's filter). An episode
    whose environment failed is left out, as its group's advantages leave it out (none left: no signal either)."""
    values = [r or 0.0 for o, r in zip(outputs, rewards) if o.finish_reason != "error"]
    return not values or max(values) == min(values)


def check_refill(drawn: int, num_prompts: int, max_gen_batches: int) -> None:
    """Before a round draws a prompt to replace a group the filter dropped, having drawn ``drawn``: a
    UserError once that is ``max_gen_batches`` times P0 (0: no limit). Else a round whose every
    group has equal rewards (a reward that is 0 everywhere) would draw prompts forever."""
    if max_gen_batches and drawn >= max_gen_batches * num_prompts:
        raise UserError(f"a round drew {drawn} prompts (schedule.max_gen_batches={max_gen_batches} times "
                        f"rollout.num_prompts) and schedule.filter_zero_variance still dropped the groups that would "
                        "fill it: their responses got equal rewards. The data is too hard or too easy for the model, "
                        "or the reward function scores everything alike (see reward/mean and a samples file); "
                        "raise schedule.max_gen_batches (0: no limit) if the round should keep drawing")


class QueuedPolicy:
    """What the policies that hold prompts back in their ledger's queue (tail, sorted) share; they
    set ``sampler``, ``num_epochs``, ``ledger`` and ``filter_zero_variance``."""

    @property
    def needs_rewards(self) -> bool:
        """The zero-variance filter decides on rewards; nothing else does."""
        return self.filter_zero_variance

    def done(self) -> bool:
        return self.sampler.remaining(self.num_epochs) == 0 and not self.ledger.queue

    def held_tokens(self) -> int:
        return 0  # a deferred prompt starts afresh, unless the policy keeps its responses (sorted_partial)


class Policy(Protocol):
    name: str
    needs_rewards: bool
    """Whether decisions depend on rewards (then responses reach on_finished only once scored)."""

    def start_round(self, step: int) -> RoundPlan: ...

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision: ...

    def end_round(self, aborted: list[Any]) -> list[Group]: ...

    def stats(self) -> dict[str, Any]: ...

    def held_tokens(self) -> int:
        """Response tokens it keeps for later rounds, as of its last ``end_round`` (sorted_partial's buffer):
        neither trained nor wasted yet. 0 for a policy that starts every response afresh."""
        ...

    def done(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(kw_only=True)
class PolicyConfig:
    """A policy's settings, capabilities and builder (no torch import: configs parse first)."""

    name: ClassVar[str]
    """Its name: the ``schedule:NAME`` subcommand, ``[schedule] policy = NAME`` in a preset."""
    stale_samples: ClassVar[str | None] = None
    """Why its samples can be older than the step that trains them; None: on-policy. Stale samples
    need a ``train.rollout_correction`` other than none."""
    on_policy_alternative: ClassVar[str] = "sync"
    """With stale_samples: the on-policy policy that the error suggests instead."""
    carries_responses: ClassVar[str | None] = None
    """Why it carries responses across rounds (``RoundPlan.carried``); None: every round starts its
    responses afresh. Episodes refuse such a policy (an environment cannot be carried over with them)."""
    own_pools: ClassVar[bool] = False
    """It rolls out on ranks of its own (:meth:`rollout_pool`) while the others train the batch
    before, in its own loop (``rollpacker.loops.one_step_off``)."""

    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): do not train or queue prompts whose group rewards are all equal."""
    max_gen_batches: int = 10
    """With filter_zero_variance, where a fresh prompt replaces a dropped group (sync's refill, tail's short
    rounds): a round that has drawn this many times rollout.num_prompts stops the run, saying why (verl's
    max_num_gen_batches; 0: no limit)."""

    @property
    def refills(self) -> bool:
        """A fresh prompt replaces a dropped group (what ``max_gen_batches`` bounds)."""
        return False

    def __post_init__(self) -> None:
        if self.max_gen_batches < 0:
            raise ValueError(f"schedule.max_gen_batches={self.max_gen_batches}: the times a round may draw "
                             "rollout.num_prompts, 0 for no limit; give a count >= 0")
        if self.max_gen_batches != type(self).max_gen_batches and not self.refills:
            raise ValueError(f"schedule.max_gen_batches with schedule:{self.name}: it bounds the prompts drawn in "
                             "place of dropped groups, and no round refills here (schedule:sync with schedule.refill, "
                             "schedule:tail with schedule.filter_zero_variance do); leave it out")

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> Policy:
        """The policy with these settings over ``sampler``, P0 = ``num_prompts``, R0 = ``group_size``.
        ``num_epochs`` (0: unlimited) and ``last_step`` (None: none known) bound the run."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def rollout_pool(self, world: int) -> int:
        """The ranks (the simulator: GPUs) of ``world`` that roll out: all, unless it has pools."""
        return world

    def settle(self, episodes: bool) -> None:
        """Settle the defaults that depend on whether responses are episodes with an environment (the
        config calls it once, the simulator before it builds the policy)."""


def refuse_with_pools(policy: PolicyConfig, *, stream: tuple[str, bool], planner: tuple[str, bool]) -> None:
    """A policy with pools of its own rolls out apart from training, in its own loop: stream training
    has no rollout rank to free, and the planner no TP to size over every rank. ``stream`` and
    ``planner`` are (the setting's name, whether it is on); a ValueError names the one that is on."""
    if not policy.own_pools:
        return
    for (setting, on), why in (
            (stream, "the training pool is separate already; there is no rollout rank to free"),
            (planner, "the parallelism planner sizes rollout TP for every rank rolling out; set rollout.tp for the "
                      "rollout pool instead")):
        if on:
            raise ValueError(f"schedule:{policy.name} with {setting}: {why}. Turn {setting} off")
