"""One episode as a pure state machine: model turns and environment steps, token in, token out.

Every response is an episode; one without environment is the one-turn episode whose turn is its
answer. An :class:`Episode` holds its tokens (the prompt, each turn as sampled, each observation's
tokens), a mask of the model's tokens, their log-probs, and the step rewards, each on the last
token of its step's action. The round's runner moves it: :meth:`~Episode.next_turn` gives a
:class:`TurnRequest`; the finished turn to :meth:`~Episode.on_turn` gives :class:`StepEnv` or
:class:`Done`; the environment's step to :meth:`~Episode.on_step` gives the next turn or the end.

Invariants: a turn's id and seed are fixed by the episode and the turn, so a resumed or migrated
turn replays exactly; only the model's tokens are masked in; nothing here sends, waits or imports
torch. The numbers of its environment's step infos are summed per key (:attr:`Episode.info`, e.g.
a :class:`~rollpacker.env.tools.ToolEnv`'s ``tool_calls``). Its limits: ``docs/environments.md``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from rollpacker.env.contract import Message, StepResult, number
from rollpacker.rollout.types import Output

REASONS = ("answer", "terminated", "truncated", "max_turns", "length", "max_tokens", "context", "error", "abort")
"""Why an episode ended (:attr:`Done.reason`); "answer": a response without environment gave its one turn."""
LENGTH_REASONS = ("length", "max_tokens", "context")
"""The reasons that cut the episode by a token limit: its ``finish_reason`` is "length"."""
TRUNCATED_REASONS = ("truncated", "max_turns")
"""The other reasons that cut it unfinished (:attr:`Response.truncated`): its environment's time limit, its turns'."""


def turn_seed(seed: int, turn_id: str) -> int:
    """The sampling seed of turn ``turn_id`` of a run seeded ``seed``: the round's seed of a request of that id."""
    return random.Random(f"{seed}/{turn_id}").getrandbits(63)


def reset_seed(seed: int, group: str) -> int:
    """The environment's reset seed: one per prompt group (``STEP:SLOT``, the held-out round's ``eval:SLOT``),
    so a group's episodes start alike."""
    return random.Random(f"{seed}/reset/{group}").getrandbits(31)


@dataclass(frozen=True)
class TurnRequest:
    """One model turn to run: an engine request."""

    id: str
    """``EPISODE#TURN``; a response without environment is its own one turn (the episode's id)."""
    prompt_ids: list[int]
    """The whole context so far."""
    max_new_tokens: int
    seed: int
    session: str | None = None
    """The episode, when a turn may follow this one (its engine may keep the KV); None when none will."""
    resume_from: Any = None
    """A partial response to continue by recomputation (an earlier round's, ``RoundPlan.carried``), or None."""


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
    cut: bool = False
    """Its last model turn was cut at its own token limit: it ended unfinished, whatever ended it (the environment
    took the cut text as the answer), as a response cut there is."""

    @property
    def finish_reason(self) -> str:
        """The episode's as one response's: "length" when cut by a token limit (its last turn's too), "abort",
        "error", else "stop"."""
        if self.reason in LENGTH_REASONS or self.cut:
            return "length"
        return self.reason if self.reason in ("abort", "error") else "stop"


@dataclass(kw_only=True)
class Response(Output):
    """A finished (or cut) episode as one response: what the policy, the scorer and the trainer get.
    An engine's :class:`Output` of all its tokens after the prompt (model turns and observations),
    with what an episode adds. A response without environment is filled trivially: every token the
    model's, no step reward, ``messages`` None."""

    loss_mask: list[bool] = field(default_factory=list)
    """Per token of ``token_ids``: sampled by the model (trained) or not."""
    step_rewards: dict[int, float] = field(default_factory=dict)
    """Response position (the last token of a step's action) -> that step's reward."""
    messages: list[Message] | None = None
    """The conversation after the prompt (each action an assistant message; each observation's
    messages); None when no environment took part."""
    observations: list[list[str]] = field(default_factory=list)
    """Each observation's roles, in order (an observation's messages may take any role, assistant too)."""
    info: dict[str, float] = field(default_factory=dict)
    """The numbers of the environment's step infos, summed per key over the episode (:attr:`Episode.info`)."""
    num_turns: int = 0
    env_seconds: float = 0.0
    """Seconds its environment's calls (reset, steps) took in their worker."""
    reason: str = ""
    """Why it ended (:data:`REASONS`); ``detail`` says more for an error."""
    detail: str = ""
    prompt: str | list[Message] | None = None
    """The prompt its environment's reset gave (a string or chat messages); None: its row's own."""
    env_state: Any = None
    """A copy of its environment after its last call, for reward functions that take ``environments``
    (:attr:`Episode.env_state`); None without one."""

    @property
    def env_reward(self) -> float:
        return float(sum(self.step_rewards.values()))

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def truncated(self) -> bool:
        """Cut by a limit, not ended by its task (verifiers' ``is_truncated``): by a token limit (``finish_reason``
        "length"), ``env.max_turns``, or its environment's ``truncated``. What ``train.mask_truncated`` leaves out."""
        return self.finish_reason == "length" or self.reason in TRUNCATED_REASONS

    def describe(self, decode: Callable[[list[int]], str]) -> dict[str, Any]:
        """What a samples file shows of it besides its completion: each turn (:meth:`turns`), why it
        ended, its environment's rewards and tokens; nothing when no environment took part."""
        if self.messages is None:
            return {}
        model = self.num_model_tokens
        return {"turns": self.turns(decode), "num_turns": self.num_turns, "end": self.reason, "end_detail": self.detail,
                "env_reward": self.env_reward, "model_tokens": model, "env_tokens": len(self.token_ids) - model}

    def turns(self, decode: Callable[[list[int]], str]) -> list[dict]:
        """The episode's tokens turn by turn, as the samples files show them: each run of model tokens
        (``role`` assistant, ``trained`` True) and of environment tokens (``role``: its observation's
        roles, ``trained`` False), with its ``text`` (``decode``) and ``tokens``. A failed episode's
        model turns read untrained, as they are (:meth:`Controller.group_samples` masks them out)."""
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
                roles = self.observations[seen] if seen < len(self.observations) else []
                role = "+".join(roles) or "environment"  # an observation of no message still has its end of turn
                seen += 1
            out.append({"role": role, "trained": model and self.finish_reason != "error", "tokens": end - start,
                        "text": decode(self.token_ids[start:end])})
        return out


