"""The verifiers adapter in this process: a verifiers ToolEnv built as a worker builds it (``EnvSpec.build``), stepped
with scripted model turns through the contract."""

from __future__ import annotations

import re
import textwrap

import pytest

pytest.importorskip("verifiers")

from support.chat import ADD_TOOL  # noqa: E402

from rollpacker.env import contract  # noqa: E402
from rollpacker.env.contract import EnvError  # noqa: E402
from rollpacker.env.parsers import PARSERS  # noqa: E402
from rollpacker.env.workers import EnvSpec  # noqa: E402

VF_ENV = '''
import verifiers as vf
from datasets import Dataset

from rollpacker.env.verifiers import factory
''' + ADD_TOOL + '''

def correct(completion, answer, **kwargs) -> float:
    return float(answer in (completion[-1].content or ""))


def load():
    return vf.ToolEnv(tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]),
                      dataset=Dataset.from_list([{"question": "2+3", "answer": "5"}]))


class Again(vf.MultiTurnEnv):
    """Asks again after every answer, with no turn limit of its own (MultiTurnEnv's max_turns=-1)."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Sure?")]


def blank(answer, example_id, src_id, **kwargs) -> float:
    return float(answer == "" and example_id == 0 and src_id == "p-7")


make_env = factory(load)
make_again_env = factory(lambda: Again(rubric=vf.Rubric(funcs=[correct]), dataset=Dataset.from_list([
    {"question": "2+3", "answer": "5"}])))
make_blank_env = factory(lambda: vf.SingleTurnEnv(rubric=vf.Rubric(funcs=[blank]), dataset=Dataset.from_list([
    {"question": "hi", "answer": ""}])))
make_llama3_env = factory(load, parser="llama3_json")  # before env.tool_parser reached it: still read
make_typo_env = factory(load, parser="llama3")
'''
ROW = {"id": "r0", "prompt": "What is 2+3? Use add.", "answer": "5"}
GOOD = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


@pytest.fixture
def vf_file(tmp_path) -> str:
    (tmp_path / "vf_env.py").write_text(textwrap.dedent(VF_ENV))
    return str(tmp_path / "vf_env.py")


def opened(spec: EnvSpec):
    env = spec.build(ROW)
    contract.reset(env, seed=0, row=ROW, max_turns=3)
    return env


def test_env_tool_parser_reads_the_calls_a_verifiers_tool_env_runs(vf_file):
    """A Llama 3.1 call under --env.tool-parser llama3_json is a call (it was the final answer, read as Hermes)."""
    env = opened(EnvSpec(factory=f"{vf_file}:make_env", tool_parser="llama3_json"))
    called = contract.step(env, '{"name": "add", "parameters": {"a": 2, "b": 3}}')
    assert [(m["role"], m["content"]) for m in called.observation] == [("tool", "5")] and not called.terminated
    answered = contract.step(env, "It is 5.")
    assert (answered.reward, answered.terminated) == (1.0, True)
    contract.close(env)


def test_a_verifiers_factorys_own_parser_is_read_unless_env_tool_parser_says_otherwise(vf_file):
    env = opened(EnvSpec(factory=f"{vf_file}:make_llama3_env"))  # env.tool_parser at its default: the factory's
    assert contract.step(env, '{"name": "add", "parameters": {"a": 2, "b": 3}}').observation[0]["content"] == "5"
    contract.close(env)
    with pytest.raises(EnvError, match="env.tool_parser is 'mistral', and the verifiers factory reads tool calls "
                                       "with parser='llama3_json'"):
        EnvSpec(factory=f"{vf_file}:make_llama3_env", tool_parser="mistral").build(ROW)
    with pytest.raises(EnvError, match="the verifiers factory's parser='llama3' is none of hermes, .*: drop it and set "
                                       "env.tool_parser"):
        EnvSpec(factory=f"{vf_file}:make_typo_env").build(ROW)


def test_a_malformed_call_is_answered_with_its_error_and_counted(vf_file):
    """As env.tools' ToolEnv does: the model reads why, the call counts in tool_errors, the good call beside it runs,
    and a turn of malformed calls alone is not the model's final answer."""
    spec, malformed = EnvSpec(factory=f"{vf_file}:make_env"), '<tool_call>{"name": "add"</tool_call>'
    (why,) = [c.error for c in PARSERS["hermes"](malformed)]
    assert why
    env = opened(spec)
    both = contract.step(env, f"{GOOD}\n{malformed}")
    assert [(m["tool_call_id"], m["content"]) for m in both.observation] == [("call_0", "5"),
                                                                             ("call_1", f"error: {why}")]
    assert both.info["tool_errors"] == 1 and not both.terminated
    contract.close(env)

    env = opened(spec)
    bad = contract.step(env, malformed)
    assert [m["content"] for m in bad.observation] == [f"error: {why}"]
    assert bad.info["tool_errors"] == 1 and not bad.terminated and bad.reward is None
    assert contract.step(env, "It is 5.").reward == 1.0
    contract.close(env)


