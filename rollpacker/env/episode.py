"""One episode as a pure state machine: model turns and environment steps, token in, token out.

An :class:`Episode` holds one episode's tokens: its prompt, then each model turn exactly as
sampled, then each observation's tokens (:class:`~rollpacker.env.render.ChatBridge`), with a mask
(the model's token or not), the engine's log-probs of the model's tokens (0.0 elsewhere), and the
step rewards, each on the last token of its step's action. A driver (the round) moves it:

1. :meth:`Episode.next_turn` -> a :class:`TurnRequest`: one engine request, whose id
   (``EPISODE#TURN``) and seed (:func:`turn_seed`) are fixed by the episode and the turn, so a
   turn resumed or migrated elsewhere replays exactly;
2. the finished turn to :meth:`Episode.on_turn` -> :class:`StepEnv` (step the environment with
   this text) or :class:`Done`;
3. the environment's checked step (:class:`~rollpacker.env.contract.StepResult`) to
   :meth:`Episode.on_step` -> the next :class:`TurnRequest` or :class:`Done`.

:meth:`Episode.fail` (the environment failed: nothing of it is trained) and :meth:`Episode.abort`
(the policy ended it) end it from outside. Nothing here sends, waits or imports torch; the
environment runs elsewhere (:mod:`rollpacker.env.workers`).

An episode ends when the environment says so (``terminated``, ``truncated``), after
``max_turns`` model turns, or when a turn stops at the episode's token limit (its ``max_tokens``
model tokens, or the context length): those are truncated (``finish_reason`` "length", as a cut
single-turn response). A turn cut at its own limit (``max_new_tokens``) with the episode's budget
left is an action like any other: the environment steps on it (as verifiers' ``MultiTurnEnv``).
An observation that ends the episode is kept in :attr:`Episode.messages`, not in the tokens:
nothing follows it. The numbers in the steps' infos are summed per key (:attr:`Episode.info`: a
:class:`~rollpacker.env.tools.ToolEnv`'s ``tool_calls`` and ``tool_errors``), for the metrics.
"""

from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, field
from typing import Callable, Protocol

from rollpacker.env.contract import Message, StepResult

REASONS = ("terminated", "truncated", "max_turns", "length", "max_tokens", "context", "error", "abort")
"""Why an episode ended (:attr:`Done.reason`)."""
LENGTH_REASONS = ("length", "max_tokens", "context")
"""The reasons that cut the episode by a token limit: its ``finish_reason`` is "length"."""


def turn_seed(seed: int, turn_id: str) -> int:
    """The sampling seed of turn ``turn_id`` of a run seeded ``seed``: the round's seed of a request of that id."""
    return random.Random(f"{seed}/{turn_id}").getrandbits(63)


def reset_seed(seed: int, group: str) -> int:
    """The environment's reset seed: one per prompt group (``STEP:SLOT``), so a group's episodes start alike."""
    return random.Random(f"{seed}/reset/{group}").getrandbits(31)


@dataclass(frozen=True)
class TurnRequest:
    """One model turn to run: an engine request."""

    id: str
    """``EPISODE#TURN``."""
    prompt_ids: list[int]
    """The whole context so far."""
    max_new_tokens: int
    seed: int


@dataclass(frozen=True)
class StepEnv:
    """Step the environment with ``action``, the model's turn as text."""

    action: str


@dataclass(frozen=True)
class Done:
    reason: str
    """One of :data:`REASONS`."""
    detail: str = ""
    """What happened, for an error."""

    @property
    def finish_reason(self) -> str:
        """The episode's as one response's: "length" when cut by a token limit, "abort", "error", else "stop"."""
        if self.reason in LENGTH_REASONS:
            return "length"
        return self.reason if self.reason in ("abort", "error") else "stop"


