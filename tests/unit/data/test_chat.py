"""Chat prompts through the template as TRL renders them: a prefill continued, the generation prompt
otherwise, the template's own arguments not overridable, and a prompt the template refuses named."""

from __future__ import annotations

import logging

import pytest

from rollpacker.config import ModelConfig
from rollpacker.data.chat import check_template_kwargs, encode, render
from rollpacker.errors import UserError
from rollpacker.toy.model import build_tokenizer
from rollpacker.toy.tools_model import build_tools_tokenizer


def test_a_prompt_ending_in_an_assistant_turn_is_continued_and_any_other_gets_the_generation_prompt():
    """TRL's apply_chat_template: continue_final_message after an assistant turn, add_generation_prompt
    after a user or tool turn."""
    tokenizer = build_tokenizer()
    prefill = [{"role": "user", "content": "3+5"}, {"role": "assistant", "content": "8"}]
    assert render(tokenizer, prefill) == "Q: 3+5\nA:8" == tokenizer.apply_chat_template(
        prefill, continue_final_message=True, tokenize=False)
    assert encode(tokenizer, prefill) == tokenizer("Q: 3+5\nA:8", add_special_tokens=False)["input_ids"]
    assert render(tokenizer, prefill[:1]) == "Q: 3+5\nA:"
    tools = build_tools_tokenizer()
    after_tool = [{"role": "user", "content": "3+5"}, {"role": "assistant", "content": "", "tool_calls": []},
                  {"role": "tool", "content": "8"}]
    assert render(tools, after_tool) == "Q: 3+5\nA:\nR: 8\nA:"


@pytest.mark.parametrize("key", ["add_generation_prompt", "continue_final_message", "tokenize", "conversation",
                                 "messages", "tools", "return_dict", "return_assistant_tokens_mask"])
def test_chat_template_kwargs_may_not_set_what_rollpacker_sets(key):
    with pytest.raises(ValueError, match=rf"model.chat_template_kwargs sets '{key}', which rollpacker sets itself"):
        check_template_kwargs({"enable_thinking": False, key: True})
    with pytest.raises(UserError, match=rf"model.chat_template_kwargs sets '{key}'.*: remove it from "
                                        r"model.chat_template_kwargs"):
        render(build_tokenizer(), [{"role": "user", "content": "3+5"}], template_kwargs={key: True})
    check_template_kwargs({"enable_thinking": False})
    with pytest.raises(ValueError, match=rf"sets '{key}'"):  # at parse time, before anything is built
        ModelConfig(chat_template_kwargs={key: True})


def test_a_flags_false_in_any_case_turns_thinking_off():
    """tyro reads ``false`` (``FALSE``) as a string, which Qwen3's template would take as true: it is the bool."""
    from rollpacker.config import parse

    config = parse(["--model.chat-template-kwargs", "enable_thinking", "false", "effort", "low", "n", "3"])
    assert config.model.chat_template_kwargs == {"enable_thinking": False, "effort": "low", "n": 3}
    assert parse(["--model.chat-template-kwargs", "enable_thinking", "True"]).model.chat_template_kwargs == {
        "enable_thinking": True}
    assert parse(["--model.chat-template-kwargs", "enable_thinking", "FALSE"]).model.chat_template_kwargs == {
        "enable_thinking": False}


ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}{{ ('Q: ' if m['role'] == 'user' else 'A:') + m['content'] + '\n' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ 'A:' }}{% endif %}")
"""A Mistral/Gemma-style template: roles alternate from a user turn, no system turn."""


def test_a_row_the_template_refuses_is_a_dataset_error_naming_it_and_the_system_prompt(caplog):
    from rollpacker.config import Config
    from rollpacker.controller import row_encoder
    from rollpacker.data.dataset import DatasetError, fit_rows

    tokenizer = build_tokenizer()
    tokenizer.chat_template = ALTERNATING
    rows = [{"id": "a:1", "prompt": [{"role": "user", "content": "1+1"}]},
            {"id": "a:2", "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "3+3"}]}]
    fit = dict(max_model_len=512, kv_tokens=10**6, max_new_tokens=64)
    with pytest.raises(DatasetError, match=r"row 'a:2': the chat template of .* refused the prompt: TemplateError: "
                                           r"Conversation roles must alternate .*\(fix the prompt, or use a model"):
        fit_rows(rows, encode=row_encoder(tokenizer, Config()), **fit)
    config = Config()
    config.data.system_prompt = "Be exact."
    with pytest.raises(DatasetError, match=r"row 'a:1': .* refused the prompt, with the system turn data.system_prompt "
                                           r"adds \('Be exact.'; a template that takes no system turn needs "
                                           r"data.system_prompt empty\): TemplateError: Conversation roles"):
        fit_rows(rows, encode=row_encoder(tokenizer, config), **fit)
    assert fit_rows(rows[:1], encode=row_encoder(tokenizer, Config()), **fit) == rows[:1]
    # data.skip_bad_lines: left out, said once
    with caplog.at_level(logging.WARNING, logger="rollpacker.data.dataset"):
        assert fit_rows(rows, encode=row_encoder(tokenizer, Config()), skip_bad=True, **fit) == rows[:1]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("left out 1 of 2 prompts the chat template refuses "
                                                 "(data.skip_bad_lines); first: row 'a:2': the chat template"), said
    # every row left out so: the error said the prompts did not fit the context, which nothing could fix
    with pytest.raises(DatasetError, match=r"the chat template refuses every prompt of data.path: row 'a:2': "):
        fit_rows(rows[1:], encode=row_encoder(tokenizer, Config()), skip_bad=True, **fit)
    # a template that cannot render a tool-call turn without content: named as well
    tool_call = [{"role": "user", "content": "3+5"}, {"role": "assistant", "content": None, "tool_calls": [{}]},
                 {"role": "tool", "content": "8"}]
    with pytest.raises(DatasetError, match=r"row 'b:1': .* refused the prompt: TypeError"):
        fit_rows([{"id": "b:1", "prompt": tool_call}], encode=row_encoder(build_tokenizer(), Config()), **fit)
