"""docs/environments.md's environment and tools files, taken from the page as written, through the contract."""

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
