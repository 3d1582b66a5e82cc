"""The environment contract: gymnasium's API over text, so an existing environment runs unchanged.

``env.factory`` names ``make_env(row: dict)`` (a function, or a class taking the row), which returns
a fresh environment for one episode:

- ``reset(*, seed: int, options: dict) -> (observation, info)``: ``options["row"]`` is the dataset
  row, ``options["max_turns"]`` is ``env.max_turns``. The observation is the episode's prompt: None
  for the row's own, else a string or chat messages, encoded as a row's prompt is
  (:func:`rollpacker.data.chat.encode`). ``info["tools"]``, if given, are tool schemas for the chat
  template's ``tools``.
- ``step(action: str) -> (observation, reward, terminated, truncated, info)``: ``action`` is the
  model's turn as text; the observation is appended to the conversation: a string (one message of
  ``env.observation_role``), a list of chat messages, or None / [] for nothing. ``reward`` (a
  number or None) is this step's, placed on the last token of the action.
- optional ``close()``, called when the episode ends or is aborted.

An adapter's environment may also score an episode that a token limit ended (no step of its ended
it): ``finishes`` true, and ``finish() -> reward or None`` (:class:`~rollpacker.env.trl.TRLEnv`'s
``get_reward``).

Any of them may be ``async def``. What they return is checked here: anything else is a
:class:`BadReturn` naming what came back, which the workers report as the environment's error.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollpacker.env.parsers import tool_functions
from rollpacker.errors import UserError
from rollpacker.imports import accepted, awaited, load, short
from rollpacker.reward.functions import is_number

Message = dict[str, Any]
"""A chat message: ``{"role": str, "content": str, ...}`` (a tool message may carry ``tool_call_id``, ``name``)."""


class EnvError(UserError):
    """An environment that cannot be loaded, or failed on a row; the message names both and the cause."""


class BadReturn(Exception):
    """An environment returned something the contract does not allow; the message says what."""


@dataclass(frozen=True)
class EnvCall:
    """One call on an episode's environment, for the workers (:class:`~rollpacker.env.workers.EnvPool`)."""

    kind: str
    """``open`` (make the environment for ``row``, reset it with ``seed``), ``step`` (with ``action``), ``finish``
    (the environment's reward for an episode a token limit ended) or ``close``."""
    key: str
    """The episode: its round request id."""
    row: int = -1
    seed: int = 0
    action: str = ""


@dataclass
class EnvReply:
    """The outcome of one call on an episode's environment."""

    key: Hashable
    kind: str
    """``open`` (make and reset), ``step``, ``finish`` or ``close``."""
    value: Any = None
    """open: ``(prompt or None, info)``; step: a :class:`StepResult`; finish: a reward or None; close: None."""
    error: str | None = None
    """Set when the call failed; names the environment, the row and the cause."""
    seconds: float = 0.0
    """Wall time of the call in its worker (queueing excluded)."""
    state: Any = None
    """After an open or a step, a copy of the environment for reward functions that take ``environments``
    (:class:`~rollpacker.env.trl.EnvState`, TRL's environments); else None."""
    finishes: bool = False
    """After an open: the environment scores an episode that a token limit ends (:func:`finish`)."""
    retries: int = 0
    """An open's: how many times it was tried again (``env.reset_retries``) before this outcome."""


@dataclass
class StepResult:
    """One step, checked."""

    observation: list[Message]
    """Messages to append (empty: none)."""
    reward: float | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict = field(default_factory=dict)


def make(target: str, row: dict):
    """A fresh environment for ``row`` from the factory ``target`` (a function or class)."""
    return load(target, "env.factory", EnvError)(row)


