"""The layers point one way: the trainer never imports its tools (the simulator, the benchmarks),
the simulator does not import the benchmarks, and the kernels stand alone."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("rollpacker.sim", "rollpacker.bench")
"""Packages that measure or model the trainer; nothing else may import them."""


@cache
def imports(package: str) -> dict[str, set[str]]:
    """Every module of ``package`` and what it imports, inside functions too."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        found[module] = names
    return found


def offenders(modules: dict[str, set[str]], banned: tuple[str, ...]) -> list[str]:
    return [f"{module} imports {name}" for module, names in modules.items() for name in sorted(names)
            if any(name == b or name.startswith(b + ".") for b in banned)]


def test_production_modules_never_import_the_simulator_or_the_benchmarks():
    production = {m: names for m, names in imports("rollpacker").items()
                  if not any(m == t or m.startswith(t + ".") for t in TOOLS)}
    assert len(production) > 50  # the walk found the package
    assert offenders(production, TOOLS) == [], (
        "a production module imports a tool: move what it needs into the core (as rollpacker.data.lengths, "
        "rollpacker.jobflags) and have the tool import it from there")


def test_the_simulator_does_not_import_the_benchmarks():
    sim = {m: names for m, names in imports("rollpacker").items() if m.startswith("rollpacker.sim")}
    assert offenders(sim, ("rollpacker.bench",)) == [], "shared job flags belong in rollpacker.jobflags"


@pytest.mark.parametrize(("package", "banned"), [("rollpacker_kernels", ("rollpacker",)),
                                                 ("rollpacker/data", ("rollpacker.reward",))])
def test_lower_layers_do_not_import_upper_ones(package, banned):
    modules = imports(package)
    assert modules and offenders(modules, banned) == []
