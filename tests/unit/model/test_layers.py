"""The layers point one way: no module imports circle back (counting every import: module-level,
in-function and ``TYPE_CHECKING``), the trainer never imports its tools (the simulator, the
benchmarks), the simulator does not import the benchmarks, the exchange does not import the
trainer, and the kernels stand alone. Also the code's shape: no function over 80 lines, and no
engine named outside the engine registry (and the benchmarks, which pick engines to compare)."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
TOOLS = ("rollpacker.sim", "rollpacker.bench", "rollpacker.gpu_check")
"""Packages that measure or model the trainer; nothing else may import them."""


MAX_FUNCTION_LINES = 80
ENGINE_NAMES = ("torch", "vllm", "sglang")


@cache
def tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


@cache
def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def module_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports, anywhere in it (``from pkg import mod`` is an
    arrow to ``pkg.mod``, ``from mod import name`` one to ``mod``)."""
    mods = modules(package)

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in mods.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Import):
                targets |= {resolve(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, up level - 1 packages
                    parts = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets |= {resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base)
                            for a in node.names}
        graph[module] = targets - {"", module}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


@cache
def imports(package: str) -> dict[str, set[str]]:
    """Every module of ``package`` and what it imports, inside functions too."""
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        names = set()
        for node in ast.walk(tree(path)):
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


def test_no_import_circle_counting_every_import():
    graph = module_graph("rollpacker")
    assert len(graph) > 50 and "rollpacker.schedule.round" in graph["rollpacker.exchange"]  # the walk found them
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check can fail
    assert circles(graph) == [], (
        "modules import each other in a circle: make the lower one a leaf (move what it needs down, "
        "or state the rule by capability where the upper one already is)")


def test_the_exchange_and_the_round_do_not_import_the_trainer():
    graph = module_graph("rollpacker")
    for module in ("rollpacker.exchange", "rollpacker.schedule.round", "rollpacker.schedule.scale_down"):
        assert not {m for m in graph[module] if m.startswith("rollpacker.train") and m != "rollpacker.train.config"}


def test_no_function_is_over_80_lines():
    long = []
    for package in ("rollpacker", "rollpacker_kernels"):
        for module, path in modules(package).items():
            for node in ast.walk(tree(path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                        long.append(f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == [], f"split these into functions of at most {MAX_FUNCTION_LINES} lines: {long}"


def test_engines_are_asked_their_capabilities_not_their_names():
    """``kind == "torch"`` and the like only in the registry's package and the benchmarks."""
    named = []
    for module, path in modules("rollpacker").items():
        if module.startswith(("rollpacker.rollout", "rollpacker.bench")):
            continue
        for node in ast.walk(tree(path)):
            if isinstance(node, ast.Compare) and "kind" in ast.unparse(node.left):
                values = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in ENGINE_NAMES]
                if values:
                    named.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert named == [], f"ask an EngineKind capability (rollpacker/rollout/__init__.py) instead: {named}"
