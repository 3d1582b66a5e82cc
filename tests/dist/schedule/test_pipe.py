"""RolloutPipe (``schedule.pipe``): complete-group pipelining on scripted completion orders, the
engine's frontier-first admission, the composition rules, and real 2-rank runs (1 rollout rank,
1 train rank): the train pool never rolls out, every step streams groups, the losses are the plain
sync run's, and tail+pipe trains every prompt exactly once per epoch."""

from __future__ import annotations

import pytest
from support.jobs import NUM_ROWS, QUIET, finish, launch_job, per_group, steps, torchrun, trained
from support.jobs import run_four_steps as run
from support.jobs import start_job as launch


def test_pipe_refuses_a_train_pool_that_splits_a_shard_group(tmp_path):
    proc = launch_job("--schedule.pipe", "--num-steps", "1", "--eval-every", "0", "--run-dir", str(tmp_path), *QUIET,
                      timeout=300)
    assert proc.returncode != 0
    assert "schedule.pipe needs a train pool of whole training replicas" in proc.stderr
    assert "--train.train-shard-size" in proc.stderr


@pytest.mark.slow  # the pools' split by script; the run below proves the train pool takes its groups
def test_the_train_pool_never_rolls_out(tmp_path):
    out = torchrun("pipe_pools.py", 2, str(tmp_path), timeout=300)
    assert out.count("OK") == 2, out


def test_pipe_run_trains_what_the_sync_run_trains(tmp_path):
    """Seeded sampling: the same responses wherever they run, so the steps match the colocated
    sync run's; the train pool takes groups as they finish (in how many steps depends on when they
    finish: beside another job, fewer). Temperature 1.5: the shipped toy model
    solves nearly everything at 1, and groups whose rewards all agree train nothing. A group's
    responses finish in another order on one rollout rank than on two, so the samples are summed in
    another order; ``adam_eps`` 1 keeps AdamW from blowing that rounding noise up into different
    weights (see tests/dist/scripts/stream_step.py). Shuffle seed 2: every step has a group to train (with
    seed 0, all 16 responses of step 3 scored 0)."""
    args = ("schedule:sync", "--train.train-shard-size", "1", "--rollout.temperature", "1.5",
            "--train.adam-eps", "1", "--data.shuffle-seed", "2")
    plain = run(tmp_path / "plain", *args)
    pipe = run(tmp_path / "pipe", *args, "--schedule.pipe")
    assert {r["sched/round_kind"] for r in plain + pipe} == {"sync"}
    assert any(r["stream/streamed_groups"] > 0 for r in pipe)
    assert all(0 <= r["pipe/trainer_wait_ratio"] <= 1 and r["pipe/rollout_to_train_end"] > 0 for r in pipe)
    assert all(r["train/grad_norm"] > 0 for r in plain)
    for a, b in zip(plain, pipe, strict=True):
        assert per_group(a["rollout/response_lengths"]) == per_group(b["rollout/response_lengths"]), a["step"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], rel=1e-4, abs=1e-7)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4, abs=1e-7)


@pytest.mark.slow  # pipe's rounds are the test above's; tail's ledger under them, this one's
def test_tail_pipe_trains_every_prompt_exactly_once_per_epoch(tmp_path):
    finish(launch(tmp_path, "--schedule.pipe", "--train.train-shard-size", "1"))
    assert trained(tmp_path) == {0: list(range(NUM_ROWS)), 1: list(range(NUM_ROWS))}
    records = steps(tmp_path).values()
    assert {"short", "long"} <= {r["sched/round_kind"] for r in records}
    assert sum(r["sched/trained_prompts"] for r in records) == 2 * NUM_ROWS
    assert sum(r["stream/streamed_groups"] > 0 for r in records) >= len(records) // 2
