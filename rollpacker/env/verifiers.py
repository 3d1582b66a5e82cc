"""verifiers environments (``MultiTurnEnv``, ``ToolEnv``, ``SingleTurnEnv``: its v0 API) through the contract.

A verifiers environment owns its loop and asks its client for each model turn.
:class:`VerifiersEnv` runs that loop in the environment's worker and turns it inside out: its
:class:`EpisodeClient` answers each call with the episode's next model turn, which ``step``
brings. Its rubric scores the finished rollout. A factory file holds one line::

    make_env = factory(lambda: vf.load_environment("my-env", max_turns=4))

Invariants:

- Token in, token out: verifiers sees text, and nothing is tokenized again.
- The rollout's reward is the last step's. A rollout that ended with an error fails the step.
- An episode rollpacker ends first is closed unscored: give verifiers ``env.max_turns``.
- Each rollout is scored alone (``score_rollout``): a rubric with group-level functions is refused at the first reset
  (``reward.group_funcs`` scores a group, outside the environment).

Why: a verifiers environment then trains unchanged. How the loop runs: ``docs/environments.md``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable

import verifiers as vf
from verifiers.legacy.types import Response, ResponseMessage
from verifiers.legacy.types import ToolCall as VfToolCall

from rollpacker.env.tools import PARSERS


def factory(load: Callable[[], Any], parser: str = "hermes") -> Callable[[dict], VerifiersEnv]:
    """``make_env(row)`` for ``env.factory``: the environment ``load()`` returns, built once per process."""
    built: list = []

    def make_env(row: dict) -> VerifiersEnv:
        if not built:
            built.append(scored_alone(load()))
        return VerifiersEnv(built[0], row, parser=parser)

    return make_env


def scored_alone(env):
    """``env``, unless its rubric scores rollouts by group (verifiers' ``score_group``): each episode here is scored
    on its own, and ``score_rollout`` would fail each one only once it had run all its turns."""
    if env.score_rollouts and env.rubric.has_group_rewards:
        rubrics = getattr(env.rubric, "rubrics", [env.rubric])  # a RubricGroup (what environments wrap theirs in)
        names = ", ".join(f.__name__ for r in rubrics for f in r._get_group_reward_funcs())
        raise ValueError(f"the verifiers environment {type(env).__name__}'s rubric has group-level reward functions "
                         f"({names}: plural parameters such as completions, or a list returned), and rollpacker "
                         "scores each rollout alone: make them per-rollout functions (one completion, one float), or "
                         "score the group with a function of reward.group_funcs (TRL's lists over the group's "
                         "completions: docs/rewards.md)")
    return env


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

    def __init__(self, env, row: dict, *, parser: str = "hermes"):
        self.env, self.row, self.parse = env, row, PARSERS[parser]
        self._task: asyncio.Task | None = None
        self._asked: asyncio.Future | None = None
        self._answer: asyncio.Future | None = None
        self._seen: list[dict] = []

    async def reset(self, *, seed: int, options: dict):
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

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def turn(self, prompt, tools) -> Response:
        """The client's side: show the prompt, wait for the action, answer it as a verifiers Response."""
        self._answer = asyncio.get_running_loop().create_future()
        self._asked.set_result(([_message(m) for m in prompt], tools))
        text = await self._answer
        calls = [VfToolCall(id=c.id, name=c.name, arguments=json.dumps(c.arguments))
                 for c in self.parse(text, [_tool(t) for t in tools or ()]) if not c.error]
        message = ResponseMessage(content=text, tool_calls=calls or None, is_truncated=False,
                                  finish_reason="tool_calls" if calls else "stop")
        return Response(id=f"rollpacker-{id(self)}", created=int(time.time()), model="rollpacker", message=message)

    async def _rollout(self):
        prompt = self.row["prompt"]
        vf_input = {"prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                    "example_id": int(self.row.get("example_id", 0)), "answer": str(self.row.get("answer", "")),
                    "info": self.row.get("info") or {}}
        state = await self.env.rollout(vf_input, EpisodeClient(self), "rollpacker", {})
        if self.env.score_rollouts:
            await self.env.rubric.score_rollout(state)
        await self.env.rubric.cleanup(state)
        return state

    async def _next(self):
        """Run the rollout until it asks for the next turn, or ends: the step's 5-tuple."""
        await asyncio.wait({self._asked, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not self._asked.done():
            state = self._task.result()
            if state.get("error") is not None:
                raise RuntimeError(f"the verifiers rollout failed: {state['error']!r}")
            metrics = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, (int, float))}
            return None, state.get("reward"), True, False, metrics
        messages, tools = self._asked.result()
        self._asked = asyncio.get_running_loop().create_future()
        info = {"tools": [_tool(t) for t in tools]} if tools else {}
        if not self._seen:
            self._seen = messages
            return messages, None, False, False, info
        before = len(self._seen) + 1  # the turns seen, then the model's action
        if [m["role"] for m in messages[:len(self._seen)]] != [m["role"] for m in self._seen] or len(messages) < before:
            raise RuntimeError("the verifiers environment rewrote the conversation before the last turn (a non-linear "
                               "rollout): episodes append to it, token in, token out")
        self._seen = messages
        return messages[before:], None, False, False, info


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
