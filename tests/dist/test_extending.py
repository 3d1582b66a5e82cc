"""The example policy of docs/extending.md trains in a real one-rank job: the controller, the engine
and the trainer run it as they run the shipped policies, and its ledger is in the checkpoint."""

from __future__ import annotations

from conftest import ledger, records, torchrun


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