def reset(env, *, seed: int, row: dict, max_turns: int | None = None) -> tuple[str | list[Message] | None, dict]:
    """``env.reset`` called and checked: ``(prompt or None, info)``; ``max_turns``: ``env.max_turns``."""
    if not (callable(getattr(env, "reset", None)) and callable(getattr(env, "step", None))):
        raise BadReturn(f"the factory returned {_what(env)}, which has no reset and step: it returns the episode's "
                        "environment (gymnasium's API: reset(*, seed, options), step(action))")
    options = {"row": row, "max_turns": max_turns}
    if len(accepted(env.reset, {"seed": seed, "options": options})) < 2:
        raise BadReturn("its reset takes no seed and options: gymnasium's is reset(*, seed=None, options=None) "
                        "(gym before 0.26 had reset())")
    value = awaited(env.reset(seed=seed, options=options))
    if not isinstance(value, tuple) or len(value) != 2:
        trl = " (a TRL environment's reset returns a string or None: its class takes no argument)" if isinstance(
            value, str) or value is None else ""
        raise BadReturn(f"reset returned {_what(value)}; gymnasium's reset returns (observation, info){trl}")
    observation, info = value
    if observation is not None and not isinstance(observation, str):
        observation = messages(observation, "user", "reset")
        if not observation:
            raise BadReturn("reset returned no messages; give the episode's prompt (a string or chat messages), or "
                            "None to keep the row's")
    info = _info(info, "reset")
    if "tools" in info and not (isinstance(info["tools"], list) and all(isinstance(t, dict) for t in info["tools"])):
        raise BadReturn(f"reset's info['tools'] is {_what(info['tools'])}; give a list of tool schemas (dicts)")
    if unnamed := [t for t in info.get("tools", ()) if not tool_functions([t])]:
        raise BadReturn(f"reset's info['tools'] holds {short(unnamed[0])}, a schema without a function name; give "
                        "each as {'type': 'function', 'function': {'name': ..., 'parameters': ...}}")
    return observation, info


def step(env, action: str, role: str = "user") -> StepResult:
    """``env.step(action)`` called and checked."""
    value = awaited(env.step(action))
    if not isinstance(value, tuple) or len(value) != 5:
        raise BadReturn(f"step returned {_what(value)}; gymnasium's step returns (observation, reward, terminated, "
                        "truncated, info)")
    observation, reward, terminated, truncated, info = value
    reward = _reward(reward, "step")
    for name, flag in (("terminated", terminated), ("truncated", truncated)):
        if not isinstance(flag, (bool, numbers.Integral)) and type(flag).__name__ not in ("bool", "bool_"):  # numpy's
            raise BadReturn(f"step returned {name}={short(flag)}; expected a bool")
    return StepResult(messages(observation, role, "step"), reward, bool(terminated), bool(truncated),
                      _info(info, "step"))


def finishes(env) -> bool:
    """Whether ``env`` scores an episode that a token limit ended (:func:`finish`)."""
    return bool(getattr(env, "finishes", False))


def finish(env) -> float | None:
    """``env.finish()`` called and checked: its reward for an episode that a token limit ended."""
    return _reward(awaited(env.finish()), "finish")


def number(value) -> float | None:
    """``value`` as a float where it is a number (:func:`~rollpacker.reward.functions.is_number`), else None."""
    return float(value) if is_number(value) else None


def _reward(reward, where: str) -> float | None:
    if reward is None:
        return None
    value = number(reward)
    if value is None or not math.isfinite(value):
        raise BadReturn(f"{where} returned reward {short(reward)}; expected a finite number or None")
    return value


def close(env) -> None:
    """``env.close()`` if it has one."""
    if callable(getattr(env, "close", None)):
        awaited(env.close())


def messages(observation, role: str, where: str) -> list[Message]:
    """An observation as chat messages: a string is one message of ``role``; None is none."""
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": role, "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if not isinstance(observation, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation):
        raise BadReturn(f"{where} returned observation {_what(observation)}; expected a string, None or a list of "
                        'chat messages {"role": str, "content": str}')
    return [dict(m) for m in observation]


def _info(info, where: str) -> dict:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise BadReturn(f"{where} returned info {_what(info)}; expected a dict")
    return {str(k): v for k, v in info.items()}  # env/info/KEY: a key of another type (0) beside a str one is its text


def _what(value) -> str:
    if isinstance(value, tuple):
        return f"a tuple of {len(value)} {short(value)}"
    return f"{type(value).__name__} {short(value)}"
