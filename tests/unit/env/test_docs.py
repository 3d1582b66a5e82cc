"""docs/environments.md's environment, tools and TRL environment files, taken from the page as written, through the
contract (the TRL one in the environment workers, as a run has it)."""

from __future__ import annotations

import textwrap
from pathlib import Path

from rollpacker.env import contract
from rollpacker.env.tools import ToolEnv, load_tools

PAGE = Path(__file__).resolve().parents[3] / "docs" / "environments.md"


def page_file(name: str) -> str:
    """The indented block of the page that starts with ``# NAME``."""
    lines = PAGE.read_text().splitlines()
    start = lines.index(f"    # {name}")
    block = []
    for line in lines[start:]:
        if line and not line.startswith("    "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def test_the_pages_environment_plays_a_game(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "guess_env.py").write_text(page_file("guess_env.py"))
    env = contract.make(f"{tmp_path}/guess_env.py:make_env", {"id": "r0", "prompt": "unused"})
    prompt, info = contract.reset(env, seed=7, row={})
    assert prompt.startswith("I am thinking of a number") and info == {}
    low, high, rewards = 1, 20, []
    for _ in range(6):  # bisection finds it in at most 5 guesses
        guess = (low + high) // 2
        step = contract.step(env, f"My guess: {guess}")
        rewards.append(step.reward)
        if step.terminated:
            break
        hint = step.observation[0]["content"]
        low, high = (guess + 1, high) if hint == "Higher." else (low, guess - 1)
    assert step.terminated and rewards[-1] == 1.0 and rewards[:-1] == [None] * (len(rewards) - 1)
    assert contract.step(env, "no number").observation == [{"role": "user", "content": "Answer with a number."}]


def test_the_pages_tools_are_called(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calc_tools.py").write_text(page_file("calc_tools.py"))
    env = ToolEnv(load_tools(("calc_tools.py:multiply",)))
    _, info = contract.reset(env, seed=0, row={})
    assert info["tools"][0]["function"]["parameters"]["properties"]["a"] == {"type": "number",
                                                                             "description": "The first number."}
    step = contract.step(env, '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>')
    assert step.observation == [{"role": "tool", "name": "multiply", "tool_call_id": "call_0", "content": "42"}]


def test_the_pages_trl_environment_and_its_reward_function_run_as_written(tmp_path, monkeypatch):
    """A group's episodes (one reset seed) draw the same target; the tool counts; get_reward scores the
    answer; the reward function reads the copy of the environment."""
    import json
    import re

    from rollpacker.env.config import EnvConfig
    from rollpacker.env.workers import EnvPool, EnvSpec
    from rollpacker.reward.functions import call, resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "increment_env.py").write_text(page_file("increment_env.py"))
    cfg = EnvConfig(factory="increment_env.py:IncrementEnv", num_workers=1, timeout=60)
    row = {"id": "r0", "prompt": [{"role": "user", "content": "Use the increment tool. "}]}
    with EnvPool(cfg, EnvSpec.from_config(cfg, states=True)) as pool:
        for key in ("hit", "over"):
            pool.open_episode(key, row, 17)
        opened = {r.key: r for r in pool.drain(60)}
        (hit_prompt, info), (over_prompt, _) = opened["hit"].value, opened["over"].value
        assert hit_prompt == over_prompt and [t["function"]["name"] for t in info["tools"]] == ["increment"]
        text = hit_prompt[0]["content"]
        assert re.fullmatch(r"Use the increment tool\. Add [1-6] to the counter\.", text), text
        target = int(text.split()[-4])
        for key, step in (("hit", target), ("over", target + 1)):
            pool.step_episode(key, f'<tool_call>{json.dumps({"name": "increment", "arguments": {"step": step}})}'
                                   '</tool_call>')
            pool.step_episode(key, "Done.")
        steps = pool.drain(60)
    called = {r.key: r for r in steps if not r.value.terminated}
    answered = {r.key: r for r in steps if r.value.terminated}
    assert called["hit"].value.observation[0]["content"] == str(target)
    assert (answered["hit"].value.reward, answered["over"].value.reward) == (1.0, 0.0)
    overshoot = resolve("increment_env.py:overshoot", "overshoot")
    sample = {"prompt": row["prompt"], "completion": "Done.", "completion_ids": [], "columns": {}}
    assert [call(overshoot, {**sample, "environment": answered[k].state})[0] for k in ("hit", "over")] == [0.0, -1.0]
