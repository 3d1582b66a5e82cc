"""The scheduling policy and its own settings, as one tagged union (no torch import here: configs
parse before heavy imports).

Each policy is a dataclass holding exactly the settings that apply to it, so which settings combine
is the type: ``eta_*`` exist only on tail, ``sorted_batches`` only on the SortedRL policies,
``rollout_ranks`` only on one_step_off and ``pipe`` only where RolloutPipe composes (sync, tail).
On the command line the union is a subcommand, ``schedule:tail --schedule.eta-prompts 1.5``; a
``--schedule.*`` flag alone applies to the preset's policy. In a TOML preset it is a table with a
``policy`` key: ``[schedule] policy = "tail"``.

``pipe``: RolloutPipe on top of sync or tail: a fixed rollout pool (the first half of the replicas)
and train pool (the rest); each complete, scored group goes FIFO to the train pool as it
materializes (complete-group pipelining), and engines admit the requests of the earliest groups
first (frontier-group dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Union

import tyro


@dataclass(kw_only=True)
class _Policy:
    name: ClassVar[str]
    filter_zero_variance: bool = False
    """Dynamic sampling (DAPO): do not train or queue prompts whose group rewards are all equal."""


@dataclass(kw_only=True)
class SyncConfig(_Policy):
    """sync: the veRL baseline, P0 prompts x R0 responses, rollout waits for the longest."""

    name: ClassVar[str] = "sync"
    pipe: bool = False
    """RolloutPipe on top: fixed rollout and train pools (see rollpacker.schedule.config)."""


@dataclass(kw_only=True)
class TailConfig(_Policy):
    """tail: RollPacker's tail batching, speculative short rounds and a long-prompt queue."""

    name: ClassVar[str] = "tail"
    eta_prompts: float = 1.25
    """η_P: short rounds launch ⌈η_P·P0⌉ prompts (1 = no prompt speculation)."""
    eta_responses: float = 1.25
    """η_R: short rounds launch ⌈η_R·R0⌉ responses per prompt (1 = no response speculation)."""
    pipe: bool = False
    """RolloutPipe on top: fixed rollout and train pools (see rollpacker.schedule.config)."""

    def __post_init__(self) -> None:
        if self.eta_prompts < 1 or self.eta_responses < 1:
            raise ValueError(f"schedule.eta_prompts={self.eta_prompts} and schedule.eta_responses="
                             f"{self.eta_responses} must be >= 1")


@dataclass(kw_only=True)
class _Loaded(_Policy):
    sorted_batches: int = 4
    """n: update batches of P0 prompts loaded at once (a load group); no more until all are consumed."""

    def __post_init__(self) -> None:
        if self.sorted_batches < 1:
            raise ValueError(f"schedule.sorted_batches must be >= 1, got {self.sorted_batches}")


@dataclass(kw_only=True)
class SortedConfig(_Loaded):
    """sorted: SortedRL on-policy, unfinished responses are generated afresh."""

    name: ClassVar[str] = "sorted"


@dataclass(kw_only=True)
class SortedPartialConfig(_Loaded):
    """sorted_partial: SortedRL resuming partial responses (off-policy: needs a train.rollout_correction)."""

    name: ClassVar[str] = "sorted_partial"


@dataclass(kw_only=True)
class OneStepOffConfig(_Policy):
    """one_step_off: verl's recipe, a rollout pool generates batch k+1 while a training pool trains batch k."""

    name: ClassVar[str] = "one_step_off"
    rollout_ranks: int = 0
    """The ranks that roll out (the first ones, the controller among them); the others train. 0 = half."""

    def __post_init__(self) -> None:
        if self.rollout_ranks < 0:
            raise ValueError(f"schedule.rollout_ranks must be >= 0, got {self.rollout_ranks}")


POLICY_CONFIGS: dict[str, type[_Policy]] = {c.name: c for c in (
    SyncConfig, TailConfig, SortedConfig, SortedPartialConfig, OneStepOffConfig)}
"""Every policy's settings class by name (the registry of rollpacker.schedule.build_policy)."""

ScheduleConfig = Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in POLICY_CONFIGS.items())]
"""The policy of a run: one of POLICY_CONFIGS' classes (a ``schedule:NAME`` subcommand on the CLI)."""


def schedule_config(values: dict, where: str = "schedule") -> _Policy:
    """A policy's settings from a ``{"policy": name, **settings}`` table, refusing what does not apply."""
    values = dict(values)
    name = values.pop("policy", "sync")
    if name not in POLICY_CONFIGS:
        raise ValueError(f"{where}.policy must be one of {', '.join(POLICY_CONFIGS)}, got {name!r}")
    check_settings(name, values, where)
    return POLICY_CONFIGS[name](**values)


def check_settings(policy: str, keys, where: str = "schedule") -> None:
    """Refuse a setting that policy ``policy`` does not have, naming the policies that do have it."""
    cls = POLICY_CONFIGS[policy]
    fields = cls.__dataclass_fields__
    for key in keys:
        if key not in fields:
            owners = [n for n, c in POLICY_CONFIGS.items() if key in c.__dataclass_fields__]
            raise ValueError(f"{where}.{key} does not apply to policy {cls.name}" + (
                f" (it is a setting of {', '.join(owners)})" if owners else f" (its settings: {', '.join(fields)})"))


def policy_args(args: list[str], preset_policy: str) -> list[str]:
    """``args`` with the policy subcommand first: the old ``--policy NAME`` read as ``schedule:NAME``,
    and every ``--schedule.*`` flag checked against the chosen policy, so that a setting of another
    policy is refused naming the policies it belongs to."""
    args = list(args)
    for i, arg in enumerate(args):
        if arg == "--policy" and i + 1 < len(args):
            args[i:i + 2] = [f"schedule:{args[i + 1]}"]
            break
        if arg.startswith("--policy="):
            args[i] = f"schedule:{arg.split('=', 1)[1]}"
            break
    chosen = [a for a in args if a.startswith("schedule:")]
    policy = chosen[-1].removeprefix("schedule:").replace("-", "_") if chosen else preset_policy
    if policy not in POLICY_CONFIGS:
        raise SystemExit(f"schedule:{policy}: no such policy (policies: {', '.join(POLICY_CONFIGS)})")
    flags = {a.split("=", 1)[0].removeprefix("--schedule.").replace("-", "_") for a in args
             if a.startswith("--schedule.")}
    try:
        check_settings(policy, [f.removeprefix("no_") for f in flags])
    except ValueError as e:
        raise SystemExit(f"{e}; choose that policy with schedule:NAME") from None
    return [*chosen[-1:], *(a for a in args if not a.startswith("schedule:"))]
