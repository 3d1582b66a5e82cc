"""``one_step_off`` (verl's one-step-off-policy recipe): the policy's staleness on a scripted
round, the composition rules, and real 2-rank runs (1 rollout rank, 1 training rank) over two
epochs, then resumed from a checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.jobs import NUM_ROWS, QUIET, finish, launch_job, steps
from support.jobs import start_job as launch

RUN = ("schedule:one_step_off", "--train.rollout-correction", "token_tis", "--checkpoint-every", "4",
       "--rollout.temperature", "1.5")


def sampler_state(run_dir: Path) -> dict:
    newest = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return json.loads((newest / "train_state.json").read_text())["policy"]["sampler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one_step_off")
    finish(launch(run_dir, *RUN))
    return run_dir


def test_batches_are_one_step_stale_and_every_prompt_is_trained_once_per_epoch(reference):
    """Staleness, computed independently: batch 0 is generated with the initial weights and
    trained first (0); every later batch k is generated while batch k−1 trains, with the weights
    of step k−1 (1). The engines' log-probs say the same: they equal the trainer's to fp32
    rounding exactly when the batch is fresh, or the step before it did not move the weights: no step
    so far had a gradient (every group's rewards equal), so Adam has no momentum to move them with."""
    records = steps(reference)
    assert sorted(records) == list(range(2 * NUM_ROWS // 4))  # 12 steps of 4 prompts: two epochs
    assert sum(r["sched/trained_prompts"] for r in records.values()) == 2 * NUM_ROWS
    drawn = sampler_state(reference)
    assert drawn["epoch"] * NUM_ROWS + drawn["position"] == 2 * NUM_ROWS
    for step, r in records.items():
        stale = 0 if step == 0 else 1
        assert (r["sched/staleness_mean"], r["sched/staleness_max"]) == (stale, stale), step
        moved = stale and any(records[j]["train/grad_norm"] > 0 for j in range(step))
        assert (r["train/rollout_logprob_diff"] < 1e-5) == (not moved), (step, r["train/rollout_logprob_diff"])
        assert r["time/wait_prev_gen"] >= 0 and r["time/step"] >= r["time/train"]


def test_resume_regenerates_the_checkpointed_batch_with_its_weights(reference, tmp_path):
    """The checkpoint of step 4 holds the weights of 4 steps and the sampler from before batch 4
    was drawn: the resumed run generates batch 4 with exactly those weights (staleness 0, the
    engine's log-probs match the trainer's) and ends where the uninterrupted run ended."""
    shutil.copytree(reference / "checkpoints" / "step_4", tmp_path / "checkpoints" / "step_4")
    finish(launch(tmp_path, *RUN, "--resume", "auto"))
    records, ref = steps(tmp_path), steps(reference)
    assert sorted(records) == list(range(4, 12))
    assert records[4]["sched/staleness_max"] == 0 and records[4]["train/rollout_logprob_diff"] < 1e-5
    assert all(records[s]["sched/staleness_max"] == 1 for s in range(5, 12))
    assert sum(r["sched/trained_prompts"] for r in records.values()) == sum(
        ref[s]["sched/trained_prompts"] for s in range(4, 12))
    assert sampler_state(tmp_path) == sampler_state(reference)


@pytest.mark.slow  # 4 ranks; the broadcast to a TP-1 pool is the tests above', TP's slicing test_engine's
def test_weights_reach_a_tensor_parallel_rollout_pool_whole(tmp_path):
    """4 ranks: a rollout pool of one TP-2 engine, a training pool FSDP2-sharded over 2 ranks. With
    a learning rate too small to move fp32 weights, every step's batch comes from weights pushed
    after a step (gathered from the shards, then sliced for TP), and the engine's log-probs equal
    the trainer's: nothing was lost or mis-sliced on the way."""
    proc = launch_job(*RUN, "--num-steps", "3", "--eval-every", "0", "--rollout.tp", "2", "--train.train-shard-size",
                      "2", "--train.lr", "1e-30", "--rollout.num-prompts", "4", "--rollout.group-size", "2",
                      "--rollout.max-new-tokens", "64", "--run-dir", str(tmp_path), *QUIET, nproc=4)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = steps(tmp_path)
    assert [r["sched/staleness_max"] for r in records.values()] == [0, 1, 1]
    assert all(r["train/rollout_logprob_diff"] < 1e-5 for r in records.values()), records
    assert (tmp_path / "checkpoints" / "step_3" / "COMMITTED").exists()
