"""Stream training: the trigger and KV projection (pure logic), and real gloo ranks for the
equivalence with synchronous steps and for whole runs with scale-downs."""

from __future__ import annotations

import pytest
from support.jobs import launch_job, per_group, torchrun
from support.jobs import run_four_steps as run


@pytest.mark.parametrize("nproc,shard,aggregations", [
    (2, 1, "token-mean,seq-mean-token-mean,seq-mean-token-sum,seq-mean-token-sum-norm"), (4, 2, "token-mean")])
def test_stream_step_equals_sync_step(toy_random_dir, nproc, shard, aggregations):
    out = torchrun("stream_step.py", nproc, str(toy_random_dir), str(shard), aggregations, timeout=600)
    assert out.count("OK") == nproc, out


# the paper's criterion: it scales down
STREAM = ("--stream.enabled", "--stream.criterion", "kv", "--train.train-shard-size", "1")


@pytest.mark.slow  # the step-level equality is the test above's; a whole stream run, this one's
@pytest.mark.parametrize("sampling", [["--rollout.temperature", "0", "--train.entropy-coef", "0.01"],
                                      ["--schedule.eta-prompts", "1", "--schedule.eta-responses", "1"]])
def test_stream_run_trains_what_the_plain_run_trains(tmp_path, sampling):
    """Migrated requests finish as if never moved: greedy, and seeded sampling (there without
    speculation, which keeps whichever responses finish first, and migration changes that order).
    The stream-trained steps match the plain ones. (A greedy group's rewards are equal, its advantages 0: the
    entropy bonus gives its loss something to compare.)"""
    plain = run(tmp_path / "plain", *sampling, "--train.train-shard-size", "1")
    stream = run(tmp_path / "stream", *sampling, *STREAM)
    assert sum(r["stream/scaled_down"] for r in stream) >= 2
    assert sum(r["stream/streamed_groups"] for r in stream) > 0
    assert all(r["time/migration"] >= 0 and r["stream/train_seconds"] >= 0 for r in stream)
    assert any(r["train/loss"] != 0 for r in plain)
    for a, b in zip(plain, stream):
        assert per_group(a["rollout/response_lengths"]) == per_group(b["rollout/response_lengths"]), a["step"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)


@pytest.mark.slow  # two jobs; the KV projection it rests on: tests/unit/schedule/test_stream.py
def test_scale_down_is_refused_when_it_would_split_a_shard_group_or_overflow_kv(tmp_path):
    # FSDP over both ranks (train_shard_size 0 = world): freeing rank 1 would split the shard group.
    rows = run(tmp_path / "split", "--stream.enabled", "--stream.criterion", "kv")
    assert all(r["stream/scaled_down"] == 0 and r["stream/streamed_groups"] == 0 for r in rows)
    # A KV cache so small that the remaining requests cannot fit on one replica: no scale-down.
    rows = run(tmp_path / "kv", *STREAM, "--engine.kv-memory-mb", "0.5")
    assert all(r["stream/scaled_down"] == 0 for r in rows)
    assert sum(r["rollout/preemptions"] for r in rows) > 0  # the cache really is that small


def test_stream_with_a_batch_advantage_estimator_is_rejected():
    proc = launch_job("--stream.enabled", "--train.advantage", "reinforce_pp", nproc=1, timeout=120)
    assert proc.returncode != 0
    assert "whole step's batch" in proc.stderr and "stream" in proc.stderr
