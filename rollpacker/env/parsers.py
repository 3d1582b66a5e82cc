"""Tool-call parsers: a model turn's text -> its tool calls, in the format the model's family was trained on.

``env.tool_parser`` names one of :data:`PARSERS`. Each reads a turn as its chat template writes an
assistant tool call (learnt from vLLM's and SGLang's parsers of the same name and the models'
templates; the formats are in ``docs/environments.md``). The contract, for every parser:

- the calls come back in the order written; none: the turn is the model's answer;
- it never raises: a call it cannot read is a :class:`ToolCall` with ``error`` set, answered
  with an ``error: ...`` tool message and counted (``tool_errors``): the model's mistake;
- a call cut by a stop string before its closing tag still counts when what is there is whole;
- arguments under a key the format does not use are an error, not a call run without them;
- ids are deterministic (a replayed turn gets the same ones), in the form the template accepts.

Where vLLM quietly turns a malformed call into text or a wrong value (``qwen3_coder``'s boolean
``"yes"`` becomes false), these answer an error instead: in training, the mistake is the signal.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class ToolCall:
    """One tool call read from a model turn; ``error`` says why it cannot run."""

    name: str
    arguments: dict
    id: str
    error: str = ""


@dataclass(frozen=True)
class Parser:
    """A format: ``parse(text, tools)`` reads a turn (``tools``: the schemas the template got)."""

    parse: Callable[[str, Sequence[dict]], list[ToolCall]]
    markers: tuple[str, ...] = ()
    """Special tokens the format writes. Decoding a turn drops special tokens; the action text keeps these."""

    def __call__(self, text: str, tools: Sequence[dict] = ()) -> list[ToolCall]:
        return self.parse(text, tools)


_NOT_JSON = (ValueError, RecursionError)
"""What json raises on text it cannot read: JSONDecodeError (a ValueError); ValueError for an integer of more
digits than ``sys.get_int_max_str_digits()``; RecursionError for nesting past the recursion limit."""


def _why(e: Exception) -> str:
    """Why json refused the text, in a few words."""
    if isinstance(e, json.JSONDecodeError):  # "Unterminated string starting at" says its own "at"
        return f"{e.msg.removesuffix(' at')} at {e.pos}"
    return f"{type(e).__name__}: {str(e)[:60]}"


def _after_think(text: str) -> str:
    """The turn after its reasoning (its first ``</think>``), as vLLM's Qwen3 reasoning parser splits it: a call
    drafted while thinking is not made; one whose arguments hold ``</think>`` (code that strips think tags) is."""
    end = text.find("</think>")
    return text if end < 0 else text[end + len("</think>"):]


def _shown(value: Any) -> str:
    """``value`` as JSON in at most 80 characters (its type, nested too deep to write back: json read it near the
    recursion limit)."""
    try:
        return json.dumps(value)[:80]
    except RecursionError:
        return f"a {type(value).__name__} nested too deep to show"


def _misplaced(value: Any, keys: tuple[str, ...]) -> str:
    """Why a named JSON call with none of ``keys`` is not a call without arguments: it has keys besides its name,
    id and type ("" when it has one of ``keys``, or nothing else; a call without a name is refused by its form)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or any(k in value for k in keys):
        return ""
    if set(value) <= {"name", "id", "type"}:
        return ""
    return f"arguments go under {' or '.join(map(json.dumps, keys))}, got keys {json.dumps(list(value))[:80]}"


# hermes: Qwen2.5, Qwen3, NousResearch

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder()


def _hermes_bodies(text: str) -> list[str]:
    """The text inside each hermes call. Its JSON is read whole first, so a ``<tool_call>`` inside a string argument
    stays in it, and a whole call needs no ``</tool_call>`` (cut by a stop string, or the next call opening); a body
    that is not whole JSON runs to its ``</tool_call>``, else to the next call when it opens an object (a broken
    call). A ``<tool_call>`` with neither is a mention in a sentence: text, swallowing nothing."""
    bodies, pos = [], text.find(_OPEN)
    while pos >= 0:
        start = pos + len(_OPEN)
        first = _skip_space(text, start)
        try:
            end = _DECODER.raw_decode(text, first)[1]
            after = _skip_space(text, end)
        except _NOT_JSON:
            end = after = -1
        if end >= 0 and (after == len(text) or text.startswith((_OPEN, _CLOSE), after)):
            bodies.append(text[start:end])
            pos = text.find(_OPEN, after + len(_CLOSE) if text.startswith(_CLOSE, after) else after)
            continue
        later, close = text.find(_OPEN, start), text.find(_CLOSE, start)
        if close >= 0 and (later < 0 or close < later):
            bodies.append(text[start:close])
            later = text.find(_OPEN, close + len(_CLOSE))
        elif text.startswith("{", first):
            bodies.append(text[start:later if later >= 0 else len(text)])
        pos = later
    return bodies


