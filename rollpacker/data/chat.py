"""A row's prompt as token ids: a string as it is, or chat messages through the tokenizer's template.

A list of messages always goes through the chat template, as TRL's ``apply_chat_template`` does:
ending in an assistant turn it is a prefill the response continues (``continue_final_message``);
ending in any other turn it gets the generation prompt (``add_generation_prompt``). A string goes
through it as one user turn when ``model.chat_template`` is set, and is tokenized as it is otherwise.
``data.system_prompt`` becomes the first turn of a prompt that has no system turn.
``model.chat_template_kwargs`` go to ``apply_chat_template`` (Qwen3's ``enable_thinking``, say), but
none of the arguments this module sets itself (:data:`RESERVED_TEMPLATE_KWARGS`). The template
renders text, which is then tokenized without special tokens, as TRL and verl do: a template writes
its own BOS. A prompt the template refuses raises :class:`TemplateRefused`.
"""

from __future__ import annotations

from typing import Any

from rollpacker.errors import UserError

RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "tokenize", "add_generation_prompt",
                            "continue_final_message", "return_dict", "return_assistant_tokens_mask")
"""Arguments of ``apply_chat_template`` that :func:`render` sets itself: not ``model.chat_template_kwargs``."""


class TemplateRefused(UserError):
    """The tokenizer's chat template raised an error rendering a prompt; the message says the template's."""


def check_template_kwargs(kwargs: dict[str, Any], field: str = "model.chat_template_kwargs") -> None:
    """Raise ValueError naming ``field`` if ``kwargs`` holds an argument :func:`render` sets itself."""
    reserved = [key for key in kwargs if key in RESERVED_TEMPLATE_KWARGS]
    if reserved:
        raise ValueError(f"{field} sets {', '.join(map(repr, reserved))}, which rollpacker sets itself (it renders "
                         "text, then encodes it; a prompt ending in an assistant turn continues it, any other gets "
                         "the generation prompt; the messages and tools are the row's): remove "
                         f"{'them' if len(reserved) > 1 else 'it'} from {field}")


def messages(prompt: str | list[dict], system_prompt: str = "") -> list[dict]:
    """``prompt`` as chat messages: a string is one user turn; ``system_prompt`` leads unless a system turn does."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def render(tokenizer, prompt: str | list[dict], *, chat_template: bool = False, system_prompt: str = "",
           template_kwargs: dict[str, Any] | None = None, tools: list[dict] | None = None) -> str:
    """The text ``prompt`` (a string, or a list of chat messages) becomes before it is tokenized:
    the chat template's output, or the string as it is. ``tools`` (JSON schemas, an episode's) go to
    the template, which then renders a string prompt too. Messages ending in an assistant turn are
    continued (``continue_final_message``), others get the generation prompt. Raises
    :class:`TemplateRefused` if the template raises an error on the messages, and UserError if
    ``template_kwargs`` holds a :data:`RESERVED_TEMPLATE_KWARGS` argument."""
    if isinstance(prompt, str) and not chat_template and not tools:
        if system_prompt:
            raise UserError("data.system_prompt is set but the prompts are plain strings tokenized as they are: "
                            "set model.chat_template to render them as chat turns, or drop data.system_prompt")
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the model's tokenizer ({tokenizer.name_or_path}) has no chat template, which chat "
                        "prompts (a list of messages, model.chat_template or data.system_prompt) need: use a chat "
                        "model's tokenizer, or plain string prompts")
    try:
        check_template_kwargs(template_kwargs or {})
    except ValueError as e:
        raise UserError(str(e)) from None
    from jinja2 import TemplateError

    turns = messages(prompt, system_prompt)
    prefill = turns[-1]["role"] == "assistant"  # TRL's rule: continue an assistant turn, else open a new one
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=not prefill, continue_final_message=prefill,
                                             tokenize=False, tools=tools or None, **(template_kwargs or {}))
    except (TemplateError, TypeError, ValueError) as e:  # raise_exception(...), None + str, a prefill it drops
        added = len(turns) > (1 if isinstance(prompt, str) else len(prompt))  # data.system_prompt's turn
        system = (f", with the system turn data.system_prompt adds ({system_prompt[:40]!r}; a template that takes no "
                  "system turn needs data.system_prompt empty)") if added else ""
        raise TemplateRefused(f"the chat template of {tokenizer.name_or_path or type(tokenizer).__name__} refused "
                              f"the prompt{system}: {type(e).__name__}: {str(e)[:300]} (fix the prompt, or use a "
                              "model whose template takes it)") from None


def encode(tokenizer, prompt: str | list[dict], **settings) -> list[int]:
    """The token ids the engines get for ``prompt``: :func:`render`'s text (``settings`` are its own),
    tokenized without special tokens (a template writes its own)."""
    return tokenizer(render(tokenizer, prompt, **settings), add_special_tokens=False)["input_ids"]


def prompt_text(tokenizer, prompt_ids: list[int]) -> str:
    """The prompt as the engine received it: its token ids decoded, special tokens and all."""
    return tokenizer.decode(prompt_ids, skip_special_tokens=False)


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """``text`` up to its first stop string, which is left out (vLLM's default)."""
    return text[:min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))]
