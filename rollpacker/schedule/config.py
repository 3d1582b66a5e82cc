"""The registry of scheduling policies: their settings as one tagged union.

Each policy's settings class lives beside the policy
(:class:`~rollpacker.schedule.base.PolicyConfig` in ``schedule/<policy>.py``).
:data:`POLICY_CONFIGS` lists them. The union, the ``schedule:NAME`` subcommands and the names a
preset may use all follow from it. A policy outside the package is named by its settings class
(``--schedule.policy package.module:MyConfig``); :func:`register` adds it and rebuilds
:data:`ScheduleConfig`.

Invariants:

- A settings class holds exactly the settings that apply to its policy. A setting of another
  policy is refused by name.
- Nothing here imports torch: configs parse before heavy imports.

Why a union: which settings combine is then the type, checked at parse time, not by hand.
Choosing a policy and RolloutPipe's composition: ``docs/policies.md``; adding one: ``docs/extending.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Union

import tyro

from rollpacker.imports import import_path
from rollpacker.schedule.base import PolicyConfig
from rollpacker.schedule.one_step_off import OneStepOffConfig
from rollpacker.schedule.sorted import SortedConfig, SortedPartialConfig
from rollpacker.schedule.sync import SyncConfig
from rollpacker.schedule.tail import TailConfig

POLICY_CONFIGS: dict[str, type[PolicyConfig]] = {c.name: c for c in (
    SyncConfig, TailConfig, SortedConfig, SortedPartialConfig, OneStepOffConfig)}
"""Every policy's settings class by name: a new policy is one entry here (``docs/extending.md``)."""



def union() -> Any:
    """The registered policies' settings classes as one tagged union (``schedule:NAME`` subcommands)."""
    return Union[tuple(Annotated[c, tyro.conf.subcommand(name)] for name, c in POLICY_CONFIGS.items())]


ScheduleConfig = union()
"""The policy of a run: one of POLICY_CONFIGS' classes (a ``schedule:NAME`` subcommand on the CLI)."""


def register(spec: str, where: str = "schedule.policy") -> str:
    """Import the settings class ``spec`` names (``package.module:Class`` or ``path/to/file.py:Class``),
    add it to :data:`POLICY_CONFIGS` and :data:`ScheduleConfig`, and return its name."""
    global ScheduleConfig
    module_name, _, attr = spec.rpartition(":")
    if not module_name or not attr.isidentifier():
        raise ValueError(f"{where} must be one of {', '.join(POLICY_CONFIGS)} or a reference package.module:Class "
                         f"(or path/to/file.py:Class), got {spec!r}")
    try:
        module = import_path(module_name, "rollpacker_policy")
    except Exception as e:  # noqa: BLE001  (the user's module: whatever it raises is the cause to show)
        raise ValueError(f"{where}: cannot import {module_name}: {type(e).__name__}: {e}") from None
    cls = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, PolicyConfig) and isinstance(getattr(cls, "name", None), str)):
        raise ValueError(f"{where}: {spec} is not a PolicyConfig subclass with a name (docs/extending.md)")
    known = POLICY_CONFIGS.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"{where}: {spec} is named {cls.name!r}, as {known.__module__}.{known.__qualname__}: "
                         "give it a name of its own")
    POLICY_CONFIGS[cls.name] = cls
    ScheduleConfig = union()
    return cls.name


def policy_name(value: str, where: str = "schedule.policy") -> str:
    """A registered policy's name (``one-step-off`` too, as ``schedule:one-step-off`` spells it), or the name of
    the one ``value`` references (registered now)."""
    if value.replace("-", "_") in POLICY_CONFIGS:
        return value.replace("-", "_")
    return register(value, where)


def names(where=lambda c: True) -> list[str]:
    """The names of the registered policies whose settings class satisfies ``where``."""
    return [name for name, c in POLICY_CONFIGS.items() if where(c)]


def switched(preset: PolicyConfig, name: str) -> PolicyConfig:
    """A preset's policy settings when ``schedule:NAME`` chooses policy ``name`` over its policy: the settings it
    set that ``name`` has too (dynamic sampling's) carry over; its own policy's stay behind with it."""
    if name == preset.name:
        return preset
    cls, unset = POLICY_CONFIGS[name], type(preset)()
    kept = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)
            if f.init and f.name in settings(cls) and getattr(preset, f.name) != getattr(unset, f.name)}
    try:
        return cls(**kept)
    except ValueError as e:
        raise SystemExit(f"the preset's [schedule] under schedule:{name}: {e}") from None


def settings(cls: type[PolicyConfig]) -> list[str]:
    """A policy's settings: its dataclass fields, not its class constants (``name``, ``carries_responses``)."""
    return [f.name for f in dataclasses.fields(cls) if f.init]


def check_settings(policy: str, keys, where: str = "schedule") -> None:
    """Refuse a setting that policy ``policy`` does not have, naming the policies that do have it."""
    cls = POLICY_CONFIGS[policy]
    fields = settings(cls)
    for key in keys:
        if key not in fields:
            owners = names(lambda c: key in settings(c))
            raise ValueError(f"{where}.{key} does not apply to policy {cls.name}" + (
                f" (it is a setting of {', '.join(owners)})" if owners else f" (its settings: {', '.join(fields)})"))


def schedule_args(args: list[str], preset_policy: str) -> list[str]:
    """``args`` with the policy subcommand first (``--schedule.policy NAME|REF`` becomes one; the preset's policy's
    where none is chosen and a ``--schedule.*`` flag is given: tyro refused its ``--schedule.no-filter-zero-variance``
    without it), and every ``--schedule.*`` flag checked against the chosen policy, so that a setting of another
    policy is refused naming the policies it belongs to."""
    args = _policy_flag(list(args))
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
    named = chosen[-1:] or [f"schedule:{policy}"] * bool(flags)
    return [*named, *(a for a in args if not a.startswith("schedule:"))]


def _policy_flag(args: list[str]) -> list[str]:
    """``args`` with ``--schedule.policy NAME|REF`` (or ``=``) replaced by ``schedule:NAME``."""
    for i, arg in enumerate(args):
        if arg == "--schedule.policy" or arg.startswith("--schedule.policy="):
            value = arg.partition("=")[2] if "=" in arg else (args[i + 1] if i + 1 < len(args) else "")
            if not value:
                raise SystemExit("--schedule.policy needs a policy name or a reference package.module:Class")
            try:
                name = policy_name(value)
            except ValueError as e:
                raise SystemExit(str(e)) from None
            return [*args[:i], f"schedule:{name}", *args[i + (1 if "=" in arg else 2):]]
    return args
