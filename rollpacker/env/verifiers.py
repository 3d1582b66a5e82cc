"""verifiers environments (``MultiTurnEnv``, ``ToolEnv``, ``SingleTurnEnv``: its v0 API) through the contract.

A verifiers environment owns its loop and asks its client for each model turn.
:class:`VerifiersEnv` runs that loop in the environment's worker and turns it inside out: its
:class:`EpisodeClient` answers each call with the episode's next model turn, which ``step``
brings. Its rubric scores the finished rollout. A factory file holds one line::

    make_env = factory(lambda: vf.load_environment("my-env", max_turns=4))

Invariants:

- Token in, token out: verifiers sees text, and nothing is tokenized again.
- A turn's tool calls are read by ``env.tool_parser`` (the workers give it to the factory). A call the parser cannot
  read goes to verifiers too, its error as its arguments (not JSON: verifiers answers it as a malformed call, by its
  own policy), and the model reads ``error: ...`` in that answer, counted (``tool_errors``), as in
  :class:`~rollpacker.env.tools.ToolEnv`: otherwise a turn of malformed calls would be the model's final answer.
- The rollout's reward is the last step's (by group: none; the group's, later). A rollout that ended with an error
  fails the step.
- An episode a token limit ends (``env.max_tokens``, the context) is scored as verifiers scores one whose prompt grew
  too long (``finish``: ``prompt_too_long``). ``env.max_turns`` is the ``max_turns`` of an environment that sets none
  (-1): verifiers ends its rollouts there, scored, truncated as any episode ``env.max_turns`` ends; the environment's
  own ``max_turns`` ends them as verifiers counts it, not truncated (a ``SingleTurnEnv``'s every answer, at 1). One
  whose ``max_turns`` is above it is refused as its workers start
  (rollpacker would cut its episodes unscored). Only an episode the policy aborts is closed unscored.
- A rollout is scored alone (``score_rollout``) in its worker, unless its rubric has group-level functions: then
  its group is, by the factory's ``score_group`` (a ``reward.group_funcs`` function), on copies of the group's
  finished states, in a reward worker. Such a rubric without that function configured is refused at the first
  reset: its episodes would train on no reward.

Why: a verifiers environment then trains unchanged. How the loop runs: ``docs/environments.md``.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import verifiers as vf
from verifiers.legacy.types import Response, ResponseMessage
from verifiers.legacy.types import ToolCall as VfToolCall

from rollpacker.env.config import EnvConfig
from rollpacker.env.contract import EnvError
from rollpacker.env.tools import PARSERS
from rollpacker.imports import awaited


def factory(load: Callable[[], Any], parser: str | None = None) -> Factory:
    """``make_env(row)`` for ``env.factory``: the environment ``load()`` returns, built once per process. Its tool
    calls are read by ``env.tool_parser``; ``parser`` (older) is used only where that is left at its default."""
    return Factory(load, parser)


class Factory:
    """``make_env`` (see :func:`factory`), and ``make_env.score_group``: the group-level scoring of a rubric with
    group functions, a TRL group function of the group's environments (the module docstring)."""

    takes_tool_parser = True
    """The environment workers call it with ``tool_parser=`` (``env.tool_parser``)."""

    def __init__(self, load: Callable[[], Any], parser: str | None):
        self.load, self.parser = load, parser
        self._env = None

    @property
    def env(self):
        """The environment, loaded on first use in this process."""
        if self._env is None:
            self._env = self.load()
        return self._env

    def warm_up(self, max_turns: int | None = None) -> None:
        """Load the environment: a worker calls this as it starts, before its first call's timeout runs, with
        ``env.max_turns`` (an environment worker: the limit is checked once, not at every reset)."""
        _limit_turns(self.env, max_turns)

    def __call__(self, row: dict, tool_parser: str = EnvConfig.tool_parser) -> VerifiersEnv:
        """``row``'s episode, its calls read by ``tool_parser``: ``env.tool_parser``, or the factory's ``parser``
        where that is left at its default (a factory file written before the setting reached it)."""
        parser = self.parser or tool_parser
        if parser not in PARSERS:
            raise EnvError(f"the verifiers factory's parser={parser!r} is none of {', '.join(PARSERS)}: drop it and "
                           "set env.tool_parser")
        if parser != tool_parser and tool_parser != EnvConfig.tool_parser:
            raise EnvError(f"env.tool_parser is {tool_parser!r}, and the verifiers factory reads tool calls with "
                           f"parser={self.parser!r}: drop factory(..., parser=) and set env.tool_parser alone")
        return VerifiersEnv(self.env, row, parser=parser)

    def score_group(self, environments: list, **kwargs) -> list[dict | float]:
        """verifiers' ``rubric.score_group`` on the group's finished rollouts: each one's reward, and its functions'
        values as metrics. A rollout the policy aborted (no finished state) scores 0, as when scored alone."""
        states = [e for e in environments if e is not None]
        if states:
            awaited(self.env.rubric.score_group(states))
        return [0.0 if e is None else {"score": e["reward"], **_numbers(e.get("metrics"))} for e in environments]


