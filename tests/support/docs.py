"""The example policy of ``docs/extending.md`` and the command that runs it out of tree, read from
the page itself, so that the tests run exactly what the page shows."""

from __future__ import annotations

import sys
import types
from pathlib import Path

PAGE = Path(__file__).resolve().parents[2] / "docs" / "extending.md"
MODULE = "rollpacker_docs_example"


def _block(name: str) -> str:
    return PAGE.read_text().split(f"<!-- example {name}: start -->")[1].split(f"<!-- example {name}: end -->")[0]


def example_code() -> str:
    """The page's example module, as text."""
    return _block("policy").split("```python\n", 1)[1].rsplit("```", 1)[0]


def example_command() -> list[str]:
    """The flags of the page's command that runs the example out of tree (what follows ``rollpacker.run``)."""
    line = next(line for line in _block("command").splitlines() if "rollpacker.run" in line)
    return line.split("rollpacker.run", 1)[1].split()


def example_policy() -> types.ModuleType:
    """The page's example module (``FifoConfig``, ``FifoPolicy``), imported once."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    code = example_code()
    module = types.ModuleType(MODULE)
    module.__file__ = str(PAGE)
    sys.modules[MODULE] = module  # dataclasses resolve the module's annotations through sys.modules
    exec(compile(code, str(PAGE), "exec"), module.__dict__)
    return module
