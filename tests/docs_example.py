"""The example policy of ``docs/extending.md``, loaded from the page itself, so that the tests run
exactly what the page shows."""

from __future__ import annotations

import sys
import types
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "extending.md"
MODULE = "rollpacker_docs_example"


def example_policy() -> types.ModuleType:
    """The page's example module (``FifoConfig``, ``FifoPolicy``), imported once."""
    if MODULE in sys.modules:
        return sys.modules[MODULE]
    text = PAGE.read_text()
    block = text.split("<!-- example policy: start -->")[1].split("<!-- example policy: end -->")[0]
    code = block.split("```python\n", 1)[1].rsplit("```", 1)[0]
    module = types.ModuleType(MODULE)
    module.__file__ = str(PAGE)
    sys.modules[MODULE] = module  # dataclasses resolve the module's annotations through sys.modules
    exec(compile(code, str(PAGE), "exec"), module.__dict__)
    return module
