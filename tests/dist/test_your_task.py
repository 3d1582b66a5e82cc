"""Bring your own task on 2 real ranks, as ``docs/your-task.md`` tells a newcomer: its blocks run as
written (a verl-layout parquet file with chat prompts, a system turn, data_source and
reward_model.ground_truth; a reward file with a TRL-convention and a verl-convention function; the
launch, with a stop string, samples every step and eval.n 2). The samples hold what the functions
scored, and the metrics are their means. Then the run is resumed from its step-2 checkpoint with a
third function that raises and miscounts on rows of those steps (reward.on_error skip): the same
prompts, the errors counted and named. Last, a failing function with on_error fail, said once.

The hang of a reward function and a missing data file are unit-tested (tests/unit/reward/test_functions.py,
tests/unit/data/test_data.py): a launch each cost more than what they add here."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
from support.jobs import QUIET, launch_job, steps

DOC = Path(__file__).resolve().parents[2] / "docs" / "your-task.md"
PROMPTS, GROUP, NUM_STEPS, EVAL_ROWS, EVAL_N = 4, 2, 4, 8, 2
WEIGHTS = {"correct": 1.0, "compute_score": 0.1}

FLAKY = '''
BAD = {bad!r}

def flaky(completions, id, **kwargs):
    what = BAD.get(id[0])
    if what == "raises":
        raise ValueError("bad row")
    if what == "miscounts":
        return [1.0, 2.0]
    return [None]
'''


def doc_blocks() -> dict[str, str]:
    """The code blocks of docs/your-task.md marked ``<!-- test: NAME -->``, by name."""
    found = re.findall(r"<!-- test: (\S+) -->\n```\w+\n(.*?)```", DOC.read_text(), re.S)
    return {name: code for name, code in found}


def doc_args(command: str) -> list[str]:
    """The flags of the doc's torchrun command."""
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:4] == ["torchrun", "--nproc_per_node=2", "-m", "rollpacker.run"], words
    return words[4:]


def override(args: list[str], flag: str, *values: str) -> list[str]:
    """``args`` with ``flag``'s values replaced (the flag added when absent)."""
    if flag not in args:
        return [*args, flag, *values]
    i = args.index(flag)
    end = next((j for j in range(i + 1, len(args)) if args[j].startswith("--")), len(args))
    return [*args[:i + 1], *values, *args[end:]]


def samples(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "samples" / f"{name}.jsonl").read_text().splitlines()]


def rescore(funcs, sample: dict) -> dict[str, float]:
    """The doc's functions called again on a saved sample, as rollpacker calls them."""
    completion = [[{"role": "assistant", "content": sample["completion"]}]]
    return {"correct": funcs.correct([sample["prompt"]], completion, [sample["answer"]])[0],
            "compute_score": funcs.compute_score(sample["data_source"], sample["completion"], sample["answer"], {})}


