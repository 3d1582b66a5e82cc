"""The scheduling-policy contract: what the controller asks a policy, and what it is told.

A policy decides which prompts a round launches and how many responses each, reacts to every
finished and scored response (keep it, abort its siblings, launch more prompts, end the round),
and says at the end of the round which groups are trained. It never touches tensors or engines:
the controller (``exchange.py``, through ``schedule/round.py``) turns its decisions into engine
calls on the right replicas, and the trainer never learns how samples were scheduled.

One round = one RL step. The controller calls, on rank 0 only:

1. ``start_round(step) -> RoundPlan``: the prompts to launch (dataset rows) and responses each.
   A round's prompts are addressed by *slot*, their position in launch order (``RoundPlan.prompts``
   first, then every ``PolicyDecision.launch`` in turn), so one row may appear twice in a round (once
   from each of two epochs);
2. ``on_finished(slot, response, output, reward) -> PolicyDecision`` for every response that finishes,
   in the order they finished: request ids to abort now, rows to launch, groups now complete (final:
   they will be trained, so the stream trainer may take them at once), and whether the round is
   over. A policy whose ``needs_rewards`` is True hears of a response once it is scored
   (``reward`` None when scoring failed); otherwise at once, with ``reward`` None. A policy may be
   told about a response it has already asked to abort (it finished in the meantime); it ignores it;
3. ``end_round(aborted) -> list of groups to train`` once the round is over and every
   still-running request has been aborted (their partial outputs are passed in; one its engine
   finished before the abort reached it comes whole, with its own finish reason). The policy
   accounts for every prompt it launched: trained, deferred or filtered. The groups are the same
   objects its decisions reported complete. The controller then fills each group's ``rewards``
   from the reward scheduler.

A policy that keeps work across rounds (``sorted_partial``) fills two optional, additive fields:
``RoundPlan.carried`` maps ``(slot, response)`` to what an earlier round generated of that response. A
partial output (``finish_reason`` "abort") is continued by recomputation (``Request.resume_from``,
same request id scheme, this round's sampling seed); a finished one is not launched again, only
submitted for scoring again so that the controller can fill its reward (the policy already holds
it in the group). ``Group.staleness`` gives, per output, the RL steps between the sampling of its
oldest token and this round's training (empty: all 0, on-policy). Policies that leave both empty
(sync, tail) see no change.

``stats()`` gives the round's ``sched/`` metrics; ``done()`` is True once there is nothing left to
train (the configured epochs are used up). Policies are checkpointed with
``state_dict``/``load_state_dict`` (plain Python data).

A policy's settings are a :class:`PolicyConfig` beside it, in the same module: its own settings,
its capabilities (what the rest of the job asks instead of its name) and its builder. The root
config states the composition rules by capability. ``rollpacker.schedule.config.POLICY_CONFIGS``
registers it, or ``--schedule.policy pkg.mod:MyConfig`` names it (``docs/extending.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


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
    round_done: bool = False
    """True when the round is over: everything still running gets aborted."""


def request_id(step: int, slot: int, response: int) -> str:
    return f"{step}:{slot}:{response}"


def zero_variance(rewards: list[float | None]) -> bool:
    """True when every response of a group scored the same: GRPO gets no signal from it (DAPO's filter)."""
    values = [r or 0.0 for r in rewards]
    return max(values) == min(values)


def remaining(sampler, num_epochs: int) -> int | None:
    """Rows ``sampler`` can still draw within ``num_epochs`` epochs; None when unlimited (0)."""
    if not num_epochs:
        return None
    return max(0, num_epochs * sampler.num_rows - (sampler.epoch * sampler.num_rows + sampler.position))


class QueuedPolicy:
    """What the policies that hold prompts back in their ledger's queue (tail, sorted) share; they
    set ``sampler``, ``num_epochs``, ``ledger`` and ``filter_zero_variance``."""

    @property
    def needs_rewards(self) -> bool:
        """The zero-variance filter decides on rewards; nothing else does."""
        return self.filter_zero_variance

    def done(self) -> bool:
        return remaining(self.sampler, self.num_epochs) == 0 and not self.ledger.queue


class Policy(Protocol):
    name: str
    needs_rewards: bool
    """Whether decisions depend on rewards (then responses reach on_finished only once scored)."""

    def start_round(self, step: int) -> RoundPlan: ...

    def on_finished(self, slot: int, response: int, output: Any, reward: float | None) -> PolicyDecision: ...

    def end_round(self, aborted: list[Any]) -> list[Group]: ...

    def stats(self) -> dict[str, Any]: ...

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

    def build(self, sampler, num_prompts: int, group_size: int, *, num_epochs: int = 0,
              last_step: int | None = None) -> Policy:
        """The policy with these settings over ``sampler``, P0 = ``num_prompts``, R0 = ``group_size``.
        ``num_epochs`` (0: unlimited) and ``last_step`` (None: none known) bound the run."""
        raise NotImplementedError(f"{type(self).__name__}.build")

    def rollout_pool(self, world: int) -> int:
        """The ranks (the simulator: GPUs) of ``world`` that roll out: all, unless it has pools."""
        return world


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
