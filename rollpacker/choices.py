"""The checks every path that builds a config runs: its choice fields, and the settings nothing reads.

A config dataclass calls :func:`check_choices` first thing in its ``__post_init__``, so a value
outside a ``Literal`` is refused the same way from a flag (tyro checks it first), a TOML preset and
Python. The choices are read from the annotations, so the message cannot drift from the type.
:func:`refuse_unused` refuses a setting given where the settings around it leave it unread.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from functools import cache
from typing import Any, Literal, get_args, get_origin, get_type_hints


@cache
def choices(cls: type) -> dict[str, tuple[Any, ...]]:
    """The ``Literal`` fields of dataclass ``cls`` and their values."""
    hints = get_type_hints(cls)
    return {f.name: get_args(hints[f.name]) for f in dataclasses.fields(cls) if get_origin(hints[f.name]) is Literal}


def check_choices(config: Any, where: str) -> None:
    """Raise a ValueError naming ``where.field`` when a ``Literal`` field holds another value."""
    for name, allowed in choices(type(config)).items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"{where}.{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def refuse_unused(settings: Iterable[tuple[Any, str, bool, str]]) -> None:
    """Refuse the settings given away from their default where nothing reads them, one message for all: each of
    ``settings`` is ``(config, "section.name", read, what it is read with)`` (a clip_ratio_c ported from verl under
    another loss, a stream.criterion without stream.enabled: each did nothing, unsaid)."""
    unused = []
    for config, path, read, needs in settings:
        name = path.rpartition(".")[2]
        if not read and getattr(config, name) != _default(config, name):
            unused.append(f"{path} (applies with {needs})")
    if unused:
        raise ValueError(f"{', '.join(unused)}: given, but nothing reads it here; set what it applies with, or "
                         "leave it out")


def _default(config: Any, name: str) -> Any:
    """The default of ``config``'s setting ``name``."""
    f = next(f for f in dataclasses.fields(config) if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
