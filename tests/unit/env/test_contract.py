"""The environment contract, tools as functions and the toy environment, in this process."""

from __future__ import annotations

import dataclasses
import textwrap

import pytest
from support.chat import ADD_TOOL

from rollpacker.env import contract
from rollpacker.env.config import EnvConfig
from rollpacker.env.tools import ToolEnv, hermes, load_tools, schemas
from rollpacker.env.workers import EnvSpec

ENV_FILE = '''
class Counter:  # sync, a class as the factory
    def __init__(self, row):
        self.row, self.steps = row, 0

    def reset(self, *, seed, options):
        return f"count to {options['row']['n']}", {"seed": seed}

    def step(self, action):
        self.steps += 1
        done = action.strip() == str(self.row["n"])
        return ("" if done else "more"), (1.0 if done else None), done, False, {}

    def close(self):
        self.closed = True


class Librarian(Counter):  # with a tool of its own, which it runs in its step
    def reset(self, *, seed, options):
        return "define cat", {"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]}

    def step(self, action):
        self.steps += 1
        return [{"role": "tool", "content": "a small feline"}], None, False, False, {}


class AsyncEnv:  # async methods
    async def reset(self, *, seed, options):
        return [{"role": "user", "content": "hi"}], None

    async def step(self, action):
        return [{"role": "tool", "content": action.upper()}], 0.5, False, True, {"n": 1}


def make_async(row):
    return AsyncEnv()


class Garbage:
    def __init__(self, row):
        self.bad = row["bad"]

    def reset(self, *, seed, options):
        return {"trl": "Add 3.", "pair": ("Add 3.", {}), "empty": ([], {}),
                "schema": ("Add 3.", {"tools": [{"bogus": 1}]})}.get(self.bad, (None, {}))

    def step(self, action):
        return {
            "short": ("obs", 1.0, True),
            "reward": ("obs", "high", True, False, {}),
            "inf": ("obs", float("inf"), True, False, {}),
            "obs": (42, 1.0, True, False, {}),
            "flag": ("obs", 1.0, "yes", False, {}),
            "info": ("obs", 1.0, True, False, [1]),
        }[self.bad]
'''

TOOLS_FILE = '''
import asyncio
''' + ADD_TOOL + '''

async def shout(text: str) -> str:
    """Say it louder.

    Args:
        text: What to say.
    """
    await asyncio.sleep(0)
    return text.upper() + "!"


async def _back(text: str) -> str:
    return text


def echo(text: str) -> str:
    """Say it back (a plain def around an async client, as tools often are: it runs a loop of its own).

    Args:
        text: What to say.
    """
    return asyncio.run(_back(text))


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no")


def undocumented(x):
    return x


def circular(x: int) -> dict:
    """Returns a value JSON cannot write.

    Args:
        x: Anything.
    """
    value = {"x": x}
    value["self"] = value
    return value


def deep(x: int) -> list:
    """Returns a value nested deeper than JSON's writer recurses.

    Args:
        x: Anything.
    """
    value = []
    for _ in range(100_000):
        value = [value]
    return value


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


def odd(x: int) -> dict:
    """Returns an object whose text raises.

    Args:
        x: Anything.
    """
    return {"x": Unprintable()}


def city(x: int) -> dict:
    """A value with other letters than ASCII.

    Args:
        x: Anything.
    """
    return {"city": "Tōkyō", "local": "東京"}
'''


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_env.py").write_text(textwrap.dedent(ENV_FILE))
    (tmp_path / "my_tools.py").write_text(textwrap.dedent(TOOLS_FILE))
    return tmp_path


