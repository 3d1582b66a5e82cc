"""The tool-call parsers (``env.tool_parser``), each on its family's own template text: turns written by
hand as the family's chat template writes an assistant tool call, and turns rendered by templates of
the same layout (tests/support/chat.py); then malformed calls, through ToolEnv, and token in, token
out through the chat bridge."""

from __future__ import annotations

import json
import sys
from typing import Optional

import pytest

from rollpacker.env import contract
from rollpacker.env.config import EnvConfig
from rollpacker.env.parsers import PARSERS, hermes, llama3_json, mistral, qwen3_coder
from rollpacker.env.render import ChatBridge
from rollpacker.env.tools import ToolEnv, schemas
from tests.support.chat import (
    MISTRAL_V11_STYLE_TEMPLATE,
    QWEN3_CODER_STYLE_TEMPLATE,
    QWEN_STYLE_TEMPLATE,
    chat_tokenizer,
    llama3_style_tokenizer,
    mistral_style_tokenizer,
    qwen_style_tokenizer,
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: What to say.
    """
    return text.upper() + "!"


def configure(options: dict, verbose: bool, ratio: float, tags: list[str], note: Optional[str] = None) -> str:
    """Set things up.

    Args:
        options: Named options.
        verbose: Say more.
        ratio: A fraction.
        tags: Labels.
        note: A note, or none.
    """
    return json.dumps([options, verbose, ratio, tags, note])


FUNCTIONS = {"add": add, "shout": shout, "configure": configure}
TOOLS = schemas(FUNCTIONS)

# Each family's assistant turn with two calls, as its template writes it (after the generation prompt,
# before the end of turn), and the calls read from it: (name, arguments, id).
TURNS = {
    "hermes": ('Adding first.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n</tool_call>\n'
               '<tool_call>\n{"name": "shout", "arguments": {"text": "hi"}}\n</tool_call>',
               [("add", {"a": 2, "b": 40}, "call_0"), ("shout", {"text": "hi"}, "call_1")]),
    "qwen3_coder": ("Adding first.\n\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n40\n"
                    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=shout>\n<parameter=text>\n"
                    "line one\n  line two\n</parameter>\n</function>\n</tool_call>",
                    [("add", {"a": 2, "b": 40}, "call_0"), ("shout", {"text": "line one\n  line two"}, "call_1")]),
    "llama3_json": ('<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 40}}; '
                    '{"name": "shout", "parameters": {"text": "hi"}}',
                    [("add", {"a": 2, "b": 40}, "call_0"), ("shout", {"text": "hi"}, "call_1")]),
    "mistral": ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 40}, "id": "Ab3dE6gH9"}, '
                '{"name": "shout", "arguments": {"text": "hi"}, "id": "zz9zz9zz9"}]',
                [("add", {"a": 2, "b": 40}, "Ab3dE6gH9"), ("shout", {"text": "hi"}, "zz9zz9zz9")]),
}


def read(parser, text: str) -> list[tuple]:
    calls = parser(text, TOOLS)
    assert not [c.error for c in calls if c.error]
    return [(c.name, c.arguments, c.id) for c in calls]


@pytest.mark.parametrize("name", list(TURNS))
def test_each_parser_reads_its_familys_turn(name):
    text, calls = TURNS[name]
    assert read(PARSERS[name], text) == calls


def test_the_other_forms_of_each_family():
    # Llama 3.1's template writes a call as the whole turn, "parameters"; models write "arguments" too
    assert read(llama3_json, '{"name": "add", "parameters": {"a": 2, "b": 40}}') == [("add", {"a": 2, "b": 40},
                                                                                       "call_0")]
    assert read(llama3_json, ' {"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}\n{"name": "add"}') == [
        ("shout", {"text": "hi"}, "call_0"), ("add", {}, "call_1")]
    # Mistral Small 3.2 (tokenizer v11+): one [TOOL_CALLS] per call, the content before them; with a call id
    assert read(mistral, 'Adding first.[TOOL_CALLS]add[ARGS]{"a": 2, "b": 40}[TOOL_CALLS]shout[CALL_ID]Ab3dE6gH9'
                         '[ARGS]{"text": "hi"}') == [("add", {"a": 2, "b": 40}, "call00000"),
                                                     ("shout", {"text": "hi"}, "Ab3dE6gH9")]
    # [ARGS] dropped by a decoder that skips it (vLLM's older v11 form); an id that is not Mistral's is replaced
    assert read(mistral, '[TOOL_CALLS]add{"a": 2, "b": 40}') == [("add", {"a": 2, "b": 40}, "call00000")]
    assert read(mistral, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 1}, "id": "call_1"}]')[0][2] == (
        "call00000")
    # Qwen3-Coder's <function=...> block without <tool_call> (vLLM reads it too)
    assert read(qwen3_coder, "<function=shout>\n<parameter=text>\nhi\n</parameter>\n</function>") == [
        ("shout", {"text": "hi"}, "call_0")]


CALLS = [{"type": "function", "id": "Ab3dE6gH9", "function": {"name": "add", "arguments": {"a": 2, "b": 40}}},
         {"type": "function", "id": "zz9zz9zz9", "function": {"name": "configure", "arguments": {
             "options": {"depth": [1, 2], "name": "x y"}, "verbose": True, "ratio": 0.5, "tags": ["a", "b"],
             "note": "None of it"}}}]
FAMILIES = {  # parser -> (a tokenizer with the family's layout, its end of turn, calls its template writes per turn)
    "qwen3_coder": (lambda: qwen_style_tokenizer(QWEN3_CODER_STYLE_TEMPLATE), "<|im_end|>", 2),
    "llama3_json": (llama3_style_tokenizer, "<|eot_id|>", 1),
    "mistral": (mistral_style_tokenizer, "</s>", 2),
    "mistral_v11": (lambda: mistral_style_tokenizer(MISTRAL_V11_STYLE_TEMPLATE), "</s>", 2),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_calls_a_familys_template_renders_are_read_back(family):
    """Qwen3-Coder's template writes a dict as its Python repr and true as True: typed back by the schema."""
    make, end, num_calls = FAMILIES[family]
    tokenizer, calls = make(), CALLS[:num_calls]
    user = [{"role": "user", "content": "Add 2 and 40, then set things up."}]
    prompt = tokenizer.apply_chat_template(user, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    message = {"role": "assistant", "content": "Adding first.", "tool_calls": calls}
    whole = tokenizer.apply_chat_template([*user, message], tools=TOOLS, tokenize=False)
    assert whole.startswith(prompt)
    turn = whole[len(prompt):whole.index(end, len(prompt))]
    parsed = read(PARSERS[family.removesuffix("_v11")], turn)
    assert [(n, a) for n, a, _ in parsed] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    if family == "mistral":
        assert [i for _, _, i in parsed] == [c["id"] for c in calls]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_parser_that_reads_no_call_of_the_models_layout_is_refused_naming_the_one_that_does(family):
    """The default hermes on a Llama 3 or Mistral model read every call as the answer: no tool ran, no error, and
    env/info/tool_calls stayed 0, as if the model never called. The run now stops before it starts, naming the
    parser that reads the template's own call; a template that writes no call (the toy model's) is not checked."""
    from transformers import AutoTokenizer

    from rollpacker.env.render import ChatBridge
    from rollpacker.errors import UserError
    from rollpacker.toy.model import toy_model_dir

    right = family.removesuffix("_v11")
    bridge = ChatBridge(FAMILIES[family][0]())
    bridge.check_tool_parser(right)
    for parser in set(PARSERS) - {right}:
        with pytest.raises(UserError, match=rf"env.tool_parser {parser} reads no tool call in the layout the chat "
                                            rf"template of .* writes one in .*: set env.tool_parser to {right}$"):
            bridge.check_tool_parser(parser)
    ChatBridge(qwen_style_tokenizer()).check_tool_parser("hermes")
    # DeepSeek's templates concatenate a call's arguments, a string: a dict raised TypeError, out of the run
    deepseek = QWEN_STYLE_TEMPLATE.replace(
        "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}",
        "{{ '{\"name\": \"' + call.function.name + '\", \"arguments\": ' + call.function.arguments + '}' }}")
    assert deepseek != QWEN_STYLE_TEMPLATE
    ChatBridge(qwen_style_tokenizer(deepseek)).check_tool_parser("hermes")
    with pytest.raises(UserError, match="set env.tool_parser to hermes$"):
        ChatBridge(qwen_style_tokenizer(deepseek)).check_tool_parser("llama3_json")
    for parser in PARSERS:
        ChatBridge(AutoTokenizer.from_pretrained(toy_model_dir())).check_tool_parser(parser)


def test_text_around_the_calls_and_a_plain_answer():
    assert read(qwen3_coder, "I'll add.\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n"
                             "2\n</parameter>\n</function>\n</tool_call>\nThat is all.") == [("add", {"a": 1, "b": 2},
                                                                                               "call_0")]
    assert read(llama3_json, 'Let me add.<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}\n'
                             'Then I answer.') == [("add", {"a": 1, "b": 2}, "call_0")]
    assert read(mistral, 'Let me add. [TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}] done') == [
        ("add", {"a": 1, "b": 2}, "call00000")]
    answer = 'The sum is 42 (of [1, 41] and {"a": 1}), no <function> or [TOOLS] needed.\n#### 42'
    for parser in PARSERS.values():
        assert parser(answer, TOOLS) == [] and parser("", TOOLS) == []
    # Llama's JSON is a call only as the turn (or after <|python_tag|>): JSON inside an answer is text
    assert llama3_json('The call would be {"name": "add", "parameters": {"a": 1, "b": 2}}.') == []
    # and an answer in JSON is text, as vLLM reads it: an untagged call is an object with a name
    assert llama3_json('{"answer": 42, "steps": ["add"]}') == [] and llama3_json('{not json') == []
    assert llama3_json('{"name": "Alice", "age": 3}', TOOLS) == []  # names no tool, has no arguments
    assert read(llama3_json, '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}') == [
        ("add", {"a": 1, "b": 2}, "call_0")]


def test_a_call_cut_by_a_stop_string_still_counts():
    whole = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
             "</function>\n</tool_call>")
    for stop in ("</tool_call>", "</function>"):  # the action text is cut before the stop string
        assert read(qwen3_coder, whole[:whole.index(stop)]) == [("add", {"a": 1, "b": 2}, "call_0")]
    assert read(hermes, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n') == [
        ("add", {"a": 1, "b": 2}, "call_0")]


ADD_2_3 = {"hermes": '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
           "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
                          "</parameter>\n</function>\n</tool_call>"}
STRIP_THINK = {"hermes": '<tool_call>\n{"name": "sub", "arguments": {"pattern": "<think>.*</think>"}}\n</tool_call>',
               "qwen3_coder": "<tool_call>\n<function=sub>\n<parameter=pattern>\n<think>.*</think>\n</parameter>\n"
                              "</function>\n</tool_call>"}


@pytest.mark.parametrize("name", list(ADD_2_3))
def test_calls_are_read_after_the_reasoning_and_a_mentioned_tag_swallows_none(name):
    """A call drafted in <think> is not made (vLLM's Qwen3 reasoning parser reads after the first </think>); a
    <tool_call> written in a sentence, before the call, after it or in an answer, neither swallows the call nor is
    one (qwen3_coder read the last two as a broken call: the answer became a tool error)."""
    parser, call = PARSERS[name], ADD_2_3[name]
    assert parser(f"<think>\nI could write {call}, but 2+3 is easy.\n</think>\n\nThe answer is 5.", TOOLS) == []
    made = [("add", {"a": 2, "b": 3}, "call_0")]
    assert read(parser, f"<think>\nThe format is <tool_call> then the call.\n</think>\n\n{call}") == made
    assert read(parser, f"<think>\n{call}\n</think>\n\nI wrap a call in <tool_call> tags:\n{call}") == made
    assert read(parser, f"{call}\nDone: I wrapped it in <tool_call> tags.") == made
    assert parser("The answer is 5. (I would wrap a call in <tool_call> tags.)", TOOLS) == []
    # a call whose argument holds </think> (code that strips think tags) is made
    assert read(parser, f"<think>\nStrip the tags.\n</think>\n\n{STRIP_THINK[name]}") == [
        ("sub", {"pattern": "<think>.*</think>"}, "call_0")]


def test_hermes_reads_a_calls_json_whole_before_its_tags():
    """A ``<tool_call>`` inside a string argument was read as the next call (the call became "not JSON"); an
    unclosed call before another vanished; a tag mentioned after a call, or in an answer, was a broken call."""
    code = '{"name": "shout", "arguments": {"text": "write <tool_call> then </tool_call>"}}'
    assert read(hermes, f"<tool_call>\n{code}\n</tool_call>") == [
        ("shout", {"text": "write <tool_call> then </tool_call>"}, "call_0")]
    assert read(hermes, '<tool_call>{"name": "add", "arguments": {"a": 1}}\n<tool_call>{"name": "add", "arguments": '
                        '{"a": 2}}</tool_call>') == [("add", {"a": 1}, "call_0"), ("add", {"a": 2}, "call_1")]
    assert hermes("Use the <tool_call> tag to call a tool.\n#### 42", TOOLS) == []
    assert read(hermes, f"{ADD_2_3['hermes']}\nThat was a <tool_call>, as the format says.") == [
        ("add", {"a": 2, "b": 3}, "call_0")]
    assert errors(hermes, '<tool_call>{"name": "add", "arguments": {"a": 1}} and more</tool_call>') == [
        ("", "the tool call is not JSON (Extra data at 39)")]
    assert errors(hermes, '<tool_call>{"name": "add", "arg <tool_call>{"name": "shout", "arguments": {"text": "x"}}'
                  ) == [("", "the tool call is not JSON (Unterminated string starting at 16)"), ("shout", "")]


def errors(parser, text: str) -> list[tuple[str, str]]:
    """Each call read from ``text``: (its name, its error or "")."""
    return [(c.name, c.error) for c in parser(text, TOOLS)]


@pytest.mark.parametrize("parser, text, expected", [
    # Qwen3-Coder's XML
    (qwen3_coder, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
     [("", "<tool_call> is not followed by <function=NAME>")]),
    (qwen3_coder, "<tool_call>\n<function=>\n</function>\n</tool_call>", [("", "'<function=>' names no function")]),
    (qwen3_coder, "<tool_call>\n<function=add", [("", "'<function=add' names no function")]),
    (qwen3_coder, "<tool_call>\n<function=add>\n<parameter=a>\n1", [("add", "parameter 'a' is not closed")]),
    (qwen3_coder, "<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</function>",
     [("add", "parameter 'a' is not closed")]),
    (qwen3_coder, "<tool_call>\n<function=add>\nadd 1 and 2\n</function>\n</tool_call>",
     [("add", "unexpected text 'add 1 and 2\\n</function>\\n</tool_call>' in <function=add>")]),
    (qwen3_coder, "<tool_call>\n<function=add>\n<parameter=a>\ntwo\n</parameter>\n</function>\n</tool_call>\n"
                  "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n1\n</parameter>\n"
                  "</function>\n</tool_call>\n<tool_call>\n<function=shout>\n<parameter=text>\nok\n</parameter>\n"
                  "</function>\n</tool_call>",
     [("add", "parameter 'a' of add: an integer, got 'two'"), ("add", "<function=add> gives parameter 'a' twice"),
      ("shout", "")]),
    # Arguments under another key than the format's: not a call run without them
    (hermes, '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call><tool_call>{"name": "add", "id": "x", '
             '"type": "function"}</tool_call>',
     [("", 'arguments go under "arguments", got keys ["name", "parameters"]'), ("add", "")]),
    (llama3_json, '{"name": "add", "args": {"a": 1}}',
     [("", 'arguments go under "parameters" or "arguments", got keys ["name", "args"]')]),
    (mistral, '[TOOL_CALLS] [{"name": "add", "args": {"a": 1}, "id": "Ab3dE6gH9"}, {"name": "add", "id": "Ab3dE6gH8"}]',
     [("", 'arguments go under "arguments", got keys ["name", "args", "id"]'), ("add", "")]),
    # Llama 3's JSON
    (llama3_json, '{"name": "add", "parameters": {"a": 1,}}', [("", "the tool call is not JSON (Expecting property "
                                                                    "name enclosed in double quotes at 38)")]),
    (llama3_json, '{"name": "add", "parameters": {"a": 1', [("", "the tool call is not JSON (Expecting ',' "
                                                                 "delimiter at 37)")]),
    (llama3_json, '<|python_tag|>{"parameters": {"a": 1}}', [("", 'a tool call is {"name": NAME, "parameters": '
                                                                  '{...}}, got {"parameters": {"a": 1}}')]),
    (llama3_json, '<|python_tag|>brave_search.call(query="weather")', [("", "the tool call is not JSON (Expecting "
                                                                            "value at 0)")]),
    (llama3_json, '{"name": "add", "parameters": {"a": 1}, "arguments": {"b": 2}}', [("", "a tool call is {")]),
    (llama3_json, '{"name": "add", "parameters": [1, 2]}; {"name": "shout", "parameters": {"text": "x"}}; {"na',
     [("", "a tool call is {"), ("shout", ""), ("", "the tool call is not JSON (Unterminated string")]),
    # Mistral's
    (mistral, '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}]', [("", "the tool calls are not JSON")]),
    (mistral, '[TOOL_CALLS] [{"arguments": {"a": 1}}, {"name": "add", "arguments": "nope"}]',
     [("", 'a tool call is [TOOL_CALLS][{"name": NAME'), ("", 'a tool call is [TOOL_CALLS][{"name": NAME')]),
    (mistral, "[TOOL_CALLS] []", [("", "[TOOL_CALLS] [ starts a list of calls")]),
    (mistral, '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}', [("", "[TOOL_CALLS] is followed by '{")]),
    (mistral, '[TOOL_CALLS][ARGS]{"a": 1}', [("", "[TOOL_CALLS] is followed by '[ARGS]")]),
    (mistral, "[TOOL_CALLS]add", [("", "[TOOL_CALLS] is followed by 'add'")]),
    (mistral, '[TOOL_CALLS]add[ARGS]{"a": 1', [("add", "the arguments of add are not JSON")]),
    (mistral, '[TOOL_CALLS]add[ARGS][1, 2][TOOL_CALLS]shout[ARGS]{"text": "x"}',
     [("add", "the arguments of add are not a JSON object"), ("shout", "")]),
])
def test_a_malformed_call_is_an_error_naming_the_format(parser, text, expected):
    got = errors(parser, text)
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (_, error), (_, want) in zip(got, expected):
        assert (want in error) if want else error == "", (error, want)


DIGITS, DEEP = "1" * 5000, "[" * 5000  # a policy repeating one character: json raises besides JSONDecodeError


@pytest.mark.parametrize("parser, text, expected", [
    (hermes, f'<tool_call>{{"name": "add", "arguments": {{"a": {DIGITS}}}}}</tool_call>',
     "the tool call is not JSON (ValueError: Exceeds the limit"),
    (hermes, f"<tool_call>{DEEP}</tool_call>", "the tool call is not JSON (RecursionError"),
    (llama3_json, f'{{"name": "add", "parameters": {{"a": {DIGITS}}}}}', "the tool call is not JSON (ValueError"),
    (llama3_json, f'{{"name": "add", "parameters": {DEEP}', "the tool call is not JSON (RecursionError"),
    (mistral, f'[TOOL_CALLS] [{{"name": "add", "arguments": {{"a": {DIGITS}}}}}]', "the tool calls are not JSON"),
    (mistral, f"[TOOL_CALLS]add[ARGS]{DEEP}", "the arguments of add are not JSON (RecursionError"),
    (qwen3_coder, f"<tool_call>\n<function=shout>\n<parameter=text>\n{DEEP}\n</parameter>\n</function>\n"
                  "</tool_call>", ""),  # a string parameter: the text as it is
    (qwen3_coder, f"<tool_call>\n<function=add>\n<parameter=a>\n{DEEP}\n</parameter>\n</function>\n</tool_call>",
     "parameter 'a' of add: an integer, got '[[["),
])
def test_degenerate_json_is_a_malformed_call_not_a_crash(parser, text, expected):
    [(_, error)] = errors(parser, text)
    assert (expected in error) if expected else error == "", error


def test_a_call_json_reads_near_the_recursion_limit_but_cannot_write_back_is_an_error_not_a_crash():
    """Its error message wrote the JSON back (json.dumps), which raised RecursionError out of the parser."""
    for depth in range(sys.getrecursionlimit() - 300, sys.getrecursionlimit()):
        nested = "[" * depth + "]" * depth
        for parser, text in ((mistral, f'[TOOL_CALLS] [{{"name": 5, "arguments": {nested}}}]'),
                             (llama3_json, f'<|python_tag|>{{"name": 5, "parameters": {nested}}}')):
            assert all(call.error for call in parser(text, TOOLS)), (parser, depth)


def test_qwen3_coder_reads_a_union_parameter_as_the_first_of_its_types_that_fits():
    """int | str, int | float, list[int] | str: only the first type was tried (valid calls were answered with an
    error); None is text where the union takes a string."""
    union = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": ["integer", "string"]}, "v": {"anyOf": [{"type": "integer"}, {"type": "number"}]},
        "items": {"anyOf": [{"type": "array"}, {"type": "string"}]}, "n": {"type": ["integer", "boolean"]}}}}}]

    def parse(**values):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        [call] = qwen3_coder(f"<function=f>\n{body}</function>", union)
        return call.error or call.arguments

    assert parse(x="alice", v="2.5", items="1,2,3") == {"x": "alice", "v": 2.5, "items": "1,2,3"}
    assert parse(x="7", v="3", items="[1]", n="true") == {"x": 7, "v": 3, "items": [1], "n": True}
    assert parse(x="None", n="None") == {"x": "None", "n": None}
    assert parse(n="maybe") == "parameter 'n' of f: an integer or true or false, got 'maybe'"