def hermes(text: str, tools: Sequence[dict] = ()) -> list[ToolCall]:
    """Hermes-style calls (Qwen2.5/3, NousResearch): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    after the turn's ``</think>``; a call cut by a stop string before its closing tag still counts."""
    calls = []
    for i, body in enumerate(_hermes_bodies(_after_think(text))):
        call_id = f"call_{i}"
        try:
            value = json.loads(body)
        except _NOT_JSON as e:
            calls.append(ToolCall("", {}, call_id, f"the tool call is not JSON ({_why(e)})"))
            continue
        if misplaced := _misplaced(value, ("arguments",)):
            calls.append(ToolCall("", {}, call_id, misplaced))
            continue
        arguments = value.get("arguments", {}) if isinstance(value, dict) else None
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except _NOT_JSON:
                arguments = None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not isinstance(arguments, dict):
            calls.append(ToolCall("", {}, call_id, 'a tool call is {"name": str, "arguments": {...}}'))
            continue
        calls.append(ToolCall(value["name"], arguments, call_id))
    return calls


# qwen3_coder: Qwen3-Coder (and Qwen3.5's XML calls)

_QWEN3_CODER_FORM = "<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n</function>\n</tool_call>"
_NAME = re.compile(r"[^\s<>{}\[\]\"'=]+")
"""A function or parameter name: no space, quote, bracket or brace."""
_PARAM_END = re.compile(r"</parameter>(?=\s*(?:<parameter=|</function>|</tool_call>|$))")


def qwen3_coder(text: str, tools: Sequence[dict] = ()) -> list[ToolCall]:
    """Qwen3-Coder's XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>``. Values are text, converted by the tool's JSON schema (integer, number,
    boolean, object, array, null); an argument the schema does not type stays a string. A ``<function=``
    block without ``<tool_call>`` counts too (as vLLM reads it); a call cut after a closed parameter counts.
    Only the text after the turn's ``</think>`` is read; a ``<tool_call>`` that no ``</tool_call>`` closes before
    the next call or the turn's end is text (``I wrap a call in <tool_call> tags``), not a malformed call."""
    text = _after_think(text)
    properties = _properties(tools)
    calls: list[ToolCall] = []
    pos = 0
    while True:
        start = _next_call(text, pos)
        if start < 0:
            return calls
        call_id = f"call_{len(calls)}"
        wrapped = text.startswith("<tool_call>", start)
        body = _skip_space(text, start + len("<tool_call>")) if wrapped else start
        if not text.startswith("<function=", body):
            later = _next_call(text, body)
            end = text.find("</tool_call>", body, later if later >= 0 else len(text))
            if end < 0:  # a mention, not closed before the next call or the end: text
                if later < 0:
                    return calls
                pos = later
                continue
            calls.append(ToolCall("", {}, call_id, f"a tool call is {_QWEN3_CODER_FORM}: <tool_call> is not "
                                                   "followed by <function=NAME>"))
            pos = end + len("</tool_call>")
            continue
        call, pos = _xml_function(text, body, call_id, properties)
        if wrapped:
            after = _skip_space(text, pos)
            if text.startswith("</tool_call>", after):
                pos = after + len("</tool_call>")
        calls.append(call)


