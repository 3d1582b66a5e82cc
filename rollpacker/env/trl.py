"""TRL's ``environment_factory`` environments through the contract: ``--env.factory file.py:MyEnv`` runs them unchanged.

``env.factory`` has TRL's shape when it names a factory that takes no argument (TRL calls
``factory()``; ours take the row), or a dict of them, one picked per row by its ``environment``
column (:func:`factories`). One episode of such an environment (:class:`TRLEnv`):

- ``reset(**row)`` gets the row's columns (those it names unless it takes ``**kwargs``; not the
  ``environment`` column), after Python's ``random`` is seeded with the group's reset seed. A
  string it returns is appended to the prompt's last message: that is the episode's prompt.
- Its public methods but ``reset`` and ``get_reward`` are its tools, ``env.tools`` beside them,
  run by a :class:`~rollpacker.env.tools.ToolEnv`; their schemas come from their docstrings.
- A turn without a tool call is the answer and ends the episode. ``get_reward()``, if defined, is
  called then, or after the last turn ``env.max_turns`` allows (whose calls are not run, as TRL's
  loop leaves the calls of its last turn), or when a token limit ends the
  episode (``finish``): once per episode, however it ends, as TRL calls it. Its value is the
  episode's last step's reward, which the reward scheduler adds with weight 1.
- With :attr:`~rollpacker.env.workers.EnvSpec.states`, every call sends back a copy of the
  instance (:class:`EnvState`) for the reward functions that take ``environments``.
- An instance whose episode closed is reused by a later episode in its worker (TRL pools them too).

Why a copy: the environment lives in its worker, a reward function in a reward worker, and the
reward is composed once, on the reward side. The trade-off: ``docs/environments.md``.
"""

from __future__ import annotations

import collections
import inspect
import pickle
import random
from dataclasses import dataclass
from typing import Any, Callable

from rollpacker.env.contract import BadReturn, EnvError
from rollpacker.env.info import TOOL_INFO
from rollpacker.env.tools import ToolEnv, invoke, load_tools, schemas
from rollpacker.imports import USER_PREFIX, accepted, import_path, short

RESERVED = ("reset", "get_reward")
"""A TRL environment's public methods that are not tools."""
SELECTOR = "environment"
"""The row column that picks the environment from a dict of factories (TRL's)."""

_idle: dict[tuple[str, Any], list] = collections.defaultdict(list)
"""This worker's instances whose episodes closed, per factory: a later episode reuses one."""


def factories(factory, where: str) -> dict[Any, Callable] | None:
    """TRL's factories by environment name (one for every row: the name None) if ``factory`` has TRL's
    shape, else None (ours: it takes the row). An :class:`EnvError` naming ``where`` for a bad dict."""
    if isinstance(factory, dict):
        for name, f in factory.items():
            if not (callable(f) and _takes_nothing(f)):
                raise EnvError(f"env.factory: {where}: the dict's {name!r} is {type(f).__name__} {short(f)}; each "
                               "value must be a TRL environment: a class (or function) called with no argument")
        return dict(factory)
    return {None: factory} if _takes_nothing(factory) else None