def test_sync_and_async_environments_run_through_the_contract(files):
    env = contract.make(f"{files}/my_env.py:Counter", {"id": "r1", "n": 3})
    assert contract.reset(env, seed=5, row={"n": 3}) == ("count to 3", {"seed": 5})
    more = contract.step(env, "2")
    assert (more.observation, more.reward, more.terminated) == ([{"role": "user", "content": "more"}], None, False)
    assert contract.step(env, " 3 ", role="system").reward == 1.0
    contract.close(env)
    assert env.closed
    a = contract.make(f"{files}/my_env.py:make_async", {})
    assert contract.reset(a, seed=0, row={}) == ([{"role": "user", "content": "hi"}], {})
    step = contract.step(a, "go")
    assert (step.observation, step.reward, step.truncated, step.info) == ([{"role": "tool", "content": "GO"}], 0.5,
                                                                         True, {"n": 1})
    contract.close(a)  # no close(): nothing to do


@pytest.mark.parametrize("bad, match", [
    ("short", r"step returned a tuple of 3 .*gymnasium's step returns \(observation, reward, terminated"),
    ("reward", "step returned reward 'high'; expected a finite number or None"),
    ("inf", "step returned reward inf"),
    ("obs", "step returned observation int 42; expected a string, None or a list of chat messages"),
    ("flag", "step returned terminated='yes'; expected a bool"),
    ("info", r"step returned info list \[1\]; expected a dict"),
])
def test_garbage_is_named(files, bad, match):
    env = contract.make(f"{files}/my_env.py:Garbage", {"bad": bad})
    with pytest.raises(contract.BadReturn, match=match):
        contract.step(env, "x")


def test_a_reset_of_trls_shape_in_a_class_of_ours_says_how_trls_are_told_apart(files):
    """A TRL environment whose class takes the row is made as ours, and its reset's string was refused naming
    gymnasium's shape alone."""
    env = contract.make(f"{files}/my_env.py:Garbage", {"bad": "trl"})
    with pytest.raises(contract.BadReturn, match=r"reset returned str 'Add 3.'; gymnasium's reset returns "
                                                 r"\(observation, info\) \(a TRL environment's reset returns a string "
                                                 r"or None: its class takes no argument\)"):
        contract.reset(env, seed=0, row={})
    assert contract.reset(contract.make(f"{files}/my_env.py:Garbage", {"bad": "pair"}), seed=0, row={})[0] == "Add 3."


def test_a_factory_of_no_environment_or_an_old_gym_reset_is_named_not_retried():
    """A factory returning None, or gym's reset() before 0.26 (no seed, no options): an AttributeError or a TypeError
    naming no fix, retried as a sandbox's outage would be."""
    class OldGym:
        def reset(self):
            return "obs"

        def step(self, action):
            return "obs", 0.0, True, {}

    with pytest.raises(contract.BadReturn, match=r"the factory returned NoneType None, which has no reset and step"):
        contract.reset(None, seed=0, row={})
    with pytest.raises(contract.BadReturn, match=r"its reset takes no seed and options: gymnasium's is reset\(\*, "):
        contract.reset(OldGym(), seed=0, row={})


def test_numpys_bools_are_bools():
    """A reward of np.True_ failed the episode (Python's True was 1.0), a step info of np.bool_ was left out of
    env/info/*, and an info key 0 beside a str key stopped the run sorting the keys for the metrics."""
    import numpy as np

    from rollpacker.env.episode import Episode
    from rollpacker.env.info import info_metrics

    class Env:
        def step(self, action):
            return "obs", np.float32(1.0), np.int64(3) == 3, np.bool_(False), {}

    step = contract.step(Env(), "x")
    assert (step.terminated, step.truncated) == (True, False)
    Env.step = lambda self, action: ("obs", np.True_, False, False, {"solved": np.True_, 0: 1.0, "n": np.int64(2)})
    step = contract.step(Env(), "x")
    assert step.reward == 1.0 and step.info == {"solved": np.True_, "0": 1.0, "n": 2}
    episode = Episode("e", [1], None, seed=0, max_turns=4, max_tokens=8, max_new_tokens=4, max_context=64)
    episode._waiting, episode.messages = "step", []  # an environment's, after a model turn
    episode.on_step(dataclasses.replace(step, terminated=True))
    assert episode.info == {"solved": 1.0, "0": 1.0, "n": 2.0}
    assert info_metrics([episode, episode], "env/")["env/info/solved"] == 1.0