def _xml_function(text: str, start: int, call_id: str, properties: dict[str, dict]) -> tuple[ToolCall, int]:
    """The ``<function=NAME>...</function>`` block at ``start``: its call and where it ends."""
    head_end = text.find(">", start)
    name = text[start + len("<function="):head_end] if head_end >= 0 else ""
    if head_end < 0 or not _NAME.fullmatch(name):
        shown = text[start:start + 40] if head_end < 0 else text[start:head_end + 1]
        return ToolCall("", {}, call_id, f"{shown!r} names no function: a tool call is {_QWEN3_CODER_FORM}"), (
            len(text) if head_end < 0 else head_end + 1)
    schema = properties.get(name, {})
    arguments: dict[str, Any] = {}
    pos = head_end + 1
    while True:
        pos = _skip_space(text, pos)
        if pos >= len(text) or text.startswith("</tool_call>", pos):
            return ToolCall(name, arguments, call_id), pos  # cut before </function> (a stop string): whole so far
        if text.startswith("</function>", pos):
            return ToolCall(name, arguments, call_id), pos + len("</function>")
        if not text.startswith("<parameter=", pos):
            return ToolCall(name, {}, call_id, f"unexpected text {text[pos:pos + 40]!r} in <function={name}>: "
                                               f"a tool call is {_QWEN3_CODER_FORM}"), _skip_call(text, pos)
        key_end = text.find(">", pos)
        key = text[pos + len("<parameter="):key_end] if key_end >= 0 else ""
        close = _PARAM_END.search(text, key_end + 1) if key_end >= 0 else None
        value = text[key_end + 1:close.start()] if close is not None else ""
        if "\n<parameter=" in value and "</parameter>" not in value:
            close = None  # the next parameter opened before this one closed
        if not _NAME.fullmatch(key) or close is None:
            what = f"parameter {key!r} is not closed by </parameter>" if _NAME.fullmatch(key) else (
                f"{text[pos:pos + 40]!r} names no parameter")
            return ToolCall(name, {}, call_id, f"in <function={name}>, {what}: a tool call is "
                                               f"{_QWEN3_CODER_FORM}"), _skip_call(text, pos)
        if key in arguments:
            return ToolCall(name, {}, call_id, f"<function={name}> gives parameter {key!r} twice"), _skip_call(
                text, pos)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        try:
            arguments[key] = _convert(value, schema.get(key))
        except ValueError as e:
            return ToolCall(name, {}, call_id, f"parameter {key!r} of {name}: {e}"), _skip_call(text, pos)
        pos = close.end()


def _next_call(text: str, pos: int) -> int:
    """Where the next ``<tool_call>`` or ``<function=`` from ``pos`` starts (-1: none)."""
    return min((i for i in (text.find("<tool_call>", pos), text.find("<function=", pos)) if i >= 0), default=-1)


def _skip_call(text: str, pos: int) -> int:
    """After a malformed call: the end of its ``</tool_call>`` (or ``</function>``), or of the text."""
    ends = [i + len(tag) for tag in ("</tool_call>", "</function>") if (i := text.find(tag, pos)) >= 0]
    return min(ends, default=len(text))


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


_TYPES = {"integer": "integer", "int": "integer", "number": "number", "float": "number", "boolean": "boolean",
          "bool": "boolean", "object": "object", "dict": "object", "array": "array", "list": "array",
          "string": "string", "str": "string", "null": "null"}


def _convert(value: str, schema: Any) -> Any:
    """A parameter's text as its JSON schema types it, as the first of its types that reads it (a union such as
    ``int | str`` tries each); a ValueError says what it is not. Untyped: the text."""
    types = _schema_types(schema)
    kinds = [t for t in types if t != "null"] or ["string"]
    if value.strip().lower() in ("null", "none") and ("null" in types or "string" not in kinds):
        return None  # the template writes None as "None"
    wanted = []
    for kind in kinds:
        try:
            return _convert_as(value, kind)
        except ValueError as e:
            wanted.append(str(e))
    raise ValueError(f"{' or '.join(wanted)}, got {value[:80]!r}")


def _convert_as(value: str, kind: str) -> Any:
    """``value`` as one JSON type (not "null"); a ValueError names what it had to be."""
    if kind == "string":
        return value
    if kind == "integer":
        try:
            return int(value)
        except ValueError:
            raise ValueError("an integer") from None
    if kind == "number":
        try:
            number = float(value)
        except ValueError:
            raise ValueError("a number") from None
        if not math.isfinite(number):
            raise ValueError("a finite number")
        return int(number) if number.is_integer() and "." not in value and "e" not in value.lower() else number
    if kind == "boolean":
        if value.strip().lower() not in ("true", "false"):
            raise ValueError("true or false")
        return value.strip().lower() == "true"
    parsed = _literal(value)
    if isinstance(parsed, str):  # encoded twice
        parsed = _literal(parsed)
    if not isinstance(parsed, dict if kind == "object" else list):
        raise ValueError(f"a JSON {kind}")
    return parsed