@pytest.mark.slow  # the page's commands as written; a task of your own runs in the default tier's first-run tests
@pytest.mark.timeout(1200)
def test_the_worked_example_runs_as_written_its_samples_hold_what_was_scored_and_it_resumes(tmp_path, monkeypatch):
    blocks = doc_blocks()
    assert sorted(blocks) == ["launch", "make_data.py", "my_rewards.py"]
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks["make_data.py"], "make_data.py", "exec"), {})  # noqa: S102 - the doc's own snippet
    (tmp_path / "my_rewards.py").write_text(blocks["my_rewards.py"])
    spec = importlib.util.spec_from_file_location("my_rewards", tmp_path / "my_rewards.py")
    funcs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(funcs)
    args = doc_args(blocks["launch"])
    proc = launch_job(*args, *QUIET, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "runs" / "my-task"
    metrics = steps(run_dir)
    for step in range(NUM_STEPS):  # every scored response of every step, as the functions scored it
        m, got = metrics[step], samples(run_dir, f"step_{step}")
        assert len(got) == PROMPTS * GROUP and {s["step"] for s in got} == {step}
        for s in got:
            assert s["rewards"] == pytest.approx(rescore(funcs, s)), s
            assert s["extra"] == {"correct/found": s["completion"].rsplit("####", 1)[-1].strip()}
            assert s["reward"] == pytest.approx(sum(WEIGHTS[k] * v for k, v in s["rewards"].items()))
            assert "Q:" not in s["completion"] and s["finish_reason"] in ("stop", "length") and s["length"] > 0
            assert s["prompt"][0] == {"role": "system", "content": "Add."} and s["row"].startswith("train:")
        for name in WEIGHTS:
            assert m[f"reward/{name}"] == pytest.approx(sum(s["rewards"][name] for s in got) / len(got))
        assert m["reward/mean"] == pytest.approx(sum(s["reward"] for s in got) / len(got), abs=1e-6)
    stopped = [s for step in range(NUM_STEPS) for s in samples(run_dir, f"step_{step}") if s["finish_reason"] == "stop"]
    assert stopped, "no response ended by EOS or the stop string"
    from rollpacker.schedule.eval import pass_at_k

    for step in (0, NUM_STEPS):  # before step 0 and at the end: eval.n responses per held-out prompt
        evaluated = samples(run_dir, f"eval_step_{step}")
        assert len(evaluated) == EVAL_ROWS * EVAL_N and {s["kind"] for s in evaluated} == {"eval"}
        by_row = defaultdict(list)
        for s in evaluated:
            by_row[(s["data_source"], s["row"])].append(s["reward"] >= 1.0)
        for source in {"", *(src for src, _ in by_row)}:
            rows = [c for (src, _), c in by_row.items() if source in ("", src)]
            prefix = f"eval/{source}/" if source else "eval/"
            for k in (1, EVAL_N):
                expected = sum(pass_at_k(EVAL_N, sum(c), k) for c in rows) / len(rows)
                assert metrics[step][f"{prefix}pass@{k}"] == pytest.approx(expected), (step, prefix, k)
        assert metrics[step]["eval/mean@2"] == pytest.approx(sum(s["reward"] for s in evaluated) / len(evaluated))
        for name in WEIGHTS:  # each function's held-out mean, as its samples hold it
            assert metrics[step][f"eval/reward/{name}"] == pytest.approx(
                sum(s["rewards"][name] for s in evaluated) / len(evaluated))
        assert metrics[step]["eval/reward/errors"] == 0 and not any(s["trained"] for s in evaluated)
    assert {"eval/toy/short/pass@2", "eval/toy/long/pass@2"} <= set(metrics[0])

    # resumed from step 2's checkpoint with a third function that fails on a row of each resumed step
    first = {step: samples(run_dir, f"step_{step}") for step in (2, 3)}
    bad = {first[2][0]["row"]: "raises", first[3][0]["row"]: "miscounts"}
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY.format(bad=bad)))
    resumed = override(args, "--run-dir", "runs/resumed")
    resumed = override(resumed, "--reward.funcs", *(f"my_rewards.py:{name}" for name in WEIGHTS), "flaky.py:flaky")
    resumed = override(resumed, "--reward.weights", *map(str, WEIGHTS.values()), "1")
    resumed = [*override(resumed, "--eval-every", "0"), "--resume", str(run_dir / "checkpoints" / "step_2")]
    proc = launch_job(*resumed, *QUIET, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stderr.count("--data.eval-path is not read: --eval-every=0 turns evaluation off") == 1, proc.stderr
    again = steps(tmp_path / "runs" / "resumed")
    assert sorted(again) == [2, 3]
    for step in (2, 3):
        got = samples(tmp_path / "runs" / "resumed", f"step_{step}")
        assert sorted(s["row"] for s in got) == sorted(s["row"] for s in first[step])  # the same prompts
        for s in got:
            failed = s["row"] in bad
            assert s["rewards"]["flaky"] is None and s["reward"] == pytest.approx(
                0.0 if failed else sum(WEIGHTS[k] * s["rewards"][k] for k in WEIGHTS))
            assert list(s["reward_error"] or {}) == (["flaky"] if failed else []), s  # which failed, and how
        assert again[step]["reward/errors"] == sum(s["row"] in bad for s in got) == GROUP
        assert again[step]["sched/trained_prompts"] == PROMPTS  # nothing lost: the failed responses trained with 0
    row = first[2][0]["row"]
    assert (f"reward function 'flaky' failed on {GROUP} of {PROMPTS * GROUP} responses at step 2, scored 0 "
            f"(--reward.on-error skip); first on row '{row}': raised ValueError: bad row") in proc.stderr
    assert (f"reward function 'flaky' failed on {GROUP} of {PROMPTS * GROUP} responses at step 3, scored 0 "
            f"(--reward.on-error skip); first on row '{first[3][0]['row']}': returned 2 values") in proc.stderr


@pytest.mark.timeout(600)
def test_a_failing_function_with_on_error_fail_stops_the_run_with_one_message(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(doc_blocks()["make_data.py"], "make_data.py", "exec"), {})  # noqa: S102
    (tmp_path / "flaky.py").write_text(textwrap.dedent(FLAKY.format(bad={f"train:{i}": "raises" for i in (4, 6)})))
    proc = launch_job("--data.path", "train.parquet", "--reward.funcs", "flaky.py:flaky", "--reward.on-error",
                      "fail", "--rollout.num-prompts", "16", "--rollout.group-size", "1", "--rollout.max-new-tokens",
                      "8", "--train.advantage", "reinforce_pp", "--num-steps", "1", "--eval-every", "0", "--run-dir",
                      "r", *QUIET, cwd=tmp_path)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if "--reward.on-error fail stops the run" in line]
    assert len(said) == 1, proc.stderr[-4000:]  # the first response settled: a None row or a failing one
    assert said[0].startswith(("rollpacker: reward function 'flaky' failed on row 'train:",
                               "rollpacker: no reward function scores row 'train:")), said
    assert "rollpacker/" not in "".join(line for line in proc.stderr.splitlines() if line.strip().startswith("File"))
