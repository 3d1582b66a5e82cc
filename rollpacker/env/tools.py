"""Tools as plain Python functions (TRL's ``tools=[fn]`` convention), and the environment that runs them.

``env.tools`` lists functions with type hints and a Google-style docstring; their JSON schemas
(transformers' ``get_json_schema``) go to the chat template's ``tools``. Each model turn is
parsed for tool calls by ``env.tool_parser`` (:mod:`rollpacker.env.parsers`). :class:`ToolEnv` is
the environment that runs them, itself an environment of the contract
(:mod:`rollpacker.env.contract`), wrapped around the user's environment or none:

- a turn with tool calls: each call runs (``async def`` too) and its result comes back as a
  ``tool`` message; a call that cannot be parsed, names no tool, or raises is answered with an
  ``error: ...`` tool message (the model's mistake, not the environment's), cut to
  ``env.max_tool_result_chars`` as a result is. The environment is not stepped: a call to one of
  its own tools in such a turn is answered with an error saying to call it in a turn of its own.
  The calls of the last turn ``env.max_turns`` allows (reset's ``options["max_turns"]``) do not
  run: no turn would read their results (verl's and TRL's loops stop there too);
- a turn without one is the model's answer: it steps the wrapped environment, or, with tools
  alone, ends the episode (``reward.funcs`` score it). So does a turn whose calls name none of
  ``env.tools`` when the wrapped environment has tools of its own (its reset's ``info["tools"]``:
  a verifiers ``ToolEnv``'s): those calls are its to run.

The calls run in the environment's worker, one after another, within ``env.timeout`` for the whole turn
(less :data:`MARGIN`, for the reply): an ``async def`` tool still running then is cancelled and answered
``error: ... timed out``, and the calls after it are not run, so the worker replies in time and its other
episodes go on. The built-in ``python`` runs code in the code sandbox (:mod:`rollpacker.reward.sandbox`)
for at most :data:`PYTHON_TIMEOUT` and what is left of the turn. A plain ``def`` tool runs in the worker's
main thread (as its library expects: ``signal.alarm`` works there), so one that hangs is killed with its
worker, and the worker's episodes fail.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from typing import Any, Callable

from rollpacker.env import contract
from rollpacker.env.config import TOOLS, EnvConfig
from rollpacker.env.contract import EnvError
from rollpacker.env.parsers import PARSERS, ToolCall, hermes, tool_functions  # noqa: F401  (hermes: imported from here too)
from rollpacker.imports import awaited, load, target
from rollpacker.workers import Retired

PYTHON_TIMEOUT = 10.0
"""Wall-clock seconds the built-in ``python`` tool gives a program (at most: what is left of the turn)."""
MARGIN = 1.0
"""Seconds of ``env.timeout`` a turn's calls leave for the reply to reach the pool (at most a fifth of it)."""
_deadline = float("inf")
"""When the running turn's calls must be done (``time.monotonic()``; a worker runs one call at a time)."""


def load_tools(specs: tuple[str, ...]) -> dict[str, Callable]:
    """``env.tools`` imported, by function name (an :class:`EnvError` if one cannot be, or two share a name)."""
    tools: dict[str, Callable] = {}
    for spec in specs:
        fn = load(target(spec, TOOLS), "env.tools", EnvError)
        name = getattr(fn, "__name__", spec)
        if name in tools:
            raise EnvError(f"env.tools: two tools are named {name!r}; a tool's name is its function's")
        tools[name] = fn
    return tools


def schemas(tools: dict[str, Callable], where: str = "env.tools") -> list[dict]:
    """Each tool's JSON schema, for the chat template; an :class:`EnvError` naming ``where`` says what a function
    lacks."""
    from transformers.utils import get_json_schema

    out = []
    for name, fn in tools.items():
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # noqa: BLE001  (transformers' DocstringParsingException, TypeHintParsingException)
            raise EnvError(f"{where}: {name}: no JSON schema from its signature and docstring ({e}). A tool needs "
                           "type hints on every argument and a Google-style docstring with an Args: section") from None
    return out