def test_qwen3_coder_types_values_by_the_tools_schema():
    def parse(**values):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in values.items())
        [call] = qwen3_coder(f"<tool_call>\n<function=configure>\n{body}</function>\n</tool_call>", TOOLS)
        return call.error or call.arguments

    assert parse(options='{"a": [1, 2]}', verbose="true", ratio="2", tags='["x"]', note="None") == {
        "options": {"a": [1, 2]}, "verbose": True, "ratio": 2, "tags": ["x"], "note": None}
    assert parse(options="{'a': None}", verbose="False", ratio="-0.25", tags="['x', 'y']", note="null it") == {
        "options": {"a": None}, "verbose": False, "ratio": -0.25, "tags": ["x", "y"], "note": "null it"}
    assert parse(extra="42") == {"extra": "42"}  # a parameter the schema does not have: its text
    assert qwen3_coder("<function=unknown>\n<parameter=n>\n7\n</parameter>\n</function>", TOOLS)[0].arguments == {
        "n": "7"}
    assert qwen3_coder("<function=add>\n<parameter=a>\n7\n</parameter>\n</function>")[0].arguments == {"a": "7"}
    assert parse(verbose="yes") == "parameter 'verbose' of configure: true or false, got 'yes'"
    assert parse(ratio="nan") == "parameter 'ratio' of configure: a finite number, got 'nan'"
    assert parse(options="[1]") == "parameter 'options' of configure: a JSON object, got '[1]'"
    assert parse(tags="x, y") == "parameter 'tags' of configure: a JSON array, got 'x, y'"
    [call] = qwen3_coder("<function=add>\n<parameter=a>\n2.5\n</parameter>\n</function>", TOOLS)
    assert call.error == "parameter 'a' of add: an integer, got '2.5'"
    # anyOf, a list of types, and vLLM's type names
    anyof = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "y": {"type": ["null", "number"]},
        "z": {"type": "bool"}}}}}]
    assert qwen3_coder("<function=f>\n<parameter=x>\n3\n</parameter>\n<parameter=y>\nNone\n</parameter>\n"
                       "<parameter=z>\nTRUE\n</parameter>\n</function>", anyof)[0].arguments == {"x": 3, "y": None,
                                                                                               "z": True}