def test_a_factory_that_cannot_be_loaded_is_an_error_naming_the_setting(files):
    with pytest.raises(contract.EnvError, match="env.factory: .*my_env.py has no function 'nope'"):
        contract.make(f"{files}/my_env.py:nope", {})
    with pytest.raises(ValueError, match="env.factory: 'missing.py:make_env': no such file missing.py"):
        EnvConfig(factory="missing.py:make_env")
    with pytest.raises(ValueError, match="env.tools: 'python3' is neither a built-in"):
        EnvConfig(tools=("python3",))
    with pytest.raises(ValueError, match="env.tool_parser must be one of hermes"):
        EnvConfig(tool_parser="xml")


def test_hermes_tool_calls_are_parsed_and_bad_ones_explained():
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "shout", "arguments": "{\\"text\\": \\"hi\\"}"}</tool_call>'
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call><tool_call>{oops</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 6}}')  # cut by a stop string: still a call
    calls = hermes(text)
    assert [(c.name, c.arguments, c.id) for c in calls if not c.error] == [
        ("add", {"a": 1, "b": 2}, "call_0"), ("shout", {"text": "hi"}, "call_1"), ("add", {"a": 5, "b": 6}, "call_4")]
    assert [c.error for c in calls if c.error] == ['a tool call is {"name": str, "arguments": {...}}',
                                                   "the tool call is not JSON (Expecting property name enclosed in "
                                                   "double quotes at 1)"]
    assert hermes("#### 42") == []


def test_tool_schemas_come_from_signatures_and_docstrings(files):
    tools = load_tools(("my_tools.py:add", "my_tools.py:shout"))
    assert schemas(tools)[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer", "description": "The first."},
                                             "b": {"type": "integer", "description": "The second."}},
            "required": ["a", "b"]}, "return": {"type": "integer"}}}
    with pytest.raises(contract.EnvError, match="env.tools: undocumented: no JSON schema .* type hints on every "
                                                "argument and a Google-style docstring"):
        schemas(load_tools(("my_tools.py:undocumented",)))


