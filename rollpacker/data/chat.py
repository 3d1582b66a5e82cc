"""A row's prompt as token ids: a string as it is, or chat messages through the tokenizer's template.

A list of messages always goes through the chat template, with ``add_generation_prompt``. A
string goes through it as one user turn when ``model.chat_template`` is set, and is tokenized as
it is otherwise. ``data.system_prompt`` becomes the first turn of a prompt that has no system
turn. ``model.chat_template_kwargs`` go to ``apply_chat_template`` (Qwen3's ``enable_thinking``,
say). The template renders text, which is then tokenized without special tokens, as TRL and verl
do: a template writes its own BOS.
"""

from __future__ import annotations

from typing import Any

from rollpacker.errors import UserError


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
    the template, which then renders a string prompt too."""
    if isinstance(prompt, str) and not chat_template and not tools:
        if system_prompt:
            raise UserError("data.system_prompt is set but the prompts are plain strings tokenized as they are: "
                            "set model.chat_template to render them as chat turns, or drop data.system_prompt")
        return prompt
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the model's tokenizer ({tokenizer.name_or_path}) has no chat template, which chat "
                        "prompts (a list of messages, model.chat_template or data.system_prompt) need: use a chat "
                        "model's tokenizer, or plain string prompts")
    return tokenizer.apply_chat_template(messages(prompt, system_prompt), add_generation_prompt=True, tokenize=False,
                                         tools=tools or None, **(template_kwargs or {}))


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
