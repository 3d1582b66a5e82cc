"""Token in, token out: observations as the chat template's delta, appended to the sampled tokens.

An observation (chat messages) becomes the tokens the template renders for it after an assistant
turn: the rest of the template's end of turn, then the delta (the observation's turns and the next
assistant header). :class:`ChatBridge` renders them.

Invariants:

- The model's tokens are never decoded and encoded again.
- The template must be prefix-preserving for each kind of observation, but for the assistant turn
  itself, whose tokens are the model's (Qwen3 drops an empty think block once a turn follows). That is
  checked once per template and observation roles. A break is an error naming both, unless
  ``env.template_breaks = "count"`` counts it (:attr:`ChatBridge.breaks`).

Why: re-tokenizing the model's text can change its tokens, and then the trainer's log-probs are not
the engine's. How the delta is computed: ``docs/environments.md`` (Token in, token out).
"""

from __future__ import annotations

import logging

from rollpacker.data.chat import cut_at_stop
from rollpacker.env.contract import Message
from rollpacker.errors import UserError

MARK = "ROLLPACKER_ASSISTANT_TURN"
"""The assistant content of the base conversation, found again in its render."""
BASE = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": MARK}]

logger = logging.getLogger(__name__)


class TemplateBreak(UserError):
    """The chat template is not prefix-preserving for an observation, or refuses it; the message names it."""