@dataclass(kw_only=True)
class EpisodeOutput:
    """A finished (or aborted) episode as one response: what the policy, the scorer and the trainer
    get. It reads like an engine's output (``id``, ``prompt_ids``, ``token_ids``, ``logprobs``,
    ``finish_reason``), with what an episode adds."""

    id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    """Every token after the prompt: model turns and observations."""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    loss_mask: list[bool] = field(default_factory=list)
    """Per token of ``token_ids``: sampled by the model (trained) or not."""
    step_rewards: dict[int, float] = field(default_factory=dict)
    messages: list[Message] = field(default_factory=list)
    """The conversation after the prompt (each action an assistant message; each observation's messages)."""
    info: dict[str, float] = field(default_factory=dict)
    """The numbers of the environment's step infos, summed per key over the episode (:attr:`Episode.info`)."""
    num_turns: int = 0
    reason: str = ""
    """Why it ended (:data:`REASONS`); ``detail`` says more for an error."""
    detail: str = ""

    @property
    def env_reward(self) -> float:
        return sum(self.step_rewards.values())

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def turns(self, decode: Callable[[list[int]], str]) -> list[dict]:
        """The episode's tokens turn by turn, as the samples files show them: each run of model tokens
        (``role`` assistant, ``trained`` True) and of environment tokens (``role``: its observation's
        roles, ``trained`` False), with its ``text`` (``decode``) and ``tokens``. A failed episode's
        model tokens read untrained, as they are."""
        observations = [[]]  # the roles of each observation: the messages between two actions
        for m in self.messages:
            if m["role"] == "assistant":
                observations.append([])
            else:
                observations[-1].append(m["role"])
        observations = [o for o in observations[1:] if o]
        spans: list[list] = []
        for i, m in enumerate(self.loss_mask):
            if spans and spans[-1][0] == m:
                spans[-1][2] = i + 1
            else:
                spans.append([m, i, i + 1])
        out, seen = [], 0
        for model, start, end in spans:
            if model:
                role = "assistant"
            else:
                role = "+".join(observations[seen]) if seen < len(observations) else "environment"
                seen += 1
            out.append({"role": role, "trained": model, "tokens": end - start,
                        "text": decode(self.token_ids[start:end])})
        return out


class Bridge(Protocol):
    """Text and tokens of a chat (:class:`~rollpacker.env.render.ChatBridge`)."""

    def action_text(self, token_ids: list[int]) -> str: ...

    def observation_ids(self, observation: list[Message], turn_ids: list[int]) -> list[int]:
        """``turn_ids``: the model turn if it stopped (on its last token), [] if it was cut at its limit."""