def _takes_nothing(factory) -> bool:
    """Whether ``factory`` is called with no argument (TRL's shape); one taking ``row``, even with a default
    (``make_env(row=None)``), is ours."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): not TRL's
        return False
    return all((p.default is not p.empty and p.name != "row") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in params)


def make(spec, factories: dict[Any, Callable], row: dict) -> TRLEnv:
    """``row``'s episode of the TRL environment ``factories`` (by :func:`factories`) under ``spec`` (an
    :class:`~rollpacker.env.workers.EnvSpec`): an idle instance of its factory, or a new one."""
    name = None
    if list(factories) != [None]:
        name = row.get(SELECTOR)
        if name not in factories:
            raise EnvError(f"row {row.get('id')!r} has {SELECTOR}={short(name)}, and env.factory is a dict of the "
                           f"environments {', '.join(map(repr, factories))}: give each row an {SELECTOR!r} column "
                           "naming one")
    idle = _idle[(spec.factory, name)]
    instance = idle.pop() if idle else factories[name]()
    reset = getattr(instance, "reset", None)
    if not callable(reset) or {"seed", "options"} <= set(inspect.signature(reset).parameters):
        raise EnvError(f"{type(instance).__name__} is made with no argument, as TRL's environments are, but its reset "
                       f"{'takes seed and options, as gymnasium' if callable(reset) else 'is missing, which TRL'}'s "
                       "needs: give a TRL environment reset(**row), or our environment's factory the row: "
                       "make_env(row)")
    tools = load_tools(spec.tools)
    for method in tool_methods(instance).values():
        if method.__name__ in tools:
            raise EnvError(f"{type(instance).__name__}.{method.__name__} and env.tools share a name: rename one")
        tools[method.__name__] = method
    return TRLEnv(instance, tools, parser=spec.tool_parser, max_turns=spec.max_turns, select=name is not None,
                  factory=spec.factory, release=idle.append, max_result_chars=spec.max_tool_result_chars,
                  timeout=spec.timeout)


def tool_methods(instance) -> dict[str, Callable]:
    """The instance's tools, as TRL finds them: its class's public functions but ``reset`` and ``get_reward``
    (methods and static methods; not class methods, nor properties, which are not read), bound."""
    return {name: getattr(instance, name) for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")}


def appended(prompt, text: str):
    """``prompt`` (a string or chat messages) with ``text`` at its end: a string's, or its last message's."""
    if isinstance(prompt, str):
        return prompt + text
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + text}]


class TRLEnv:
    """One episode of the TRL environment ``instance``, with ``tools`` (its methods and ``env.tools``); see the
    module docstring. ``select``: the row's ``environment`` column picked it (not given to ``reset``);
    ``release`` takes the instance back when the episode closes."""

    def __init__(self, instance, tools: dict[str, Callable], *, parser: str, max_turns: int, select: bool,
                 factory: str, release: Callable[[Any], None], max_result_chars: int, timeout: float):
        self.instance, self.max_turns, self.select, self.factory, self.release = (instance, max_turns, select,
                                                                                  factory, release)
        self.name = type(instance).__name__
        try:
            schemas({k: tools[k] for k in tool_methods(instance).keys() & tools.keys()}, self.name)
        except EnvError as e:  # a helper method the user did not mean as a tool, most likely
            raise EnvError(f"{e} (every public method of a TRL environment but reset and get_reward is a tool, as in "
                           "TRL: start a helper's name with _ to keep it from the model)") from None
        self.tools = ToolEnv(tools, parser, where=self.name, max_result_chars=max_result_chars, timeout=timeout)
        self.turns = 0

    def reset(self, *, seed: int, options: dict):
        row = options["row"]
        _, info = self.tools.reset(seed=seed, options=options)
        columns = {k: v for k, v in row.items() if not (self.select and k == SELECTOR)}
        random.seed(seed)  # a group's episodes draw the same task
        text = invoke(self.instance.reset, **accepted(self.instance.reset, columns))
        if text is not None and not isinstance(text, str):
            raise BadReturn(f"{self.name}.reset returned {type(text).__name__} {short(text)}; TRL's reset returns "
                            "None or a string (appended to the prompt's last message)")
        return (None if text is None else appended(row["prompt"], text)), info

    def step(self, action: str):
        self.turns += 1
        last = self.turns >= self.max_turns
        if not last:
            observation, _, answered, _, info = self.tools.step(action)
        else:  # TRL runs no call of the last turn it allows: get_reward sees the state the turn found
            observation, answered, info = None, not self.tools.parse(action, self.tools.schemas), {}
        reward = None
        if (answered or last) and callable(getattr(self.instance, "get_reward", None)):
            reward = self.finish()
        return observation, reward, answered, False, {**dict.fromkeys(TOOL_INFO, 0), **info}

    @property
    def finishes(self) -> bool:
        """It scores an episode that a token limit ended: it has ``get_reward``."""
        return callable(getattr(self.instance, "get_reward", None))

    def finish(self):
        """``get_reward()``: for an episode that a token limit ended (no step of its ended it), and by the step that
        ends one. What it raises is said as its own (not the step's)."""
        try:
            return invoke(self.instance.get_reward)
        except Exception as e:  # noqa: BLE001  (the user's method: whatever it raises is the cause to show)
            raise RuntimeError(f"get_reward() raised {type(e).__name__}: {e}") from None

    def close(self) -> None:
        self.release(self.instance)

    def reward_state(self) -> EnvState:
        """A copy of the instance now, for reward functions that take ``environments``."""
        return EnvState.of(self.instance, self.factory)


@dataclass(frozen=True)
class EnvState:
    """A TRL environment's state as reward functions get it: its class and attributes, pickled in its
    worker. :meth:`restore` makes the copy, in a reward worker: an instance of the class made without
    ``__init__``, with those attributes; one that did not pickle is an :class:`Unsent` saying so."""

    module: str
    """Where ``env.factory`` lives (a file or package.module): imported before unpickling, so its classes resolve."""
    data: bytes
    """``pickle((class, attributes, {name: type name} of those that did not pickle))``."""

    @classmethod
    def of(cls, instance, factory: str) -> EnvState:
        attrs = dict(getattr(instance, "__dict__", {}))
        try:
            data = pickle.dumps((type(instance), attrs, {}))
        except Exception:  # noqa: BLE001  (some attribute does not pickle: leave those out, by name)
            kept, lost = {}, {}
            for name, value in attrs.items():
                try:
                    pickle.dumps(value)
                    kept[name] = value
                except Exception:  # noqa: BLE001
                    lost[name] = type(value).__name__
            try:
                data = pickle.dumps((type(instance), kept, lost))
            except Exception as e:  # noqa: BLE001  (the class itself)
                raise EnvError(f"{type(instance).__qualname__}: reward functions that take environments get a copy "
                               f"of it, and its class does not pickle ({type(e).__name__}: {e}): define it at the "
                               "top level of a module") from None
        return cls(factory.rpartition(":")[0], data)

    def restore(self):
        """The copy (see the class docstring)."""
        import_path(self.module, USER_PREFIX)
        kind, attrs, lost = pickle.loads(self.data)
        env = kind.__new__(kind)
        vars(env).update(attrs)
        for name, type_name in lost.items():
            vars(env)[name] = Unsent(f"{kind.__name__}.{name}", type_name)
        return env


class Unsent:
    """An attribute of a TRL environment that did not pickle, in the copy reward functions get: using it
    raises, saying why it is not there (its attributes, a call, and what the language does with it: ``if``,
    ``with``, ``len``, ``for``, ``==``, ``str``)."""

    def __init__(self, where: str, kind: str):
        self.why = (f"{where} (a {kind}) is not in the copy of the environment that reward functions get: it does "
                    "not pickle, so it stayed in the environment's worker. Keep what a reward needs in attributes "
                    "of plain data, or compute it in get_reward()")

    def __getattr__(self, name: str):
        raise AttributeError(self.why)

    def _refuse(self, *args, **kwargs):
        raise TypeError(self.why)

    __call__ = __bool__ = __len__ = __iter__ = __getitem__ = __contains__ = __eq__ = __hash__ = _refuse
    __enter__ = __exit__ = __aenter__ = __aexit__ = __str__ = __format__ = __int__ = __float__ = __index__ = _refuse

    def __repr__(self) -> str:
        return f"<Unsent: {self.why.split(' (', 1)[0]}>"