def test_a_reset_of_no_messages_or_a_schema_without_a_name_is_named_with_or_without_tools_around_it(files):
    """A reset's [] crashed the chat template's render (IndexError, no environment named, not counted); a tool schema
    without a function name was the template's refusal of "the prompt"; under env.tools, a reset's garbage was a
    ValueError of unpacking, retried as if transient. And a tool's result JSON cannot write ended the episode."""
    for bad, match in (("empty", "reset returned no messages; give the episode's prompt"),
                       ("schema", r"reset's info\['tools'\] holds \{'bogus': 1\}, a schema without a function name"),
                       ("trl", r"reset returned str 'Add 3.'; gymnasium's reset returns \(observation, info\)")):
        for wrap in (lambda env: env, lambda env: ToolEnv(load_tools(("my_tools.py:add",)), inner=env)):
            with pytest.raises(contract.BadReturn, match=match):
                contract.reset(wrap(contract.make(f"{files}/my_env.py:Garbage", {"bad": bad})), seed=0, row={})
    env = ToolEnv(load_tools(("my_tools.py:circular", "my_tools.py:add", "my_tools.py:city")))
    contract.reset(env, seed=0, row={})
    step = contract.step(env, '<tool_call>{"name": "circular", "arguments": {"x": 1}}</tool_call>'
                              '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                              '<tool_call>{"name": "city", "arguments": {"x": 1}}</tool_call>')
    assert [m["content"] for m in step.observation] == [  # the letters, not "T\\u014dky\\u014d": 3x the tokens
        "error: circular returned dict that JSON cannot write (Circular reference detected)", "3",
        '{"city": "Tōkyō", "local": "東京"}']
    assert step.info == {"tool_calls": 3, "tool_errors": 1}
    # too deep for JSON's writer (RecursionError), a value whose str() raises: the episode ended
    env = ToolEnv(load_tools(("my_tools.py:deep", "my_tools.py:odd")))
    contract.reset(env, seed=0, row={})
    step = contract.step(env, '<tool_call>{"name": "deep", "arguments": {"x": 1}}</tool_call>'
                              '<tool_call>{"name": "odd", "arguments": {"x": 1}}</tool_call>')
    deep, odd = [m["content"] for m in step.observation]
    assert deep.startswith("error: deep returned list that JSON cannot write (maximum recursion depth exceeded")
    assert odd == "error: odd returned dict that JSON cannot write (no text)"
    assert step.info == {"tool_calls": 2, "tool_errors": 2}


def test_tools_alone_run_calls_until_the_model_answers(files):
    env = ToolEnv(load_tools(("my_tools.py:add", "my_tools.py:shout", "my_tools.py:echo", "my_tools.py:broken")))
    prompt, info = contract.reset(env, seed=0, row={"prompt": "p"})
    assert prompt is None and [t["function"]["name"] for t in info["tools"]] == ["add", "shout", "echo", "broken"]
    step = contract.step(env, '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
                              '<tool_call>{"name": "shout", "arguments": {"text": "hey"}}</tool_call>'
                              '<tool_call>{"name": "echo", "arguments": {"text": "error: a result"}}</tool_call>'
                              '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>'
                              '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                              '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert [m["content"] for m in step.observation] == [
        "42", "HEY!", "error: a result", "error: ValueError: no",
        "error: no tool named 'nope' (tools: add, shout, echo, broken)",
        "error: TypeError: add() missing 1 required positional argument: 'b'"]
    # the echo succeeded, whatever its text: 3 of 6 calls failed
    assert all(m["role"] == "tool" for m in step.observation) and step.info == {"tool_calls": 6, "tool_errors": 3}
    assert not step.terminated
    answer = contract.step(env, "It is 42.")
    assert (answer.observation, answer.reward, answer.terminated) == ([], None, True)


def test_the_calls_of_the_last_turn_allowed_do_not_run(files):
    """As verl's and TRL's loops: the episode ends after its max_turns-th turn, so that turn's calls (a sandbox's
    seconds each, with their side effects) once ran for results nobody read."""
    (files / "counted.py").write_text(textwrap.dedent('''
        calls = []


        def tick(n: int) -> int:
            """Count a call.

            Args:
                n: Anything.
            """
            calls.append(n)
            return len(calls)
    '''))
    tools = load_tools(("counted.py:tick",))
    calls, env = tools["tick"].__globals__["calls"], ToolEnv(tools)
    call = '<tool_call>{"name": "tick", "arguments": {"n": 1}}</tool_call>'
    for max_turns, ran in ((2, [1]), (1, []), (None, [1, 1, 1])):  # None: no limit (a direct reset)
        calls.clear()
        env.reset(seed=0, options={"row": {}, "max_turns": max_turns})
        steps = [contract.step(env, call) for _ in range(max_turns or 3)]
        assert calls == ran, max_turns
        assert [m["content"] for m in steps[-1].observation] == ([] if max_turns else ["3"])
        assert not steps[-1].terminated  # the episode ends at max_turns, not as an answer


def test_a_long_tool_result_keeps_its_start_and_end_and_says_what_was_cut(files):
    """verl's max_tool_response_length: a result over env.max_tool_result_chars keeps its start and end (a
    traceback's last line, a program's last output) and tells the model how much is gone; before, it was cut
    at 4000 characters without a word."""
    call = '<tool_call>{"name": "echo", "arguments": {"text": "%s"}}</tool_call>'
    text = "a" * 30 + "b" * 40 + "c" * 30
    for limit, expected in ((10, "aaaaa\n[... 90 characters cut ...]\nccccc"), (100, text), (0, text)):
        env = ToolEnv(load_tools(("my_tools.py:echo",)), max_result_chars=limit)
        env.reset(seed=0, options={"row": {}})
        assert contract.step(env, call % text).observation[0]["content"] == expected, limit
    assert EnvSpec.from_config(EnvConfig(tools=("python",), max_tool_result_chars=7)).max_tool_result_chars == 7
    with pytest.raises(ValueError, match="env.max_tool_result_chars must be >= 0"):
        EnvConfig(max_tool_result_chars=-1)


def test_tools_around_an_environment_step_it_when_the_model_answers(files):
    inner = contract.make(f"{files}/my_env.py:Counter", {"n": 3})
    env = ToolEnv(load_tools(("my_tools.py:add",)), inner=inner)
    assert contract.reset(env, seed=1, row={"n": 3})[0] == "count to 3"
    assert contract.step(env, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>').observation[0][
        "content"] == "3"
    assert inner.steps == 0
    assert contract.step(env, "3").reward == 1.0 and inner.steps == 1
    env.close()
    assert inner.closed


def test_calls_of_the_environments_own_tools_go_to_its_step(files):
    inner = contract.make(f"{files}/my_env.py:Librarian", {"n": 1})
    env = ToolEnv(load_tools(("my_tools.py:add",)), inner=inner)
    _, info = contract.reset(env, seed=0, row={"n": 1})
    assert [t["function"]["name"] for t in info["tools"]] == ["lookup", "add"]
    step = contract.step(env, '<tool_call>{"name": "lookup", "arguments": {"word": "cat"}}</tool_call>')
    assert step.observation[0]["content"] == "a small feline" and inner.steps == 1
    step = contract.step(env, '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert step.observation[0]["content"] == "3" and inner.steps == 1


def test_the_toy_environment_gives_another_try_after_a_wrong_answer():
    from rollpacker.toy.env import LATER, make_env
    from rollpacker.toy.task import make_dataset, solution

    row = make_dataset(1, seed=3)[0]
    right, wrong = solution(row), solution(row).rsplit("####", 1)[0] + "#### 1000"
    env = make_env(row)
    assert contract.reset(env, seed=0, row=row) == (None, {})
    retry = contract.step(env, wrong)
    expr = row["prompt"].removeprefix("Q: ").removesuffix("\nA:")
    assert (retry.observation, retry.reward, retry.terminated) == ([{"role": "user", "content": expr}], None, False)
    assert (contract.step(env, right).reward, env.answers) == (LATER, 2)
    env = make_env(row)
    contract.reset(env, seed=0, row=row)
    assert contract.step(env, right).reward == 1.0
    contract.reset(env, seed=0, row=row)
    contract.step(env, wrong)
    last = contract.step(env, wrong)
    assert (last.reward, last.terminated, last.info) == (0.0, True, {"correct": 0.0})


def test_a_reward_function_scores_an_episode_as_its_messages(files):
    """TRL's convention with an environment: ``completions`` are the episode's turns as messages."""
    from rollpacker.reward.functions import call, resolve

    (files / "episode_reward.py").write_text(textwrap.dedent('''
        def last_answer(completions, **kwargs):
            return [float(c[-1]["role"] == "assistant" and c[-1]["content"].endswith("#### 8")) for c in completions]
    '''))
    turns = [{"role": "assistant", "content": "#### 7"}, {"role": "user", "content": "3+5"},
             {"role": "assistant", "content": "#### 8"}]
    sample = {"prompt": "Q: 3+5\nA:", "completion": "#### 7\nQ: 3+5\nA:#### 8", "completion_ids": [1, 2],
              "columns": {}, "messages": turns}
    assert call(resolve("episode_reward.py:last_answer", "last_answer"), sample)[0] == 1.0