class Bridge(Protocol):
    """Text and tokens of a chat (:class:`~rollpacker.env.render.ChatBridge`)."""

    def action_text(self, token_ids: list[int]) -> str: ...

    def observation_ids(self, observation: list[Message], turn_ids: list[int], tools: list[dict] | None) -> list[int]:
        """``turn_ids``: the model turn if it stopped (on its last token), [] if it was cut at its limit;
        ``tools``: the schemas the prompt was rendered with."""

    def check_tool_parser(self, parser: str) -> None:
        """Raise if ``parser`` cannot read the calls the chat template writes."""

    def take_breaks(self) -> int:
        """Observations rendered with a template that is not prefix-preserving, since last called."""


class Episode:
    """One episode (see the module docstring). ``bridge``: the chat's, None for a response without
    environment (its one turn, named by the episode's id, ends it); ``seed``: the run's;
    ``max_new_tokens``: per turn; ``max_tokens``: model tokens of the whole episode; ``max_context``:
    prompt and response tokens; ``info_keys``: step-info counters that start at 0 (:attr:`info`)."""

    def __init__(self, id: str, prompt_ids: list[int], bridge: Bridge | None, *, seed: int, max_turns: int,
                 max_tokens: int, max_new_tokens: int, max_context: int, info_keys: tuple[str, ...] = (),
                 prompt: str | list[Message] | None = None, tools: list[dict] | None = None):
        if not prompt_ids or len(prompt_ids) >= max_context:  # Environments.episode refuses it first
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
        self.messages: list[Message] | None = [] if bridge is not None else None
        """The conversation after the prompt: each action as an assistant message, each observation's messages."""
        self.observations: list[list[str]] = []
        """Each observation's roles, in order."""
        self.info: dict[str, float] = dict.fromkeys(info_keys, 0.0)
        """Per key, the finite numbers (bools count 1) of the environment's step infos, summed; ``info_keys``
        start at 0, so an episode that never reports one (a turn without a tool call) counts 0, not nothing."""
        self.prompt = prompt
        """The prompt its environment's reset gave, encoded as ``prompt_ids``; None: its row's own."""
        self.tools = tools
        """The tool schemas its prompt was rendered with; its observations are rendered with them too."""
        self.env_state: Any = None
        """A copy of its environment after its last call (set by the runner from the replies), for reward functions
        that take ``environments`` (:class:`~rollpacker.env.trl.EnvState`); None when none was sent."""
        self.num_turns = 0
        self.num_model_tokens = 0
        self.env_seconds = 0.0
        """Seconds its environment's calls took in their worker (set by the runner from the replies)."""
        self.done: Done | None = None
        self._turn: list[int] = []  # the last turn's tokens if it stopped; [] if cut (it stopped on no token)
        self._waiting = "turn"  # what the episode waits for: "turn", "step", or "" when done

    @property
    def num_env_tokens(self) -> int:
        return len(self.response_ids) - self.num_model_tokens

    def next_turn(self) -> TurnRequest:
        """The model turn to run now."""
        self._expect("turn")
        talks = self.bridge is not None
        turn_id = f"{self.id}#{self.num_turns}" if talks else self.id
        return TurnRequest(turn_id, self.prompt_ids + self.response_ids, self._budget(), turn_seed(self.seed, turn_id),
                           session=self.id if talks else None)

    def on_turn(self, token_ids: list[int], logprobs: list[float], finish_reason: str) -> StepEnv | Done:
        """A finished turn ("stop" or "length"), exactly as sampled -> what comes next. One cut ("length")
        short of its budget was stopped there on purpose (a replayed length): it reads as stopped."""
        self._expect("turn")
        if finish_reason == "length" and len(token_ids) < self._budget():
            finish_reason = "stop"
        if finish_reason not in ("stop", "length") or len(logprobs) != len(token_ids):
            raise ValueError(f"episode {self.id}: a turn finished {finish_reason!r} with {len(token_ids)} tokens and "
                             f"{len(logprobs)} log-probs; give on_turn a whole turn (abort the episode instead)")
        limit = self._limit()
        self._append(token_ids, logprobs, model=True)
        self.num_turns += 1
        self.num_model_tokens += len(token_ids)
        if self.bridge is None:  # no environment: the turn is the answer
            return self._end("length" if finish_reason == "length" else "answer")
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
        self._reward(result.reward)
        self.messages.extend(result.observation)
        self.observations.append([m["role"] for m in result.observation])
        for key, value in result.info.items():
            if (counted := number(value)) is not None and math.isfinite(counted):
                self.info[key] = self.info.get(key, 0.0) + counted
        cut = not self._turn  # the last turn stopped on no token: its limit cut it
        if result.terminated or result.truncated:
            return self._end("terminated" if result.terminated else "truncated", cut=cut)
        if self.num_turns >= self.max_turns:
            return self._end("max_turns", cut=cut)
        ids = self.bridge.observation_ids(result.observation, self._turn, self.tools)
        if self.num_model_tokens >= self.max_tokens:
            return self._end("max_tokens")
        if len(self.prompt_ids) + len(self.response_ids) + len(ids) >= self.max_context:
            return self._end("context")
        self._append(ids, [], model=False)
        self._waiting = "turn"
        return self.next_turn()

    def on_finish(self, reward: float | None) -> Done:
        """Its environment's reward for the episode a token limit ended (:func:`~rollpacker.env.contract.finish`),
        on its last token."""
        if self.done is None or self.done.reason not in LENGTH_REASONS:
            raise RuntimeError(f"episode {self.id}: a finish reply, but no token limit ended it")
        self._reward(reward)
        return self.done

    def fail(self, cause: str) -> Done:
        """The environment failed (raised, hung, returned garbage): the episode ends, once, and trains nothing;
        one a token limit ended reads as failed when its environment fails to score it. Its ``loss_mask`` still
        says which tokens the model sampled (its samples show them); the trainer gets none of them."""
        if self.done is None or self.done.reason != "error":
            self.done, self._waiting = Done("error", cause), ""
        return self.done

    def abort(self, partial: Output | None = None) -> Done:
        """The policy ended the episode (its group is complete, or the round is over). ``partial``: its
        running turn as the engine cut it; its tokens are kept (a later round may resume them). A whole
        turn of an episode without environment (its engine finished it, or it fills its budget, before
        the abort reached it) is the episode's end: nothing would be left to resume."""
        if partial is not None and self.done is None and self.bridge is None and (
                partial.finish_reason != "abort" or len(partial.token_ids) >= self._budget()):
            return self.on_turn(partial.token_ids, partial.logprobs,
                                "length" if partial.finish_reason == "abort" else partial.finish_reason)
        if partial is not None and self.done is None:
            self._append(partial.token_ids, partial.logprobs, model=True)
            self.num_model_tokens += len(partial.token_ids)
        return self._end("abort")

    def output(self) -> Response:
        """The episode as one response (done or not: an unfinished one reads "abort")."""
        done = self.done or Done("abort")
        return Response(id=self.id, prompt_ids=list(self.prompt_ids), token_ids=list(self.response_ids),
                        logprobs=list(self.logprobs), finish_reason=done.finish_reason, loss_mask=list(self.loss_mask),
                        step_rewards=dict(self.step_rewards), info=dict(self.info), num_turns=self.num_turns,
                        env_seconds=self.env_seconds,
                        reason=done.reason, detail=done.detail, prompt=self.prompt, env_state=self.env_state,
                        messages=None if self.messages is None else list(self.messages),
                        observations=[list(o) for o in self.observations])

    def _reward(self, reward: float | None) -> None:
        """An environment's reward, on the last token so far (the first place, none yet: an empty turn)."""
        if reward is not None:
            last = max(len(self.response_ids) - 1, 0)
            self.step_rewards[last] = self.step_rewards.get(last, 0.0) + reward

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

    def _end(self, reason: str, detail: str = "", cut: bool = False) -> Done:
        if self.done is None:
            self.done, self._waiting = Done(reason, detail, cut), ""
        return self.done

    def _expect(self, what: str) -> None:
        if self._waiting != what:
            state = f"done ({self.done.reason})" if self.done else f"waiting for a {self._waiting}"
            raise RuntimeError(f"episode {self.id}: expected a {what}, but it is {state}")
