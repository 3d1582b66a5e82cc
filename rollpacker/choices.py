"""The one check of a config's choice fields (``Literal``), run by every path that builds a config.

A config dataclass calls :func:`check_choices` first thing in its ``__post_init__``, so a value
outside a ``Literal`` is refused the same way from a flag (tyro checks it first), a TOML preset and
Python. The choices are read from the annotations, so the message cannot drift from the type.
"""

from __future__ import annotations

import dataclasses
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