# One good call and one malformed, in each family's format: the good one runs, the other is answered
# with an error and counted. qwen3_coder's "2" and "40" are added as integers: ToolEnv gives the schemas.
MALFORMED = {
    "hermes": '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call><tool_call>{oops</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n40\n</parameter>\n"
                   "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n2\n</function>\n</tool_call>",
    "llama3_json": '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 40}}; {"name": "add", "parameters": ',
    "mistral": '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 40}[TOOL_CALLS]add[ARGS]{"a": 2',
}


@pytest.mark.parametrize("name", list(PARSERS))
def test_tool_env_answers_a_malformed_call_with_an_error_and_counts_it(name):
    env = ToolEnv(FUNCTIONS, name)
    contract.reset(env, seed=0, row={"prompt": "p"})
    step = contract.step(env, MALFORMED[name])
    good, bad = step.observation
    assert (good["role"], good["name"], good["content"]) == ("tool", "add", "42")
    assert bad["role"] == "tool" and bad["content"].startswith("error: ") and "not" in bad["content"]
    assert step.info == {"tool_calls": 2, "tool_errors": 1} and not step.terminated
    assert good["tool_call_id"] != bad["tool_call_id"]
    answer = contract.step(env, "It is 42.\n#### 42")
    assert (answer.observation, answer.terminated) == ([], True)