class EpisodeClient(vf.Client):
    """verifiers' model client, answered by the episode: ``get_response`` hands its prompt to the
    adapter and waits for the model's action (see the module docstring)."""

    def __init__(self, adapter: VerifiersEnv):
        super().__init__(adapter)

    async def get_response(self, prompt, model: str, sampling_args, tools=None, **kwargs) -> Response:
        return await self.client.turn(prompt, tools)

    # vf.Client's provider hooks: this client calls no provider
    def setup_client(self, config):
        return None

    async def to_native_tool(self, tool):
        return tool

    async def to_native_prompt(self, messages):
        return messages, {}

    async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
        raise NotImplementedError

    async def raise_from_native_response(self, response):
        return None

    async def from_native_response(self, response):
        return response

    async def close(self) -> None:
        return None


class VerifiersEnv:
    """One episode of the verifiers environment ``env`` on dataset row ``row`` (see the module docstring)."""

    finishes = True
    """It scores an episode that a token limit ended (:meth:`finish`)."""

    def __init__(self, env, row: dict, *, parser: str = "hermes"):
        self.env, self.row, self.parse = env, row, PARSERS[parser]
        self._task: asyncio.Task | None = None
        self._asked: asyncio.Future | None = None
        self._answer: asyncio.Future | None = None
        self._seen: list[dict] = []
        self._errors: dict[str, str] = {}
        """The last turn's calls the parser could not read: their answers' text, by call id."""
        self.grouped = env.score_rollouts and env.rubric.has_group_rewards
        """Its rubric scores a group (verifiers' ``score_group``): the factory's ``score_group`` does, later."""

    async def reset(self, *, seed: int, options: dict):
        _limit_turns(self.env, options.get("max_turns"))
        loop = asyncio.get_running_loop()
        self._asked = loop.create_future()
        self._task = asyncio.ensure_future(self._rollout())
        observation, _, done, _, info = await self._next()
        if done:
            raise RuntimeError("the verifiers rollout ended before asking the model anything")
        return observation, info

    async def step(self, action: str):
        self._answer.set_result(action)
        return await self._next()

    async def finish(self) -> float | None:
        """End the rollout as verifiers ends one whose next prompt is too long: its client raises
        ``OverlongPromptError`` (``prompt_too_long``, ``is_truncated``), and the rubric scores what it has."""
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(vf.OverlongPromptError("rollpacker's token limit ended the episode"))
        _, reward, terminated, truncated, _ = await self._next()
        if not (terminated or truncated):
            raise RuntimeError("the verifiers rollout asked for another turn after its prompt was too long")
        return reward

    @property
    def unscored_alone(self) -> str | None:
        """Why this environment's episodes need a reward function that takes their state, or None."""
        if not self.grouped:
            return None
        rubrics = getattr(self.env.rubric, "rubrics", [self.env.rubric])  # a RubricGroup (what environments use)
        names = ", ".join(f.__name__ for r in rubrics for f in r._get_group_reward_funcs())
        return (f"the verifiers environment {type(self.env).__name__}'s rubric scores rollouts by group ({names}: "
                "plural parameters such as completions, or a list returned), and no reward function takes the group's "
                "states: add `score_group = make_env.score_group` to the factory's file and pass --reward.funcs "
                "FILE:score_group --reward.group-funcs score_group (docs/environments.md)")

    def reward_state(self) -> RolloutCopy:
        """The rollout's state for reward functions that take ``environments``, once it is finished."""
        return RolloutCopy.of(self._task.result() if self._task is not None and self._task.done() else None)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def turn(self, prompt, tools) -> Response:
        """The client's side: show the prompt, wait for the action, answer it as a verifiers Response."""
        self._answer = asyncio.get_running_loop().create_future()
        self._asked.set_result(([_message(m) for m in prompt], tools))
        text = await self._answer
        parsed = self.parse(text, [_tool(t) for t in tools]) if tools else []  # no tools: the text is the answer
        self._errors = {c.id: f"error: {c.error}" for c in parsed if c.error}
        calls = [VfToolCall(id=c.id, name=c.name, arguments=self._errors.get(c.id) or json.dumps(c.arguments))
                 for c in parsed]
        message = ResponseMessage(content=text, tool_calls=calls or None, is_truncated=False,
                                  finish_reason="tool_calls" if calls else "stop")
        return Response(id=f"rollpacker-{id(self)}", created=int(time.time()), model="rollpacker", message=message)

    async def _rollout(self):
        state = await self.env.rollout(self._input(), EpisodeClient(self), "rollpacker", {})
        if self.env.score_rollouts and not self.grouped:
            await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        return state

    def _input(self) -> dict:
        """The row as verifiers' rollout input: every column (its rubric's functions take them by name) but our id,
        as verifiers formats a dataset's: a non-integer ``example_id`` kept as ``src_id``, no answer an empty one."""
        row = {k: v for k, v in self.row.items() if k != "id"}
        if "example_id" in row and not isinstance(row["example_id"], int):
            row["src_id"] = row.pop("example_id")
        answer = row.get("answer")
        return row | {"prompt": self._prompt(row["prompt"]), "example_id": row.get("example_id", 0),
                      "answer": "" if answer is None else str(answer), "info": row.get("info") or {}}

    def _prompt(self, prompt: str | list[dict]) -> list[dict]:
        """The row's prompt as verifiers formats its own dataset's: its ``system_prompt`` first, unless the
        prompt has one, and its ``few_shot`` turns before a string's question."""
        env = self.env
        system = [{"role": "system", "content": env.system_prompt}] if env.system_prompt else []
        if isinstance(prompt, str):
            return [*system, *(env.few_shot or []), {"role": "user", "content": prompt}]
        return prompt if prompt and prompt[0]["role"] == "system" else [*system, *prompt]

    async def _next(self):
        """Run the rollout until it asks for the next turn, or ends: the step's 5-tuple."""
        await asyncio.wait({self._asked, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not self._asked.done():
            state = self._task.result()
            if state.get("error") is not None:
                raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
            cut = bool(state.get("is_truncated")) or (state.get("stop_condition") == "max_turns_reached"
                                                      and self.env in _LIMITED)
            return None, state.get("reward"), not cut, cut, _numbers(state.get("metrics"))
        messages, tools = self._asked.result()
        self._asked = asyncio.get_running_loop().create_future()
        info = {"tools": [_tool(t) for t in tools]} if tools else {}
        if not self._seen:
            self._seen = messages
            return messages, None, False, False, info
        before = len(self._seen) + 1  # the turns seen, then the model's action
        if _turns(messages[:len(self._seen)]) != _turns(self._seen) or len(messages) < before:
            raise RuntimeError("the verifiers environment rewrote the conversation before the last turn (a non-linear "
                               "rollout): episodes append to it, token in, token out")
        self._seen = messages  # verifiers' own text: what the next turn's prompt is checked against
        observation = [{**m, "content": self._errors[m["tool_call_id"]]} if self._answers_error(m) else m
                       for m in messages[before:]]
        if tools:
            info["tool_errors"] = sum(map(self._answers_error, observation))
        return observation, None, False, False, info

    def _answers_error(self, message: dict) -> bool:
        """Whether ``message`` answers a call of the last turn that the parser could not read."""
        return message["role"] == "tool" and message.get("tool_call_id") in self._errors


_LIMITED: weakref.WeakSet = weakref.WeakSet()
"""The environments whose ``max_turns`` is ``env.max_turns`` (:func:`_limit_turns`): rollpacker's limit, which cuts."""


def _limit_turns(env, limit: int | None) -> None:
    """``env.max_turns`` (``limit``) is the ``max_turns`` of an environment that sets none, so verifiers ends its
    rollouts there (``max_turns_reached``) and scores them; one above it is refused: cut there, none would be."""
    own = getattr(env, "max_turns", None)
    if not limit or not isinstance(own, int):
        return
    if own <= 0:  # every episode of a run gets the same limit: the environment's, as if loaded with it
        env.max_turns = limit
        _LIMITED.add(env)
    elif own > limit:
        raise EnvError(f"the verifiers environment {type(env).__name__} has max_turns={own}, above "
                       f"env.max_turns={limit}: rollpacker would cut its episodes at {limit} turns, unscored; pass "
                       f"--env.max-turns {own}, or load it with max_turns={limit}")


def _turns(messages: list[dict]) -> list[tuple]:
    """What the model saw of ``messages``: who said what (an elided tool output or a replaced question is a rewrite)."""
    return [(m["role"], m.get("content")) for m in messages]


@dataclass(frozen=True)
class RolloutCopy:
    """A finished rollout's verifiers ``State``, pickled without what does not pickle (its client), or None: what
    :meth:`VerifiersEnv.reward_state` sends to the reward functions that take ``environments``."""

    data: bytes | None

    @classmethod
    def of(cls, state) -> RolloutCopy:
        if state is None:
            return cls(None)
        copy = type(state)()
        dict.update(copy, {k: v for k, v in dict.items(state) if k != "client"})  # its futures: no reward's business
        try:
            return cls(pickle.dumps(copy))
        except Exception:  # noqa: BLE001  (an environment's own object in the state: left out, by name)
            for key, value in list(dict.items(copy)):
                try:
                    pickle.dumps(value)
                except Exception:  # noqa: BLE001
                    dict.__delitem__(copy, key)
            return cls(pickle.dumps(copy))

    def restore(self):
        """The state (None: the rollout did not finish: rollpacker ended its episode first)."""
        return None if self.data is None else pickle.loads(self.data)


def _numbers(metrics: dict | None) -> dict[str, float]:
    """verifiers' metrics, the numbers among them."""
    return {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}


def _message(message) -> dict:
    """A verifiers message as a chat message dict with string content."""
    m = message.model_dump(exclude_none=True) if hasattr(message, "model_dump") else dict(message)
    if isinstance(m.get("content"), list):
        m["content"] = "".join(part.get("text", "") for part in m["content"] if isinstance(part, dict))
    m.setdefault("content", "")
    return m


def _tool(tool) -> dict:
    """A verifiers tool definition as the chat template's JSON schema."""
    t = tool.model_dump(exclude_none=True) if hasattr(tool, "model_dump") else dict(tool)
    return {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                             "parameters": t.get("parameters", {})}}