class ChatBridge:
    """Renders observations as token deltas with ``tokenizer``'s chat template (see the module docstring).

    ``tools``: schemas the template gets (its ``tools``); ``template_kwargs``: more keyword arguments of
    ``apply_chat_template``; ``stop``: the rollout's stop strings, cut from the action text; ``keep``:
    special tokens the action text keeps (the tool parser's markers, as Mistral's ``[TOOL_CALLS]``); ``eos``: the
    ids a turn stops at (the model's EOS ids: a turn that ends on one ends as the template's end-of-turn token).
    """

    def __init__(self, tokenizer, *, tools: list[dict] | None = None, template_kwargs: dict | None = None,
                 stop: tuple[str, ...] = (), template_breaks: str = "fail", keep: tuple[str, ...] = (),
                 eos: tuple[int, ...] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the model's tokenizer ({tokenizer.name_or_path}) has no chat template, which "
                            "episodes need to render observations: use a chat model's tokenizer")
        self.tokenizer, self.tools, self.kwargs = tokenizer, tools or None, dict(template_kwargs or {})
        self.stop, self.template_breaks, self.eos = stop, template_breaks, frozenset(eos)
        vocab = tokenizer.get_vocab()
        self.keep = {vocab[t]: t for t in keep if t in vocab}
        """The kept special tokens of this vocabulary, by id."""
        self.breaks = 0
        """Observations rendered with a broken template (``template_breaks = "count"``), since :meth:`take_breaks`."""
        self.break_said = False
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
        """A model turn as the environment sees it: its text without special tokens but the kept ones,
        cut before a stop string."""
        parts, start = [], 0
        for i, token in enumerate(token_ids):
            if token in self.keep:
                parts += [self.tokenizer.decode(token_ids[start:i], skip_special_tokens=True), self.keep[token]]
                start = i + 1
        parts.append(self.tokenizer.decode(token_ids[start:], skip_special_tokens=True))
        return cut_at_stop("".join(parts), self.stop)

    def observation_ids(self, observation: list[Message], turn_ids: list[int], tools: list[dict] | None = None
                        ) -> list[int]:
        """The tokens to append after a model turn ``turn_ids`` for ``observation``: the rest of the
        template's end of turn, then the delta (the observation's turns and the next assistant header).
        A turn cut at its token limit stopped on no token: give it as [] (the whole end of turn follows). A turn
        that stopped on another EOS id than the template's end-of-turn token (Llama 3.1's ``<|eom_id|>`` for its
        ``<|eot_id|>``) ends there too: the template's is not added after it. ``tools``: the schemas the
        conversation is rendered with."""
        first = self.end_of_turn[0] if self.end_of_turn else None
        ended = bool(turn_ids) and (turn_ids[-1] == first or turn_ids[-1] in self.eos and first in self.eos)
        return [*(self.end_of_turn[1:] if ended else self.end_of_turn), *self.encode(self.delta(observation, tools))]

    def delta(self, observation: list[Message], tools: list[dict] | None = None) -> str:
        """The text the template renders for ``observation`` after an assistant turn, with ``tools``' schemas (a
        template may move them: Mistral's go before the last user turn)."""
        observation = _with_ids(observation)
        roles = tuple(m["role"] for m in observation)
        base, before, after = self._render_after(observation, tools)
        if after.startswith(before):
            return after[len(before):]
        end, turn = before[before.rindex(MARK) + len(MARK):], after.rfind(MARK)
        past = after[turn + len(MARK):] if turn >= 0 else ""
        rest = past[len(end):] if turn >= 0 and past.startswith(end) else None  # past the assistant turn's end
        if rest is not None and self._turn_alone(base, before, after, tools):
            return rest
        at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        what = (f"the chat template of {self.name} is not prefix-preserving for observations of roles {roles}: "
                f"rendering them after an assistant turn rewrites the turns before, from character {at} "
                f"(before: {before[max(at - 40, 0):at + 40]!r}; after: {after[max(at - 40, 0):at + 40]!r})")
        if self.template_breaks == "fail":
            raise TemplateBreak(f"{what}. Use a prefix-preserving template (model.path's chat_template), or set "
                                "env.template_breaks=count to append the delta anyway")
        if not self.break_said:
            self.break_said = True
            logger.warning("%s: appending the delta anyway (env.template_breaks count), so the model trains on "
                           "turns its template would not render; env/template_breaks counts them; said once", what)
        self.breaks += 1
        return after[at:] if rest is None else rest

    def _render_after(self, observation: list[Message], tools: list[dict] | None) -> tuple[list[Message], str, str]:
        """The base conversation for ``observation``, its render, and the render with ``observation`` after it; a
        TemplateBreak if the template refuses them."""
        from jinja2 import TemplateError  # what apply_chat_template renders with

        try:
            base, before = self._base_render(observation, tools)
            return base, before, self.render(base + observation, generation=True, tools=tools)
        except (TemplateError, TypeError, ValueError) as e:  # raise_exception(...), or a value it cannot join
            roles = tuple(m["role"] for m in observation)
            raise TemplateBreak(f"the chat template of {self.name} refuses observations of roles {roles} after an "
                                f"assistant turn ({type(e).__name__}: {e}): set env.observation_role to a role it "
                                "takes there (a string observation's role: tool results are role tool), or use a "
                                "template that takes them (model.path's chat_template)") from None

    def take_breaks(self) -> int:
        """The observations rendered with a broken template since last called."""
        breaks, self.breaks = self.breaks, 0
        return breaks

    def _turn_alone(self, base: list[Message], before: str, after: str, tools: list[dict] | None) -> bool:
        """Whether ``after`` rewrites the base's assistant turn alone, by dropping text from its start (Qwen3 drops
        the last turn's empty think block once a turn follows it): the turns before it render unchanged, and its
        text before the content is a prefix of what ``before`` had. Then it is no break: in an episode the model's
        own tokens stand in for that turn."""
        from jinja2 import TemplateError

        try:
            earlier = self.render(base[:-1], tools=tools)
        except TemplateError:
            return False
        n = len(earlier)
        return (before.startswith(earlier) and after.startswith(earlier)
                and before[n:before.rindex(MARK)].startswith(after[n:after.rfind(MARK)]))

    def check_tool_parser(self, parser: str) -> None:
        """Refuse ``parser`` (``env.tool_parser``) when it reads no call in the layout this chat template writes one
        in, and another parser does: the default hermes on a Llama 3 or Mistral model read every call as the answer,
        silently. A template that writes no call (it renders no ``tool_calls``) is not checked. Refuse one that
        refuses tool results (role tool) after an assistant turn, which stopped the run at its first one."""
        from jinja2 import TemplateError

        from rollpacker.env.parsers import PARSERS

        tools = [{"type": "function", "function": {"name": "probe", "description": "A probe.", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}]
        self._render_after(_with_ids([{"role": "tool", "name": "probe", "content": "1"}]), tools)
        written = None
        for arguments in ({"x": 1}, '{"x": 1}'):  # DeepSeek's templates concatenate the arguments: a string
            call = {"type": "function", "id": "call00000", "function": {"name": "probe", "arguments": arguments}}
            try:
                prompt = self.render(BASE[:1], generation=True, tools=tools)
                written = self.render([BASE[0], {"role": "assistant", "content": "", "tool_calls": [call]}],
                                      tools=tools)
                break
            except (TemplateError, TypeError, ValueError):  # raise_exception(...), a dict + str
                continue
        if written is None or not written.startswith(prompt):
            return
        text = written[len(prompt):]  # the turn as the template writes it, its special tokens as text
        reads = [name for name, p in PARSERS.items() if any(c.name == "probe" and not c.error for c in p(text, tools))]
        if reads and parser not in reads:
            raise UserError(f"env.tool_parser {parser} reads no tool call in the layout the chat template of "
                            f"{self.name} writes one in ({text.strip()[:80]!r}), so every call would be read as the "
                            f"answer: set env.tool_parser to {' or '.join(reads)}")

    def _base_render(self, observation: list[Message], tools: list[dict] | None) -> tuple[list[Message], str]:
        """The base conversation for ``observation`` (:func:`_base`) and its render; the first refusal if every
        form of its calls is refused."""
        from jinja2 import TemplateError

        refused = None
        for arguments in ({}, "{}"):  # DeepSeek's templates concatenate the arguments: a string
            for num_calls in (None, 1):  # a template of one call per turn (Llama 3.1's): one answers all
                base = _base(observation, num_calls, arguments)
                try:
                    return base, self.render(base, tools=tools)
                except (TemplateError, TypeError, ValueError) as e:  # raise_exception(...), a dict + str
                    refused = refused or e
        raise refused


def _with_ids(observation: list[Message]) -> list[Message]:
    """``observation`` with an id on each tool message that has none (``callNNNNN``, the tool parsers' id for
    Mistral's form): Mistral's templates refuse a result without a 9-character id (a string observation of
    ``env.observation_role`` tool has none)."""
    return [{**m, "tool_call_id": f"call{i:05d}"} if m["role"] == "tool" and not m.get("tool_call_id") else m
            for i, m in enumerate(observation)]


def _base(observation: list[Message], num_calls: int | None = None, arguments: dict | str | None = None
          ) -> list[Message]:
    """The base conversation for ``observation``: its assistant turn calls the tools that answer, if any, with
    their ids (Mistral's template requires them) and ``arguments``; ``num_calls``: only the first calls."""
    answers = [m for m in observation if m["role"] == "tool"][:num_calls]
    if not answers:
        return BASE
    arguments = {} if arguments is None else arguments
    calls = [{"type": "function", "function": {"name": m.get("name") or "tool", "arguments": arguments},
              **({"id": m["tool_call_id"]} if m.get("tool_call_id") else {})} for m in answers]
    return [BASE[0], {**BASE[1], "tool_calls": calls}]