def test_a_verifiers_environment_without_max_turns_ends_and_is_scored_at_env_max_turns(vf_file):
    """As if loaded with max_turns=env.max_turns: verifiers stops the rollout there and its rubric scores it (it was
    cut there unscored, trained as an answer that earned nothing). It ended truncated, as any episode env.max_turns
    ends (train.mask_truncated masks it): it read terminated, as solved."""
    env = opened(EnvSpec(factory=f"{vf_file}:make_again_env"))  # reset with max_turns=3
    assert [contract.step(env, "It is 6.").terminated for _ in range(2)] == [False, False]
    last = contract.step(env, "It is 5.")
    assert (last.reward, last.terminated, last.truncated) == (1.0, False, True)
    assert env.reward_state().restore()["stop_condition"] == "max_turns_reached"
    contract.close(env)


def test_a_verifiers_environments_own_max_turns_ends_its_episode_not_truncated(vf_file):
    """A SingleTurnEnv (max_turns 1) ended its every episode truncated, so --train.mask-truncated trained none:
    verifiers' is_truncated says a response was cut short, not that the environment's own max_turns ended it."""
    row = {"id": "r0", "prompt": "Say hi", "answer": None, "example_id": "p-7"}
    env = EnvSpec(factory=f"{vf_file}:make_blank_env").build(row)
    contract.reset(env, seed=0, row=row, max_turns=3)
    last = contract.step(env, "hi")
    assert (last.reward, last.terminated, last.truncated) == (1.0, True, False)
    contract.close(env)
    env = opened(EnvSpec(factory=f"{vf_file}:make_env"))  # its ToolEnv's max_turns=3, run's 3
    assert [contract.step(env, GOOD).terminated for _ in range(2)] == [False, False]
    last = contract.step(env, GOOD)
    assert (last.terminated, last.truncated) == (True, False)
    assert env.reward_state().restore()["stop_condition"] == "max_turns_reached"
    contract.close(env)


def test_a_verifiers_max_turns_above_env_max_turns_is_refused_once_as_its_worker_starts(vf_file):
    """Its worker's warm-up says why (the pool stops the run before a rollout: every episode's reset failed, a
    round of errors); a reset of an environment not warmed up refuses it too."""
    said = r"the verifiers environment ToolEnv has max_turns=3, above env.max_turns=2: .* pass --env.max-turns 3, " \
           r"or load it with max_turns=2"
    assert EnvSpec(factory=f"{vf_file}:make_env", max_turns=3).warm() == ""
    assert re.search(r"env.factory: the warm_up\(\) of make_env .* raised EnvError: " + said,
                     EnvSpec(factory=f"{vf_file}:make_env", max_turns=2).warm())
    env = EnvSpec(factory=f"{vf_file}:make_env").build(ROW)  # its ToolEnv's max_turns=3
    with pytest.raises(EnvError, match=said):
        contract.reset(env, seed=0, row=ROW, max_turns=2)
    contract.close(env)


def test_a_verifiers_episode_a_token_limit_ends_is_scored_as_verifiers_scores_a_prompt_too_long(vf_file):
    """finish: the client raises verifiers' OverlongPromptError, the rollout stops (prompt_too_long, truncated), and
    its rubric scores what it has, as in verifiers' own loop; a rollout cut before any turn scores too."""
    spec = EnvSpec(factory=f"{vf_file}:make_again_env")
    env = opened(spec)
    assert contract.finishes(env) and not contract.step(env, "It is 5.").terminated
    assert contract.finish(env) == 1.0
    state = env.reward_state().restore()
    assert (state["stop_condition"], state["is_truncated"], len(state["trajectory"])) == ("prompt_too_long", True, 1)
    contract.close(env)
    env = opened(spec)
    assert contract.finish(env) == 0.0  # no turn: correct() finds no answer
    contract.close(env)


MUL_TOOL = '''
def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a * b
'''


def test_env_tools_beside_a_verifiers_environment_keep_its_scoring_hooks(vf_file, tmp_path):
    """With --env.tools a verifiers environment runs inside env.tools' ToolEnv, which dropped its hooks: an episode a
    token limit ended went unscored, and reward functions taking ``environments`` got no rollout state."""
    (tmp_path / "more_tools.py").write_text(MUL_TOOL)
    spec = EnvSpec(factory=f"{vf_file}:make_again_env", tools=(f"{tmp_path}/more_tools.py:mul",), states=True)
    env = opened(spec)
    assert contract.finishes(env) and not contract.step(env, "It is 5.").terminated
    assert contract.finish(env) == 1.0
    assert env.reward_state().restore()["stop_condition"] == "prompt_too_long"
    assert env.unscored_alone is None  # its rubric scores each rollout alone
    contract.close(env)


def test_a_verifiers_rollout_gets_a_missing_answer_and_a_string_example_id_as_verifiers_formats_them(vf_file):
    """A row without an answer (None) gives "" (not "None"); a non-integer example_id is src_id, as verifiers
    formats a dataset's (int() of it raised)."""
    row = {"id": "r0", "prompt": "Say hi", "answer": None, "example_id": "p-7"}
    env = EnvSpec(factory=f"{vf_file}:make_blank_env").build(row)
    contract.reset(env, seed=0, row=row, max_turns=3)
    assert contract.step(env, "hi").reward == 1.0
    contract.close(env)