class Episode:
    """One episode (see the module docstring). ``seed``: the run's; ``max_new_tokens``: per turn;
    ``max_tokens``: model tokens of the whole episode; ``max_context``: prompt and response tokens;
    ``info_keys``: step-info counters that start at 0 (:attr:`info`)."""

    def __init__(self, id: str, prompt_ids: list[int], bridge: Bridge, *, seed: int, max_turns: int,
                 max_tokens: int, max_new_tokens: int, max_context: int, info_keys: tuple[str, ...] = ()):
        if not prompt_ids or len(prompt_ids) >= max_context:  # the caller's to refuse (Episodes.make: an EnvError)
            raise ValueError(f"episode {id}: a prompt of {len(prompt_ids)} tokens leaves no room for a turn in a "
                             f"context of {max_context}")
        self.id, self.prompt_ids, self.bridge, self.seed = id, list(prompt_ids), bridge, seed
        self.max_turns, self.max_tokens, self.max_new_tokens = max_turns, max_tokens, max_new_tokens
        self.max_context = max_context
        self.response_ids: list[int] = []
        """Every token after the prompt: model turns and observations."""
        self.loss_mask: list[bool] = []
        """Per response token: sampled by the model (trained) or not."""
        self.logprobs: list[float] = []
        """Per response token: the engine's log-prob of a model token, 0.0 for the others."""
        self.step_rewards: dict[int, float] = {}
        """Response position (the last token of a step's action) -> that step's reward."""
        self.messages: list[Message] = []
        """The conversation after the prompt: each action as an assistant message, each observation's messages."""
        self.info: dict[str, float] = dict.fromkeys(info_keys, 0.0)
        """Per key, the finite numbers (bools count 1) of the environment's step infos, summed; ``info_keys``
        start at 0, so an episode that never reports one (a turn without a tool call) counts 0, not nothing."""
        self.num_turns = 0
        self.num_model_tokens = 0
        self.done: Done | None = None
        self._turn: list[int] = []  # the last turn's tokens if it stopped; [] if cut (it stopped on no token)
        self._waiting = "turn"  # what the episode waits for: "turn", "step", or "" when done

    @property
    def num_env_tokens(self) -> int:
        return len(self.response_ids) - self.num_model_tokens

    def next_turn(self) -> TurnRequest:
        """The model turn to run now."""
        self._expect("turn")
        turn_id = f"{self.id}#{self.num_turns}"
        return TurnRequest(turn_id, self.prompt_ids + self.response_ids, self._budget(), turn_seed(self.seed, turn_id))

    def on_turn(self, token_ids: list[int], logprobs: list[float], finish_reason: str) -> StepEnv | Done:
        """A finished turn ("stop" or "length"), exactly as sampled -> what comes next."""
        self._expect("turn")
        if finish_reason not in ("stop", "length") or len(logprobs) != len(token_ids):
            raise ValueError(f"episode {self.id}: a turn finished {finish_reason!r} with {len(token_ids)} tokens and "
                             f"{len(logprobs)} log-probs; give on_turn a whole turn (abort the episode instead)")
        limit = self._limit()
        self._append(token_ids, logprobs, model=True)
        self.num_turns += 1
        self.num_model_tokens += len(token_ids)
        self._turn = list(token_ids) if finish_reason == "stop" else []
        action = self.bridge.action_text(token_ids)
        self.messages.append({"role": "assistant", "content": action})
        if not token_ids or (finish_reason == "length" and limit != "length"):
            return self._end(limit)  # an empty turn, or the episode's budget or the context spent
        self._waiting = "step"
        return StepEnv(action)

    def on_step(self, result: StepResult) -> TurnRequest | Done:
        """The environment's step on the last action -> the next turn, or the end."""
        self._expect("step")
        if result.reward is not None:
            last = len(self.response_ids) - 1
            self.step_rewards[last] = self.step_rewards.get(last, 0.0) + result.reward
        self.messages.extend(result.observation)
        for key, value in result.info.items():
            if isinstance(value, numbers.Real) and math.isfinite(value):
                self.info[key] = self.info.get(key, 0.0) + float(value)
        if result.terminated or result.truncated:
            return self._end("terminated" if result.terminated else "truncated")
        if self.num_turns >= self.max_turns:
            return self._end("max_turns")
        ids = self.bridge.observation_ids(result.observation, self._turn)
        if self.num_model_tokens >= self.max_tokens:
            return self._end("max_tokens")
        if len(self.prompt_ids) + len(self.response_ids) + len(ids) >= self.max_context:
            return self._end("context")
        self._append(ids, [], model=False)
        self._waiting = "turn"
        return self.next_turn()

    def fail(self, cause: str) -> Done:
        """The environment failed (raised, hung, returned garbage): the episode ends and trains nothing."""
        self.loss_mask = [False] * len(self.response_ids)
        return self._end("error", cause)

    def abort(self) -> Done:
        """The policy ended the episode (its group is complete, or the round is over)."""
        return self._end("abort")

    def output(self) -> EpisodeOutput:
        """The episode as one response (done or not: an unfinished one reads "abort")."""
        done = self.done or Done("abort")
        return EpisodeOutput(id=self.id, prompt_ids=list(self.prompt_ids), token_ids=list(self.response_ids),
                             logprobs=list(self.logprobs), finish_reason=done.finish_reason,
                             loss_mask=list(self.loss_mask), step_rewards=dict(self.step_rewards),
                             messages=list(self.messages), info=dict(self.info), num_turns=self.num_turns,
                             reason=done.reason, detail=done.detail)

    @property
    def reward(self) -> float:
        """The environment's rewards summed."""
        return sum(self.step_rewards.values())

    def _budget(self) -> int:
        """The next turn's most tokens: the turn's, the episode's model tokens and the context's left."""
        return min(self.max_new_tokens, self.max_tokens - self.num_model_tokens,
                   self.max_context - len(self.prompt_ids) - len(self.response_ids))

    def _limit(self) -> str:
        """The limit the next turn's token budget is: "max_tokens", "context" (the episode's, first
        on a tie) or "length" (the turn's alone)."""
        budget = self._budget()
        if budget == self.max_tokens - self.num_model_tokens:
            return "max_tokens"
        return "context" if budget == self.max_context - len(self.prompt_ids) - len(self.response_ids) else "length"

    def _append(self, token_ids: list[int], logprobs: list[float], *, model: bool) -> None:
        self.response_ids.extend(token_ids)
        self.loss_mask.extend([model] * len(token_ids))
        self.logprobs.extend(logprobs if model else [0.0] * len(token_ids))

    def _end(self, reason: str, detail: str = "") -> Done:
        if self.done is None:
            self.done, self._waiting = Done(reason, detail), ""
        return self.done

    def _expect(self, what: str) -> None:
        if self._waiting != what:
            state = f"done ({self.done.reason})" if self.done else f"waiting for a {self._waiting}"
            raise RuntimeError(f"episode {self.id}: expected a {what}, but it is {state}")
