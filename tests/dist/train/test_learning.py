"""The default toy job learns: held-out greedy accuracy and the training reward rise through the run (slow tier:
run by .ci/run if time allows)."""

from __future__ import annotations

import json

import pytest
from support.jobs import QUIET, launch_job


@pytest.mark.slow
def test_default_toy_job_raises_heldout_accuracy(tmp_path):
    proc = launch_job("--run-dir", str(tmp_path), *QUIET, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    accuracy = [a for _, a in evals]
    # The toy-model issue's targets; seed 0 measured +0.195 and +0.152 (docs/results.md); runs are deterministic.
    assert accuracy[-1] >= accuracy[0] + 0.15, f"held-out accuracy went {accuracy[0]:.3f} -> {accuracy[-1]:.3f}"
    rewards = [r["reward/accuracy"] for r in rows if "reward/accuracy" in r]
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last >= first + 0.10, f"training reward went {first:.3f} -> {last:.3f} (first -> last quarter)"
    # still rising after the first quarter: the last two evaluations beat every one of the first quarter
    early = max(a for step, a in evals if step <= rows[-1]["step"] // 4)
    assert (accuracy[-1] + accuracy[-2]) / 2 >= early + 0.05, f"flat after the first quarter: {evals}"


@pytest.mark.slow
def test_toy_env_preset_raises_heldout_first_try_success(tmp_path):
    """``--preset toy-env`` (episodes: a wrong answer gets another try): held-out greedy first-try
    success, over its last three evaluations, rises by at least 0.06 over its first. On the held-out
    problems of 80780d4 (a part of the problem space training never draws) seed 0 measured 0.297 ->
    0.387, 0.391, 0.395 (docs/results.md); one run's last point alone moves by a problem or two with
    the ranks' float reduction order, so a single point against a bar near the gain was a coin toss."""
    proc = launch_job("--preset", "toy-env", "--seed", "0", "--data.shuffle-seed", "0", "--run-dir", str(tmp_path),
                      *QUIET, timeout=2400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    last = sum(accuracy[-3:]) / 3
    assert last >= accuracy[0] + 0.06, f"held-out success went {accuracy[0]:.3f} -> {accuracy[-3:]}"
    assert all(r["env/errors"] == 0 for r in rows if "env/errors" in r)
    assert sum(r["env/turns_mean"] > 1 for r in rows if "env/turns_mean" in r) > 0  # second tries happened


@pytest.mark.slow
def test_toy_tools_preset_learns_to_call_the_tool_where_it_helps(tmp_path):
    """``--preset toy-tools``: held-out greedy success rises by at least 0.15 (seed 0 measured 0.492 -> 0.969:
    docs/results.md), the episodes call the calculator through the last quarter of the steps, and at the end the
    greedy policy calls it on hard problems and not on easy ones."""
    proc = launch_job("--preset", "toy-tools", "--seed", "0", "--data.shuffle-seed", "0", "--run-dir", str(tmp_path),
                      *QUIET, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    assert last["eval/accuracy"] >= first["eval/accuracy"] + 0.15, [r["eval/accuracy"] for r in evals]
    calls = [r["env/info/tool_calls_frac"] for r in rows if "env/info/tool_calls_frac" in r]
    assert len(calls) == 100 and all(c > 0 for c in calls[-len(calls) // 4:]), calls
    assert last["eval/hard/info/tool_calls_frac"] >= last["eval/easy/info/tool_calls_frac"] + 0.5, last
    assert all(r["env/errors"] == 0 for r in rows if "env/errors" in r)


@pytest.mark.slow
def test_ppo_with_a_critic_raises_heldout_accuracy_and_its_critic_learns(tmp_path):
    """``--train.advantage gae`` on the default job's short setting (50 steps, the bench's): held-out greedy
    accuracy rises by at least 0.06 (seeds 0-2 measured +0.109, +0.129, +0.133: docs/algorithms.md). The critic
    learns: its explained variance rises from the first quarter of the steps to the last (seed 0 measured 0.008 ->
    0.167), and its mean value there meets the mean target (0.229 and 0.228)."""
    proc = launch_job("--train.advantage", "gae", "--num-steps", "50", "--eval-every", "50", "--run-dir",
                      str(tmp_path), *QUIET, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    accuracy = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    assert accuracy[-1] >= accuracy[0] + 0.06, f"held-out accuracy went {accuracy[0]:.3f} -> {accuracy[-1]:.3f}"
    steps = [r for r in rows if "critic/vf_loss" in r]
    first, last = steps[:len(steps) // 4], steps[-len(steps) // 4:]

    def mean(rows: list[dict], key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    assert len(steps) == 50 and steps[0]["critic/vpred_mean"] == 0.0  # the zero head
    assert mean(last, "critic/vf_explained_var") >= mean(first, "critic/vf_explained_var") + 0.05
    assert abs(mean(last, "critic/vpred_mean") - mean(last, "critic/returns_mean")) < 0.05
