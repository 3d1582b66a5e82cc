"""Import what a setting names: the user's code (reward functions, environments, tools) and ours.

A setting names a built-in, a module ``package.module:name`` or a file ``path/to/file.py:name``
(:func:`check_spec`, :func:`target`, :func:`load`). A file's directory goes on ``sys.path`` (its own
helper modules import as when it runs as a script), and the file is registered in ``sys.modules``
once per process under ``PREFIX_STEM_HASH`` (dataclasses and pickling look their module up there; the hash of
its path tells apart two files of one name, and a dot in a name is written ``_``).
:func:`awaited` runs what an ``async def`` returns, on the process's one event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rollpacker.errors import UserError

USER_PREFIX = "rollpacker_user"
"""The ``sys.modules`` prefix of the user's files that :func:`load` imports."""


def import_path(where: str, prefix: str) -> ModuleType:
    """The module ``where`` names: ``package.module`` or ``path/to/file.py`` (``FileNotFoundError`` if absent)."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {where}")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    stem = re.sub(r"\W", "_", path.stem)
    name = f"{prefix}_{stem}_{hashlib.sha1(bytes(path)).hexdigest()[:8]}"
    if getattr(sys.modules.get(name), "__file__", None) == str(path):  # imported once per process
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a file that failed to run is not imported
        raise
    return module


def check_spec(spec: str, setting: str, builtins: dict[str, str]) -> None:
    """Raise a ValueError naming ``setting`` unless ``spec`` is one of ``builtins`` or a well-formed reference."""
    if spec in builtins:
        return
    where, _, function = spec.rpartition(":")
    if not where or not function.isidentifier():
        raise ValueError(f"{setting}: {spec!r} is neither a built-in ({', '.join(builtins)}) nor a reference "
                         "package.module:function or path/to/file.py:function")
    if where.endswith(".py") and not Path(where).is_file():
        raise ValueError(f"{setting}: {spec!r}: no such file {where} (a path is relative to where the run starts)")


def target(spec: str, builtins: dict[str, str]) -> str:
    """``spec`` as an importable target: a built-in's, or a file reference made absolute."""
    if spec in builtins:
        return builtins[spec]
    where, _, function = spec.rpartition(":")
    return f"{Path(where).resolve()}:{function}" if where.endswith(".py") else spec


_loaded: dict[str, Any] = {}


def load(target: str, setting: str, error: type[UserError] = UserError, *, mapping: bool = False):
    """The callable ``target`` names (cached per process); an ``error`` naming ``setting`` says why it cannot be had.
    ``mapping``: a dict there will do too (TRL's dict of environment factories)."""
    if target in _loaded:
        return _loaded[target]
    where, _, name = target.rpartition(":")
    try:
        module = import_path(where, USER_PREFIX)
    except Exception as e:  # noqa: BLE001  (the user's module: whatever it raises is the cause to show)
        raise error(f"{setting}: cannot import {where}: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not (callable(fn) or mapping and isinstance(fn, dict)):
        raise error(f"{setting}: {where} has no {'function or dict' if mapping else 'function'} {name!r}"
                    f"{' (it is a ' + type(fn).__name__ + ')' if fn is not None else ''}")
    _loaded[target] = fn
    return fn


def warm_up(target: str, setting: str, *, mapping: bool = False, imported: bool = False,
            options: dict | None = None) -> str:
    """In a worker before it says ready: import ``target`` (:func:`load`) and call its ``warm_up()``, or that of the
    object it is a method of (a verifiers factory's ``score_group``), so that loading is not charged to its first
    call's timeout. Returns why it cannot be imported or its ``warm_up()`` failed ("" if neither): every call would
    meet that again (a misspelled function was each environment's open failing, retried as if transient).
    ``imported``: the job imported it already, so a failure to import here is this process's, which a call meets
    again and reports (a flaky import: the pool goes on). ``options``: the run's settings a ``warm_up()`` may check
    once, passed as the keyword arguments it takes (a verifiers factory's ``max_turns``)."""
    try:
        fn = load(target, setting, mapping=mapping)
    except UserError as e:
        return "" if imported else f"{e} (fix it, or what it imports)"
    hook = getattr(fn, "warm_up", None) or getattr(getattr(fn, "__self__", None), "warm_up", None)
    if inspect.isclass(fn) and inspect.isfunction(inspect.getattr_static(fn, "warm_up", None)):
        hook = None  # a class's own method (not a classmethod or staticmethod) is its instances' business
    try:
        if callable(hook):
            hook(**accepted(hook, options)) if options else hook()
    except Exception as e:  # noqa: BLE001  (the user's code: whatever it raises is the cause to show)
        return (f"{setting}: the warm_up() of {target.rpartition(':')[2]} ({target}) raised {type(e).__name__}: "
                f"{str(e)[:500]} (fix it, or what it loads)")
    return ""


def accepted(fn, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` takes: all of them with ``**kwargs``, else those it names."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


_loop: asyncio.AbstractEventLoop | None = None


def awaited(value):
    """``value``, awaited on this process's one event loop if it is awaitable (an ``async def`` function)."""
    global _loop
    if not inspect.isawaitable(value):
        return value
    if _loop is None:
        _loop = asyncio.new_event_loop()
    return _loop.run_until_complete(value)


def short(value) -> str:
    """``repr(value)``, cut to 60 characters, for messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
