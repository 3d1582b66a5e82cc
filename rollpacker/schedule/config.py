"""The registry of scheduling policies: their settings as one tagged union (no torch import here:
configs parse before heavy imports).

Each policy's settings class lives beside the policy (:class:`~rollpacker.schedule.base.PolicyConfig`
in ``schedule/<policy>.py``) and holds exactly the settings that apply to it, so which settings
combine is the type: ``eta_*`` exist only on tail, ``sorted_batches`` only on the SortedRL policies,
``rollout_ranks`` only on one_step_off and ``pipe`` only where RolloutPipe composes (sync, tail).
:data:`POLICY_CONFIGS` lists them; the union, the ``schedule:NAME`` subcommands of ``--help`` and
the names a preset may use all follow from it. On the command line the union is a subcommand,
``schedule:tail --schedule.eta-prompts 1.5``; a ``--schedule.*`` flag alone applies to the preset's
policy. In a TOML preset it is a table with a ``policy`` key: ``[schedule] policy = "tail"``.

``pipe``: RolloutPipe on top of sync or tail: a fixed rollout pool (the first half of the replicas)
and train pool (the rest); each complete, scored group goes FIFO to the train pool as it
materializes (complete-group pipelining), and engines admit the requests of the earliest groups
first (frontier-group dispatch). It composes only with policies whose complete groups are final
when they complete: SortedRL's partial mode resumes responses under newer weights, its
oversubscription would be undone by frontier-group dispatch, and a policy with pools of its own
already trains apart.
"""

from __future__ import annotations

from typing import Annotated, Union

import tyro

from rollpacker.schedule.base import PolicyConfig
from rollpacker.schedule.one_step_off import OneStepOffConfig
from rollpacker.schedule.sorted import SortedConfig, SortedPartialConfig
from rollpacker.schedule.sync import SyncConfig
from rollpacker.schedule.tail import TailConfig

POLICY_CONFIGS: dict[str, type[PolicyConfig]] = {c.name: c for c in (
    SyncConfig, TailConfig, SortedConfig, SortedPartialConfig, OneStepOffConfig)}
"""Every policy's settings class by name: a new policy is one entry here (``docs/extending.md``)."""

ScheduleConfig = Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in POLICY_CONFIGS.items())]
"""The policy of a run: one of POLICY_CONFIGS' classes (a ``schedule:NAME`` subcommand on the CLI)."""


def names(where=lambda c: True) -> list[str]:
    """The names of the registered policies whose settings class satisfies ``where``."""
    return [name for name, c in POLICY_CONFIGS.items() if where(c)]


def schedule_config(values: dict, where: str = "schedule") -> PolicyConfig:
    """A policy's settings from a ``{"policy": name, **settings}`` table, refusing what does not apply."""
    values = dict(values)
    name = values.pop("policy", SyncConfig.name)
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
            owners = names(lambda c: key in c.__dataclass_fields__)
            raise ValueError(f"{where}.{key} does not apply to policy {cls.name}" + (
                f" (it is a setting of {', '.join(owners)})" if owners else f" (its settings: {', '.join(fields)})"))


def schedule_args(args: list[str], preset_policy: str) -> list[str]:
    """``args`` with the policy subcommand first, and every ``--schedule.*`` flag checked against the
    chosen policy, so that a setting of another policy is refused naming the policies it belongs to."""
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