def _schema_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (``type``, a list of them, ``anyOf``/``oneOf``; ``nullable``)."""
    if not isinstance(schema, dict):
        return []
    options = schema.get("anyOf") or schema.get("oneOf") or [schema]
    types = ["null"] if schema.get("nullable") is True else []
    for option in options if isinstance(options, list) else []:
        kind = option.get("type") if isinstance(option, dict) else None
        for t in kind if isinstance(kind, list) else [kind]:
            if isinstance(t, str) and t.strip().lower() in _TYPES:
                types.append(_TYPES[t.strip().lower()])
    return types


def _literal(value: str) -> Any:
    """JSON, else a Python literal (the template writes a dict or list argument with ``| string``); else the text."""
    try:
        return json.loads(value)
    except _NOT_JSON:
        pass
    try:
        return ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def tool_functions(tools: Sequence[dict]) -> list[dict]:
    """The named functions of chat-template tool schemas (nested under "function", or flat)."""
    functions = [tool.get("function", tool) for tool in tools or () if isinstance(tool, dict)]
    return [fn for fn in functions if isinstance(fn, dict) and isinstance(fn.get("name"), str)]


def _properties(tools: Sequence[dict]) -> dict[str, dict]:
    """Each tool's parameter schemas, by tool name."""
    out = {}
    for fn in tool_functions(tools):
        params = fn.get("parameters")
        if isinstance(params, dict):
            out[fn["name"]] = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    return out


# llama3_json: Llama 3.1, 3.2, 3.3

_PYTHON_TAG = "<|python_tag|>"
_LLAMA_FORM = '{"name": NAME, "parameters": {...}}'
_LLAMA_NAMED = re.compile(r'\s*\{\s*"name"\s*:')
"""How an untagged call that is not JSON starts (cut, or broken): still a call, answered with what is wrong."""


