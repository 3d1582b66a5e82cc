"""Import what a setting names: a module by dotted name, or a Python file by path.

A file's directory goes on ``sys.path`` (its own helper modules import as when it runs as a script),
and the file is registered in ``sys.modules`` once per process under ``PREFIX_STEM`` (dataclasses and
pickling look their module up there).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_path(where: str, prefix: str) -> ModuleType:
    """The module ``where`` names: ``package.module`` or ``path/to/file.py`` (``FileNotFoundError`` if absent)."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no such file {where}")
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    name = f"{prefix}_{path.stem}"
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
