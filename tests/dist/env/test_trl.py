"""A TRL environment class in a whole job: 2 gloo ranks, the toy-tools model calling the class's
calculator method, its get_reward as the episode's environment reward (after the answer, or after the
token limit cut the answer's turn), and a reward function taking ``environments`` scored in the
reward workers from a copy of each episode's environment."""

from __future__ import annotations

import json

from support.jobs import QUIET, cause, launch_job, records

TRL_ENV = '''
from rollpacker.toy import tools


class Calculator:
    """The toy tools task's calculator as a TRL environment: one tool, a reward from its own state."""

    def reset(self, answer, **kwargs):
        self.answer, self.results = answer, []

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Integers with + - * / and parentheses, e.g. "47*86".
        """
        result = tools.calculator(expression)
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        return float(self.answer in self.results)


def used_tool(environments, **kwargs):
    return [float(bool(env.results)) for env in environments]
'''


def test_a_trl_environment_trains_on_two_ranks(tmp_path):
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    run = tmp_path / "run"
    proc = launch_job("--model.path", "toy-tools", "--data.toy-task", "tools", "--env.factory", "trl_env.py:Calculator",
                      "--reward.funcs", "trl_env.py:used_tool", "rollpacker.toy.tools:correct", "--env.max-turns", "3",
                      "--env.max-tokens", "92", "--rollout.max-new-tokens", "96", "--num-steps", "2",
                      "--eval-every", "0", "--metrics.samples-every", "1", "--run-dir", str(run), *QUIET,
                      cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, cause(proc.stderr)
    steps = records(run)
    assert len(steps) == 2 and all(r["env/errors"] == 0 and r["reward/errors"] == 0 for r in steps), steps
    episodes = [json.loads(line) for path in (run / "samples").glob("step_*.jsonl") for line in path.open()]
    results = [[t["text"] for t in e["turns"] if t["role"] == "tool" and "error: " not in t["text"]]
               for e in episodes]  # the calculator's results the model saw (the toy template: "\nR: 728\nA:")
    # the reward function read each episode's copy: the results its environment kept
    assert [e["rewards"]["used_tool"] for e in episodes] == [float(bool(r)) for r in results]
    # get_reward scored the episode's own state: did the calculator produce the answer
    assert [e["env_reward"] for e in episodes] == [float(any(f"R: {e['answer']}\n" in t for t in r))
                                                   for e, r in zip(episodes, results)]
    assert any(results) and any(e["env_reward"] for e in episodes if e["end"] == "terminated")
    # 92 model tokens: a calculator call (about 90) leaves a few for the answer; a cut one is scored all the same
    assert any(e["env_reward"] for e in episodes if e["end"] == "max_tokens")


def test_a_tool_parser_that_cannot_read_the_models_calls_stops_at_the_first_reset_that_gives_tools(tmp_path):
    """A TRL environment's tools are its methods, known once a reset gives their schemas: the run stops then,
    before any turn, as with env.tools (every call would have been read as the answer)."""
    (tmp_path / "trl_env.py").write_text(TRL_ENV)
    proc = launch_job("--model.path", "toy-tools", "--data.toy-task", "tools", "--env.factory", "trl_env.py:Calculator",
                      "--reward.funcs", "rollpacker.toy.tools:correct", "--env.tool-parser", "llama3_json",
                      "--num-steps", "1", "--eval-every", "0", "--run-dir", str(tmp_path / "run"), *QUIET,
                      cwd=tmp_path, nproc=1, timeout=300)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "reads no tool call in the layout" in line]
    assert len(said) == 1 and said[0].endswith("set --env.tool-parser to hermes"), proc.stderr[-3000:]