def llama3_json(text: str, tools: Sequence[dict] = ()) -> list[ToolCall]:
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) as the whole turn,
    or after ``<|python_tag|>``; several are separated by ``;``. A turn is a call if it holds
    ``<|python_tag|>``, or starts with a JSON object that names a tool or has arguments (or with
    ``{"name":`` and is not JSON): other JSON, an answer as JSON, is text, as vLLM reads it. Text after the
    last call is left out. Built-in tools' Python (``brave_search.call(...)``) is not read: it is answered as a
    malformed call."""
    tag = text.find(_PYTHON_TAG)
    if tag >= 0:
        body = text[tag + len(_PYTHON_TAG):]
    elif text.lstrip().startswith("{") and _untagged_call(text, tools):
        body = text
    else:
        return []
    calls: list[ToolCall] = []
    decoder, pos = json.JSONDecoder(), _skip_space(body, 0)
    while True:
        call_id = f"call_{len(calls)}"
        try:
            value, pos = decoder.raw_decode(body, pos)
        except _NOT_JSON as e:
            calls.append(ToolCall("", {}, call_id, f"the tool call is not JSON ({_why(e)}): a tool call is "
                                                   f"{_LLAMA_FORM}, several separated by ;"))
            return calls
        calls.append(_json_call(value, call_id, ("parameters", "arguments"), _LLAMA_FORM))
        pos = _skip_space(body, pos)
        if body.startswith(";", pos):
            pos = _skip_space(body, pos + 1)
        if not body.startswith("{", pos):
            return calls


def _untagged_call(text: str, tools: Sequence[dict]) -> bool:
    """Whether a turn without ``<|python_tag|>`` is calls: it starts with a JSON object that names a tool or has
    arguments (other JSON, an answer as JSON, is text, as vLLM reads it), or with ``{"name":`` and is not JSON."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text, _skip_space(text, 0))
    except _NOT_JSON:
        return bool(_LLAMA_NAMED.match(text))
    return isinstance(value, dict) and isinstance(value.get("name"), str) and (
        value["name"] in {fn["name"] for fn in tool_functions(tools)} or "parameters" in value or "arguments" in value)


def _json_call(value: Any, call_id: str, keys: tuple[str, ...], form: str) -> ToolCall:
    """A decoded JSON call ``{"name": str, KEY: {...}}`` (KEY one of ``keys``; its object may be JSON text;
    none: no arguments, if the call has nothing but its name, id and type)."""
    if misplaced := _misplaced(value, keys):
        return ToolCall("", {}, call_id, misplaced)
    given = [k for k in keys if isinstance(value, dict) and k in value]
    arguments = value[given[0]] if len(given) == 1 else {} if not given else None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except _NOT_JSON:
            arguments = None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"] or not isinstance(
            arguments, dict):
        return ToolCall("", {}, call_id, f"a tool call is {form}, got {_shown(value)}")
    return ToolCall(value["name"], arguments, call_id)


# mistral: Mistral 7B v0.3, Mixtral 8x22B, Nemo (tokenizer v3); Mistral Small 3.2, Magistral, Devstral (v11+)

_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_FORM = '[TOOL_CALLS][{"name": NAME, "arguments": {...}}] or [TOOL_CALLS]NAME[ARGS]{...}'
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral(text: str, tools: Sequence[dict] = ()) -> list[ToolCall]:
    """Mistral's calls after ``[TOOL_CALLS]``: a JSON list ``[{"name": ..., "arguments": {...}, "id": ...}]``
    (tokenizers v3 to v7), or ``NAME[ARGS]{...}`` / ``NAME[CALL_ID]ID[ARGS]{...}``, one ``[TOOL_CALLS]``
    per call (v11+). Text before the first is left out. An id is the model's if it is Mistral's
    (9 letters and digits), else ``callNNNNN``: the templates refuse other ids."""
    calls: list[ToolCall] = []
    for segment in text.split(_TOOL_CALLS)[1:]:
        body = segment.lstrip()
        if body.startswith("[") and not body.startswith((_ARGS, _CALL_ID)):
            calls.extend(_mistral_list(body, len(calls)))
        else:
            calls.append(_mistral_named(body, len(calls)))
    return calls


def _mistral_id(index: int, given: Any = None) -> str:
    return given if isinstance(given, str) and _MISTRAL_ID.fullmatch(given) else f"call{index:05d}"


def _mistral_list(body: str, first: int) -> list[ToolCall]:
    """v3: ``[{"name": ..., "arguments": {...}, "id": ...}, ...]``."""
    try:
        value, _ = json.JSONDecoder().raw_decode(body)
    except _NOT_JSON as e:
        return [ToolCall("", {}, _mistral_id(first), f"the tool calls are not JSON ({_why(e)}): "
                                                     f"{_MISTRAL_FORM}")]
    if not isinstance(value, list) or not value:
        return [ToolCall("", {}, _mistral_id(first), f"[TOOL_CALLS] [ starts a list of calls: {_MISTRAL_FORM}")]
    return [_json_call(v, _mistral_id(first + i, v.get("id") if isinstance(v, dict) else None), ("arguments",),
                       _MISTRAL_FORM) for i, v in enumerate(value)]


def _mistral_named(body: str, index: int) -> ToolCall:
    """v11+: ``NAME[ARGS]{...}`` or ``NAME[CALL_ID]ID[ARGS]{...}`` (``NAME{...}`` where ``[ARGS]`` was dropped)."""
    head, sep, args = body.partition(_ARGS)
    if not sep:
        brace = body.find("{")
        head, args = (body[:brace], body[brace:]) if brace >= 0 else (body, "")
    name, _, given_id = head.partition(_CALL_ID)
    name, call_id = name.strip(), _mistral_id(index, given_id.strip())
    if not _NAME.fullmatch(name) or not args.strip():
        return ToolCall("", {}, call_id, f"[TOOL_CALLS] is followed by {body[:40]!r}: {_MISTRAL_FORM}")
    try:
        arguments, _ = json.JSONDecoder().raw_decode(args.lstrip())
    except _NOT_JSON as e:
        return ToolCall(name, {}, call_id, f"the arguments of {name} are not JSON ({_why(e)}): "
                                           f"{_MISTRAL_FORM}")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, call_id, f"the arguments of {name} are not a JSON object: {_MISTRAL_FORM}")
    return ToolCall(name, arguments, call_id)


_TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")  # plain added tokens in Qwen's vocabulary; kept where special

PARSERS: dict[str, Parser] = {
    "hermes": Parser(hermes, markers=_TOOL_CALL_TAGS),
    "qwen3_coder": Parser(qwen3_coder, markers=_TOOL_CALL_TAGS),
    "llama3_json": Parser(llama3_json, markers=(_PYTHON_TAG,)),
    "mistral": Parser(mistral, markers=(_TOOL_CALLS, _ARGS, _CALL_ID)),
}
"""``env.tool_parser`` -> the format's parser: ``(turn text, tool schemas) -> its tool calls`` (none: an answer)."""