def test_every_error_is_cut_to_max_tool_result_chars():
    """A failed call's error is cut as a result is (env.max_tool_result_chars): an unknown name or a malformed call
    can be as long as the model wrote it."""
    long = "x" * 5000
    for name, turn in (("hermes", f'<tool_call>{{"name": "{long}", "arguments": {{}}}}</tool_call>'),
                       ("qwen3_coder", f"<tool_call>\n<function=do {long}>\n</function>\n</tool_call>"),
                       ("hermes", f'<tool_call>{{"name": "shout", "arguments": {{"text": "{long}"}}}}</tool_call>')):
        env = ToolEnv(FUNCTIONS, name, max_result_chars=100)
        contract.reset(env, seed=0, row={"prompt": "p"})
        [message] = contract.step(env, turn).observation
        assert len(message["content"]) < 150 and "characters cut ...]" in message["content"], message["content"]


class SearchEnv:
    """An environment with a tool of its own, as a verifiers ToolEnv's reset gives it."""

    def reset(self, *, seed, options):
        return "Find x.", {"tools": [{"type": "function", "function": {"name": "search", "parameters": {
            "type": "object", "properties": {"q": {"type": "string"}}}}}]}

    def step(self, action):
        return f"searched: {action}", None, False, False, {}


def test_a_call_to_the_environments_tool_beside_env_tools_is_told_to_come_alone():
    """A turn of the environment's calls alone steps it; beside calls to env.tools it is not stepped, and its tool's
    call is the model's mistake, named as such (not "no tool named 'search'": the environment offered it)."""
    env = ToolEnv(FUNCTIONS, "hermes", inner=SearchEnv())
    contract.reset(env, seed=0, row={"prompt": "p"})
    search = '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
    mixed = contract.step(env, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' + search)
    assert [m["content"] for m in mixed.observation] == [
        "3", "error: search is the environment's tool: call it in a turn of its own, without calls to add, shout, "
             "configure"]
    assert mixed.info == {"tool_calls": 2, "tool_errors": 1}
    assert contract.step(env, search).observation[0]["content"] == f"searched: {search}"


def test_every_parser_is_an_env_tool_parser():
    for name in PARSERS:
        assert EnvConfig(tools=("python",), tool_parser=name).tool_parser == name
    with pytest.raises(ValueError, match="env.tool_parser must be one of hermes, qwen3_coder, llama3_json, mistral, "
                                         "got 'llama3'"):
        EnvConfig(tool_parser="llama3")


@pytest.mark.parametrize("family", ["llama3_json", "mistral", "mistral_v11"])
def test_a_sampled_turn_keeps_its_formats_special_tokens_and_its_results_render(family):
    """Decoding drops special tokens, Mistral's [TOOL_CALLS] and Llama's <|python_tag|> among them: the bridge
    keeps the parser's. Then the results render after the turn: Mistral v3's with the calls' ids, Llama 3.1's
    two after a template that takes one call per turn."""
    parser = PARSERS[family.removesuffix("_v11")]
    tokenizer = FAMILIES[family][0]()
    turns = {"llama3_json": f"Adding first.{TURNS['llama3_json'][0]}", "mistral": TURNS["mistral"][0],
             "mistral_v11": '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 40}[TOOL_CALLS]shout[ARGS]{"text": "hi"}'}
    turn_ids = tokenizer(turns[family] + FAMILIES[family][1], add_special_tokens=False)["input_ids"]
    assert parser(ChatBridge(tokenizer).action_text(turn_ids)) == []  # the markers were dropped
    bridge = ChatBridge(tokenizer, tools=TOOLS, keep=parser.markers)
    action = bridge.action_text(turn_ids)
    assert action == turns[family]
    env = ToolEnv(FUNCTIONS, family.removesuffix("_v11"))
    contract.reset(env, seed=0, row={"prompt": "p"})
    step = contract.step(env, action)
    assert [m["content"] for m in step.observation] == ["42", "HI!"] and step.info["tool_errors"] == 0
    delta = tokenizer.decode(bridge.observation_ids(step.observation, turn_ids))
    assert delta == {
        "llama3_json": "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
                       "<|start_header_id|>ipython<|end_header_id|>\n\nHI!<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "mistral": '[TOOL_RESULTS] {"content": "42", "call_id": "Ab3dE6gH9"}[/TOOL_RESULTS]'
                   '[TOOL_RESULTS] {"content": "HI!", "call_id": "zz9zz9zz9"}[/TOOL_RESULTS]',
        "mistral_v11": "[TOOL_RESULTS]42[/TOOL_RESULTS][TOOL_RESULTS]HI![/TOOL_RESULTS]"}[family]


def test_tool_call_tags_read_the_same_whether_or_not_a_vocabulary_makes_them_special():
    """Qwen's <tool_call> is a plain added token: keeping it changes no text. A vocabulary where it is special
    would lose it in decoding: the bridge keeps it."""
    turn = TURNS["hermes"][0] + "<|im_end|>"
    qwen = qwen_style_tokenizer()
    ids = qwen(turn, add_special_tokens=False)["input_ids"]
    assert ChatBridge(qwen, keep=PARSERS["hermes"].markers).action_text(ids) == ChatBridge(qwen).action_text(ids) == (
        TURNS["hermes"][0])
    special = chat_tokenizer(QWEN_STYLE_TEMPLATE, ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>",
                                                   "</tool_call>"], eos="<|im_end|>")
    ids = special(turn, add_special_tokens=False)["input_ids"]
    assert hermes(ChatBridge(special).action_text(ids)) == []
    assert read(hermes, ChatBridge(special, keep=PARSERS["hermes"].markers).action_text(ids)) == TURNS["hermes"][1]