class ToolEnv:
    """An environment that runs the model's tool calls, around ``inner`` (an environment, or None: tools alone)."""

    def __init__(self, tools: dict[str, Callable], parser: str = "hermes", inner: Any = None, where: str = "env.tools",
                 *, max_result_chars: int = EnvConfig.max_tool_result_chars, timeout: float = EnvConfig.timeout):
        self.tools, self.parse, self.inner = tools, PARSERS[parser], inner
        self.max_result_chars = max_result_chars
        """``env.max_tool_result_chars``: longer results are cut in their middle (0: no limit)."""
        self.timeout = timeout
        """``env.timeout``: a turn's calls answer within it, less :data:`MARGIN`."""
        self.schemas = schemas(tools, where)
        """The tools' JSON schemas: the chat template's, and the parser's (qwen3_coder types arguments by them)."""
        self.inner_tools: list[dict] = []
        """The wrapped environment's own tools' schemas, from its reset."""
        self.inner_names: set[str] = set()
        """Their names: a call to one in a turn with calls to ``tools`` is the model's mistake, named as such."""
        self.turns_left = -1
        """The episode's turns after the next step's (its reset's ``max_turns`` less 1 and the steps since;
        negative: no limit)."""

    def reset(self, *, seed: int, options: dict):
        self.turns_left = (options.get("max_turns") or 0) - 1
        observation, info = (None, {}) if self.inner is None else contract.reset(
            self.inner, seed=seed, row=options["row"], max_turns=options.get("max_turns"))
        info = dict(info)
        self.inner_tools = list(info.get("tools", []))
        self.inner_names = {fn["name"] for fn in tool_functions(self.inner_tools)}
        info["tools"] = [*self.inner_tools, *self.schemas]
        return observation, info

    def step(self, action: str):
        last, self.turns_left = self.turns_left == 0, self.turns_left - 1
        calls = self.parse(action, [*self.inner_tools, *self.schemas])
        if not calls or (self.inner_tools and not any(c.name in self.tools for c in calls)):
            if self.inner is None:
                return None, None, True, False, {}
            return invoke(self.inner.step, action)
        if last:  # the episode ends after this turn (max_turns): nobody would read the results
            return None, None, False, False, {}
        global _deadline
        _deadline = time.monotonic() + self.timeout - min(MARGIN, self.timeout / 5)
        try:
            results = [self._run(call) for call in calls]
        finally:
            _deadline = float("inf")
        return ([{"role": "tool", "name": c.name or "unknown", "tool_call_id": c.id, "content": self._cut(text)}
                 for c, (text, _) in zip(calls, results)], None, False, False,
                {"tool_calls": len(calls), "tool_errors": sum(failed for _, failed in results)})

    def close(self):
        if self.inner is not None and callable(getattr(self.inner, "close", None)):
            invoke(self.inner.close)

    # the wrapped environment's scoring hooks (a verifiers environment's: rollpacker.env.contract), passed on

    @property
    def finishes(self) -> bool:
        return contract.finishes(self.inner)

    def finish(self):
        return self.inner.finish()

    @property
    def unscored_alone(self) -> str | None:
        return getattr(self.inner, "unscored_alone", None)

    def reward_state(self):
        make = getattr(self.inner, "reward_state", None)
        return make() if callable(make) else None

    def _run(self, call: ToolCall) -> tuple[str, bool]:
        """The tool message's text, uncut, and whether the call failed (a result may begin with "error: " too)."""
        if call.error:
            return f"error: {call.error}", True
        fn = self.tools.get(call.name)
        if fn is None and call.name in self.inner_names:  # the wrapped environment steps on a turn of its calls alone
            return (f"error: {call.name} is the environment's tool: call it in a turn of its own, without calls to "
                    f"{', '.join(self.tools)}"), True
        if fn is None:
            return f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})", True
        if time_left() <= 0:
            return f"error: not run: this turn's calls took their {self.timeout:g} s (env.timeout)", True
        try:
            value = invoke(asyncio.wait_for, fn(**call.arguments), time_left()) if inspect.iscoroutinefunction(
                fn) else invoke(fn, **call.arguments)
        except Retired:
            raise
        except (Exception, SystemExit) as e:  # noqa: BLE001  (the tool's own error, sys.exit() too, is the model's answer)
            if isinstance(e, (TimeoutError, asyncio.TimeoutError)) and time_left() <= 0:  # wait_for's
                return f"error: {call.name} timed out: this turn's calls have {self.timeout:g} s (env.timeout)", True
            return f"error: {type(e).__name__}: {e}", True
        try:
            text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)  # "東京"
            return text, isinstance(value, Failed)
        except Exception as e:  # noqa: BLE001  (circular, too deep, keys JSON cannot hold, a str() that raises: the tool's)
            return f"error: {call.name} returned {type(value).__name__} that JSON cannot write ({e})", True

    def _cut(self, text: str) -> str:
        """``text``, or its first and last ``max_result_chars`` / 2 characters around a marker of how many were cut."""
        limit = self.max_result_chars
        if not limit or len(text) <= limit:
            return text
        head = limit // 2
        return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - head):]}"


class Failed(str):
    """A tool's result that reports a failure in its own words (a program that raised, or ran out of time): the
    model reads it as it is, and ``tool_errors`` counts it."""


def time_left() -> float:
    """Seconds the running turn's calls have left (inf outside a turn)."""
    return _deadline - time.monotonic()


def invoke(fn, *args, **kwargs):
    """``fn(...)``, awaited on the worker's event loop if it returns an awaitable. Plain code, not a coroutine:
    a plain ``def`` (a tool, an environment's ``step``) runs outside any running loop, as its library calls it,
    so it may run a loop of its own (``asyncio.run``)."""
    return awaited(fn(*args, **kwargs))


python_sandbox: Any = None
"""The :class:`~rollpacker.reward.sandbox.SandboxConfig` the built-in ``python`` runs under (``reward.sandbox``, set
in each environment worker; None: the defaults)."""


def python(code: str) -> str:
    """Run a Python program in a sandbox (no network, a private /tmp) and return what it printed.

    Args:
        code: The program's source; print what you want to see.
    """
    from rollpacker.reward.sandbox import Sandbox

    timeout = max(min(PYTHON_TIMEOUT, time_left() - 0.5), 0.1)  # the sandbox's own kill returns before the turn's
    run = Sandbox(python_sandbox).run(code, timeout=timeout)
    out = run.stdout.decode("utf-8", "replace")
    if run.timed_out:
        return Failed(f"{out}\n[timed out after {timeout:g} s]")
    if run.exit_code:
        return Failed(f"{out}{run.stderr.decode('utf-8', 'replace')[-1000:]}")
    return out

