"""The training job on SGLang (``--engine.kind sglang``, CPU): every policy runs a real 2-rank job
to the end of an epoch and trains every prompt exactly once (the ledger, for the policies that keep
one); a scheduler killed mid-run (the tail job) ends its rank with one error naming it, and
torchrun's restart resumes the job losing nothing; a Ctrl-C stops it after its step, saved. The
``sglang`` tier (``pytest -m sglang``, after ``bash launch/install.sh sglang``); the planner's refusal
is a unit test."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from support.jobs import DIST_SCRIPTS, QUIET, cause, job_command, sglang_env, steps, trained

pytestmark = pytest.mark.sglang

NUM_ROWS = 12
JOB = ("--engine.kind", "sglang", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
       "--rollout.group-size", "2", "--rollout.max-new-tokens", "64", "--num-epochs", "1", "--num-steps", "100",
       "--checkpoint-every", "1", "--eval-every", "0", *QUIET)
"""One epoch of NUM_ROWS toy prompts, 4 per step, on SGLang."""

POLICIES = {  # one_step_off first: see tests/dist/scripts/sglang_policies.py; tail: the killed-scheduler test's job
    "one_step_off": ("schedule:one_step_off", "--train.rollout-correction", "token_tis"),
    "sync": ("schedule:sync",),
    "sorted": ("schedule:sorted", "--schedule.sorted-batches", "2"),
    "sorted_partial": ("schedule:sorted_partial", "--schedule.sorted-batches", "2", "--train.rollout-correction",
                       "token_tis"),
    "pipe": ("schedule:tail", "--schedule.pipe", "--train.train-shard-size", "1"),
    # a fixed trigger: the migration on SGLang is what is tested (the adaptive one, which the decider's own tests
    # cover, scaled down in 0 of 4 steps in some runs before step() counted streamed updates as steps; docs/sglang.md).
    # A group is fed once scored, a poll after it completed at the earliest: at 8 engine steps a poll, a 64-token
    # round's rest often ended first (nothing streamed in 4 of 8 rounds here, in all 4 of a run in CI); at 2, in 3 of
    # 12, each launch's first round, over before the spawned reward workers had imported the launch script's torch
    # (6.4 s); with its imports in main(), in 1 of 12
    "stream": ("schedule:tail", "--stream.enabled", "--stream.trigger", "0.25", "--train.train-shard-size", "1",
               "--rollout.poll-steps", "2"),
}


@pytest.fixture(scope="module")
def policy_runs(tmp_path_factory):
    """Every policy's job, one after another in one torchrun launch (each rank's engine started once)."""
    root = tmp_path_factory.mktemp("sglang_policies")
    runs = json.dumps([[name, [*flags, *JOB]] for name, flags in POLICIES.items()])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(DIST_SCRIPTS / "sglang_policies.py"), str(root), runs]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, env=sglang_env())
    (root / "stderr.log").write_text(proc.stderr)  # whole, for a failure its excerpt below does not explain
    return root, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{cause(proc.stderr)}"


@pytest.mark.timeout(1800)  # the fixture's six jobs count against the first test's limit
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_trains_every_prompt_once_on_sglang(policy_runs, policy):
    root, log = policy_runs
    run_dir = root / policy
    assert (run_dir / "metrics.jsonl").exists(), log
    records = list(steps(run_dir).values())
    assert sum(r["sched/trained_prompts"] for r in records) == NUM_ROWS, log
    if policy not in ("sync", "one_step_off"):  # they draw the epoch in order and keep no ledger
        assert trained(run_dir) == {0: list(range(NUM_ROWS))}
    assert all(r["train/grad_norm"] >= 0 and r["rollout/response_len_mean"] > 0 for r in records)
    if policy == "stream":
        assert sum(r["stream/streamed_groups"] for r in records) > 0


@pytest.mark.timeout(1800)
def test_a_dying_scheduler_ends_its_rank_naming_it_and_the_restart_resumes(tmp_path):
    """The tail job; SIGKILL rank 1's SGLang scheduler once a checkpoint is committed: rank 1 exits with
    EngineDied (not SGLang's SIGKILL of it), torchrun restarts the group, which resumes from the
    newest checkpoint (--resume auto) and trains every prompt once (the ledger). Rank 0 of the first attempt, ended
    at once after its peer failed, leaves nothing in /dev/shm either."""
    import os

    import psutil

    from rollpacker import checkpoint
    from rollpacker.bench.faults import worker_pid

    cmd = job_command("schedule:tail", *JOB, "--run-dir", str(tmp_path), "--resume", "auto")
    cmd.insert(cmd.index("--nproc_per_node=2") + 1, "--max-restarts=1")
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=sglang_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        deadline = time.time() + 900
        while checkpoint.latest(tmp_path) is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)  # step 1's checkpoint committed: the restart resumes from it
        rank1 = worker_pid(tmp_path, 1)
        assert rank1 and proc.poll() is None, "the run ended before its scheduler could be killed"
        scheduler = next(p for p in psutil.Process(rank1).children(recursive=True)
                         if p.name().startswith("sglang::scheduler"))
        scheduler.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, cause(err)
    assert set(os.listdir("/dev/shm")) <= before, sorted(set(os.listdir("/dev/shm")) - before)
    assert f"EngineDied: SGLang's engine failed: sglang::scheduler (pid {scheduler.pid}) exited" in err, cause(err)
    assert "resuming from" in err
    assert trained(tmp_path) == {0: list(range(NUM_ROWS))}
    assert sum(r["sched/trained_prompts"] for r in steps(tmp_path).values()) == NUM_ROWS


@pytest.mark.timeout(900)
def test_ctrl_c_stops_an_sglang_job_after_its_step_with_a_checkpoint(tmp_path):
    """Ctrl-C at torchrun, which passes SIGINT on to each rank's process group (a Slurm stop's SIGTERM reaches
    every process too): SGLang's processes died of it and their SIGQUIT ended the job as an engine failure, with
    no checkpoint. Its engines' shutdown leaves nothing in /dev/shm."""
    import os

    from rollpacker import checkpoint

    job = " ".join(JOB).replace("num-toy-prompts 12", "num-toy-prompts 48").replace("checkpoint-every 1",
                                                                                      "checkpoint-every 0")
    cmd = job_command("schedule:tail", *job.split(), "--run-dir", str(tmp_path))  # 12 steps, the stop's save alone
    before = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=sglang_env())
    metrics = tmp_path / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while not (metrics.exists() and metrics.read_text()) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before its stop"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = checkpoint.latest(tmp_path)
    assert stopped is not None and "EngineDied" not in err, cause(err)  # torchrun exits 1 of its own SIGINT
    assert f"rollpacker: stopped on SIGINT with {stopped.name.split('_')[1]} of 100 steps done" in err, cause(err)
    assert set(os.listdir("/dev/shm")) <= before, sorted(set(os.listdir("/dev/shm")) - before)
