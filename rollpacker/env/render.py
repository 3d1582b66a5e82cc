"""Token in, token out: observations as the chat template's delta, appended to the sampled tokens.

An observation (chat messages) becomes the tokens the template renders for it after an assistant
turn: the rest of the template's end of turn, then the delta (the observation's turns and the next
assistant header). :class:`ChatBridge` renders them.

Invariants:

- The model's tokens are never decoded and encoded again.
- The template must be prefix-preserving for each kind of observation. That is checked once per
  template and observation roles. A break is an error naming both, unless
  ``env.template_breaks = "count"`` counts it (:attr:`ChatBridge.breaks`).

Why: re-tokenizing the model's text can change its tokens, and then the trainer's log-probs are not
the engine's. How the delta is computed: ``docs/environments.md`` (Token in, token out).
"""

from __future__ import annotations

from rollpacker.data.chat import cut_at_stop
from rollpacker.env.contract import Message
from rollpacker.errors import UserError

MARK = "ROLLPACKER_ASSISTANT_TURN"
"""The assistant content of the base conversation, found again in its render."""
BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": MARK}]


class TemplateBreak(UserError):
    """The chat template is not prefix-preserving for an observation; the message names it."""


class ChatBridge:
    """Renders observations as token deltas with ``tokenizer``'s chat template (see the module docstring).

    ``tools``: schemas the template gets (its ``tools``); ``template_kwargs``: more keyword arguments of
    ``apply_chat_template``; ``stop``: the rollout's stop strings, cut from the action text.
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None = None, template_kwargs: dict | None = None,
                 stop: tuple[str, ...] = (), template_breaks: str = "fail"):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the model's tokenizer ({tokenizer.name_or_path}) has no chat template, which "
                            "episodes need to render observations: use a chat model's tokenizer")
        self.tokenizer, self.tools, self.kwargs = tokenizer, tools or None, dict(template_kwargs or {})
        self.stop, self.template_breaks = stop, template_breaks
        self.breaks = 0
        """Observations rendered with a broken template (``template_breaks = "count"``)."""
        base = self.render(BASE)
        self.end_of_turn = self.encode(base[base.rindex(MARK) + len(MARK):])
        """The template's tokens after an assistant turn's content."""

    @property
    def name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__

    def render(self, messages: list[Message], generation: bool = False, tools: list[dict] | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or self.tools, tokenize=False,
                                                  add_generation_prompt=generation, **self.kwargs)

    def encode(self, text: str) -> list[int]:
        """Text tokenized as the prompts are: the template wrote its own special tokens."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """A whole conversation's tokens, ready for the assistant's turn."""
        return self.encode(self.render(messages, generation=True, tools=tools))

    def action_text(self, token_ids: list[int]) -> str:
        """A model turn as the environment sees it: its text, cut before a stop string."""
        return cut_at_stop(self.tokenizer.decode(token_ids, skip_special_tokens=True), self.stop)

    def observation_ids(self, observation: list[Message], turn_ids: list[int]) -> list[int]:
        """The tokens to append after a model turn ``turn_ids`` for ``observation``: the rest of the
        template's end of turn, then the delta (the observation's turns and the next assistant header).
        A turn cut at its token limit stopped on no token: give it as [] (the whole end of turn follows)."""
        end = self.end_of_turn[1:] if turn_ids and self.end_of_turn and turn_ids[-1] == self.end_of_turn[0] else (
            self.end_of_turn)
        return [*end, *self.encode(self.delta(observation))]

    def delta(self, observation: list[Message]) -> str:
        """The text the template renders for ``observation`` after an assistant turn."""
        base = _base(observation)
        before, after = self.render(base), self.render(base + observation, generation=True)
        if after.startswith(before):
            return after[len(before):]
        roles = tuple(m["role"] for m in observation)
        if self.template_breaks == "fail":
            raise TemplateBreak(
                f"the chat template of {self.name} is not prefix-preserving for observations of roles {roles}: "
                f"rendering them after an assistant turn rewrites the turns before (before: {before[-80:]!r}; "
                f"after: {after[:len(before)][-80:]!r}). Use a prefix-preserving template (model.path's "
                "chat_template), or set env.template_breaks=count to append the delta anyway")
        self.breaks += 1
        common = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        return after[common:]


def _base(observation: list[Message]) -> list[Message]:
    """The base conversation for ``observation``: its assistant turn calls the tools that answer, if any."""
    names = [m.get("name") for m in observation if m["role"] == "tool"]
    if not names:
        return BASE
    calls = [{"type": "function", "function": {"name": n or "tool", "arguments": {}}} for n in names]
    return [BASE[0], {**BASE[1], "tool_calls": calls}]

