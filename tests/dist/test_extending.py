"""The example policy of docs/extending.md trains in real jobs, built from Python on one rank and
named out of tree by the page's own command on two: the controller, the engines and the trainer
run it as they run the shipped policies, and its ledger is in the checkpoint."""

from __future__ import annotations

import pytest
from support.docs import example_code, example_command
from support.jobs import QUIET, launch_job, ledger, records, torchrun


def test_the_example_policy_trains_in_a_real_job(tmp_path):
    assert "OK" in torchrun("example_policy.py", 1, str(tmp_path), timeout=300)
    steps = [r for r in records(tmp_path) if "time/step" in r]
    assert [r["step"] for r in steps] == [0, 1]
    for r in steps:  # keep_share 0.5 of 4 prompts: 2 groups of 2 responses trained, 2 prompts deferred
        assert r["sched/round_kind"] == "fifo" and r["sched/deferred"] == 2
        assert len(r["rollout/response_lengths"]) == 4
        assert "train/loss" in r
    saved = ledger(tmp_path)
    assert len(saved["trained"]) == 4 and len(saved["queue"]) == 2


@pytest.mark.slow  # the page's command as written; the example policy trains in a real job above
def test_the_pages_command_trains_the_example_out_of_tree(tmp_path):
    (tmp_path / "fifo.py").write_text(example_code())
    run = tmp_path / "run"
    proc = launch_job(*example_command(), "--data.num-toy-prompts", "32", "--rollout.num-prompts", "4",
                      "--rollout.group-size", "2", "--rollout.max-new-tokens", "96", "--num-steps", "2",
                      "--eval-every", "0", "--checkpoint.no-export-hf", "--run-dir", str(run), *QUIET, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [r for r in records(run) if "time/step" in r]
    assert [(r["step"], r["sched/round_kind"], r["sched/deferred"]) for r in steps] == [(0, "fifo", 2), (1, "fifo", 2)]
    assert len(ledger(run)["trained"]) == 4
