"""Bring your own task on 2 real ranks: a verl-layout parquet file (chat prompts with a system turn,
data_source, reward_model.ground_truth) scored by a TRL-convention function, a verl-convention one
and one that raises, miscounts and hangs on three rows (reward.on_error skip); then resumed from
a checkpoint; then a failing function with on_error fail, said once."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from conftest import QUIET, launch_job, steps

NUM_ROWS, PROMPTS, GROUP = 16, 4, 2
BAD = {3: "raises", 5: "miscounts", 7: "hangs"}  # extra_info.index -> what the flaky function does there

REWARDS = '''
import json, time

LOG = {log!r}

def _log(fn, row, value, completion):
    with open(LOG, "a") as f:
        f.write(json.dumps({{"fn": fn, "row": row, "value": value, "completion": completion}}) + "\\n")

def length(prompts, completions, completion_ids, id, **kwargs):  # TRL's convention
    value = len(completion_ids[0]) / 100
    _log("length", id[0], value, completions[0][0]["content"])
    return [value]

def compute_score(data_source, solution_str, ground_truth, extra_info):  # verl's
    value = 0.5 * (ground_truth in solution_str) + 0.01 * extra_info["index"]
    _log("compute_score", extra_info["index"], value, solution_str)
    return value

def flaky(completions, extra_info, **kwargs):
    index = extra_info[0]["index"]
    if index == 3:
        raise ValueError("row three")
    if index == 5:
        return [1.0, 2.0]
    if index == 7:
        time.sleep(60)
    return [None]
'''


def make_task(tmp_path: Path) -> tuple[Path, Path, Path]:
    import pandas as pd

    from rollpacker.data import toy

    rows = toy.make_dataset(NUM_ROWS, seed=5)
    data = tmp_path / "rl.parquet"
    pd.DataFrame({
        "prompt": [[{"role": "system", "content": "Add."}, {"role": "user", "content": r["prompt"][3:-3]}]
                   for r in rows],
        "data_source": ["toy"] * NUM_ROWS,
        "reward_model": [{"style": "rule", "ground_truth": r["answer"]} for r in rows],
        "extra_info": [{"index": i} for i in range(NUM_ROWS)]}).to_parquet(data)
    log = tmp_path / "calls.jsonl"
    funcs = tmp_path / "my_rewards.py"
    funcs.write_text(textwrap.dedent(REWARDS.format(log=str(log))))
    return data, funcs, log


def run(data: Path, funcs: Path, run_dir: Path, *args: str):
    return launch_job("--data.path", str(data), "--reward.funcs", f"{funcs}:length", f"{funcs}:compute_score",
                      f"{funcs}:flaky", "--reward.weights", "1", "2", "1", "--reward.timeout", "3",
                      "--rollout.num-prompts", str(PROMPTS), "--rollout.group-size", str(GROUP),
                      "--rollout.max-new-tokens", "24", "--num-steps", "4", "--eval-every", "0",
                      "--run-dir", str(run_dir), *QUIET, *args)


def blocks(log: Path, fn: str) -> list[list[dict]]:
    """``fn``'s calls step by step: a sync round waits for every reward before the next starts."""
    calls = [c for c in map(json.loads, log.read_text().splitlines()) if c["fn"] == fn]
    assert len(calls) % (PROMPTS * GROUP) == 0, len(calls)
    return [calls[i:i + PROMPTS * GROUP] for i in range(0, len(calls), PROMPTS * GROUP)]


@pytest.mark.timeout(900)
def test_user_reward_functions_on_verl_parquet_logged_exactly_and_resumed(tmp_path):
    data, funcs, log = make_task(tmp_path)
    proc = run(data, funcs, tmp_path / "a", "--checkpoint-every", "2")
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = steps(tmp_path / "a")
    lengths, scores = blocks(log, "length"), blocks(log, "compute_score")
    assert len(lengths) == len(scores) == 4
    for step, (length, score) in enumerate(zip(lengths, scores)):
        m = metrics[step]
        by_row = Counter(c["row"] for c in score)
        assert sorted(int(c["row"].split(":")[1]) - 1 for c in length) == sorted(by_row.elements())  # same responses
        # the functions' own values are what is logged, per function and in the weighted total
        assert m["reward/length"] == pytest.approx(sum(c["value"] for c in length) / len(length))
        assert m["reward/compute_score"] == pytest.approx(sum(c["value"] for c in score) / len(score))
        errors = sum(n for row, n in by_row.items() if row in BAD)
        assert m["reward/errors"] == errors
        by_completion = Counter()  # a response's weighted reward: length + 2 x compute_score, 0 where flaky failed
        for c in length:
            by_completion[(c["row"], c["completion"])] += c["value"]
        for c in score:
            by_completion[(f"rl:{c['row'] + 1}", c["completion"])] += 2 * c["value"]
        total = sum(v for (row, _), v in by_completion.items() if int(row.split(":")[1]) - 1 not in BAD)
        assert m["reward/mean"] == pytest.approx(total / (PROMPTS * GROUP), abs=1e-6)
        assert m["sched/trained_prompts"] == PROMPTS  # nothing lost: the failed responses trained with 0
    assert sum(metrics[s]["reward/errors"] for s in range(4)) == len(BAD) * GROUP  # one epoch: each row once
    assert "reward function 'flaky' failed on row 'rl:4': raised ValueError: row three" in proc.stderr
    assert "reward function 'flaky' failed on row 'rl:8': timed out after 3 s" in proc.stderr
    # resumed from step 2's checkpoint: the same prompts as the uninterrupted run's steps 2 and 3
    resumed_log = log.with_name("first.jsonl")
    log.rename(resumed_log)
    proc = run(data, funcs, tmp_path / "b", "--resume", str(tmp_path / "a" / "checkpoints" / "step_2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    again = blocks(log, "length")
    assert [sorted(c["row"] for c in b) for b in again] == [sorted(c["row"] for c in b) for b in lengths[2:]]
    assert sorted(steps(tmp_path / "b")) == [2, 3]


@pytest.mark.timeout(600)
def test_a_failing_function_with_on_error_fail_stops_the_run_with_one_message(tmp_path):
    data, funcs, _ = make_task(tmp_path)
    proc = launch_job("--data.path", str(data), "--reward.funcs", f"{funcs}:flaky", "--reward.on-error", "fail",
                      "--rollout.num-prompts", str(NUM_ROWS), "--rollout.group-size", "1", "--rollout.max-new-tokens",
                      "8", "--num-steps", "1", "--eval-every", "0", "--run-dir", str(tmp_path / "r"), *QUIET)
    assert proc.returncode != 0
    said = [line for line in proc.stderr.splitlines() if "reward.on_error=fail stops the run" in line]
    assert len(said) == 1, proc.stderr[-4000:]  # the first response settled: a None row or one of BAD's
    assert said[0].startswith(("rollpacker: reward function 'flaky' failed on row 'rl:",
                               "rollpacker: no reward function scores row 'rl:")), said
    assert "rollpacker/" not in "".join(line for line in proc.stderr.splitlines() if line.strip().startswith("File"))
    missing = launch_job("--data.path", str(tmp_path / "nope.parquet"), "--run-dir", str(tmp_path / "m"), *QUIET)
    assert missing.returncode != 0
    said = [line for line in missing.stderr.splitlines() if "no such file" in line]
    assert "rollpacker/" not in "".join(line for line in missing.stderr.splitlines() if line.strip().startswith("File"))
    assert said == [f"rollpacker: data.path: no such file: {tmp_path / 'nope.parquet'} (give a dataset file, or "
                    "leave data.path empty for the toy task)"], missing.stderr[-4000:]
