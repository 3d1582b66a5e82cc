"""Faults on the real 2-rank job (issue #22): a full disk during a save, a stopped rank, a killed rank; and a rank
that would abort at its exit."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
from support.jobs import job_env

from rollpacker import checkpoint
from rollpacker.bench.faults import worker_pid

# --- the real job, 2 gloo ranks ---------------------------------------------------------------------

ARGS = ["schedule:tail", "--data.num-toy-prompts", "24", "--rollout.num-prompts", "4", "--rollout.group-size", "2",
        "--rollout.max-new-tokens", "32", "--checkpoint-every", "1", "--eval-every", "0",
        "--metrics.wandb-mode", "disabled", "--metrics.no-live"]


def job(run_dir, *extra: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            "-m", "rollpacker.run", *ARGS, "--run-dir", str(run_dir), *extra]


def trained_rows(run_dir) -> list[list[int]]:
    newest = checkpoint.latest(run_dir)
    return json.loads((newest / "train_state.json").read_text())["policy"]["ledger"]["trained"]


def can_mount_tmpfs() -> bool:
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=1m tmpfs $d && umount $d"
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "-m", "sh", "-c", probe], capture_output=True).returncode == 0


@pytest.mark.slow  # a rare fault; an interrupted save's atomicity is test_tail's sigkill test's
@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare -m and a tmpfs mount (root or user namespaces)")
def test_a_full_disk_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    disk, copy = tmp_path / "disk", tmp_path / "copy"
    disk.mkdir()
    # a 14 MiB disk holds one checkpoint of the toy model (weights and two AdamW moments: 9.1 MB), not two:
    # step 2's save fills it
    run = shlex.join(job(disk, '--num-steps', '3', '--checkpoint.keep', '1'))
    script = (f"mount -t tmpfs -o size=14m tmpfs {disk} && {run}"
              f"; rc=$?; cp -a {disk} {copy}; exit $rc")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=900,
                          env=job_env())
    assert proc.returncode != 0
    message = re.search(r"rollpacker: (checkpoint: saving step 2 .*)", proc.stderr)
    assert message, proc.stderr[-4000:]
    assert proc.stderr.count("checkpoint: saving step 2") == 1  # said once
    assert re.fullmatch(
        rf"checkpoint: saving step 2 to {disk}/checkpoints/step_2 failed on rank\(s\) \[[01, ]+\] \(rank \d: .*; "
        rf"\d+\.\d MiB free in {disk}/checkpoints on rank \d\)\. The partial save was removed; the newest committed "
        rf"checkpoint is {disk}/checkpoints/step_1, which --resume auto picks\. Free disk space or fix the permissions "
        rf"under {disk}/checkpoints, then resume", message.group(1)), message.group(1)
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step_1"]
    assert (copy / "checkpoints" / "step_1" / checkpoint.MARKER).exists()
    # the copy resumes from step 1 on a disk with room and trains every prompt once
    done = subprocess.run(job(copy, "--num-steps", "3", "--resume", "auto"), capture_output=True, text=True,
                          timeout=900, env=job_env())
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"resuming from {copy}/checkpoints/step_1" in done.stderr
    assert sorted(steps(copy)) == [0, 1, 2]
    rows = trained_rows(copy)
    assert len({tuple(r) for r in rows}) == len(rows) == sum(r["sched/trained_prompts"] for r in steps(copy).values())


def test_a_run_that_diverges_stops_saying_so_once_without_a_traceback(tmp_path):
    """train.max_skipped_steps non-finite steps in a row stop the run (lr 1e30: every update overflows): its
    message, the fix in it, came out as a traceback on every rank."""
    proc = subprocess.run(job(tmp_path, "--num-steps", "6", "--train.lr", "1e30", "--train.warmup-steps", "0",
                              "--train.max-skipped-steps", "2"), capture_output=True, text=True, timeout=600,
                          env=job_env())
    assert proc.returncode != 0
    said = "rollpacker: train: 2 consecutive steps skipped for a non-finite loss or gradient"
    assert proc.stderr.count(said) == 1 and "NonFiniteError" not in proc.stderr, proc.stderr[-4000:]
    assert checkpoint.latest(tmp_path) is not None and "Lower --train.lr" in proc.stderr


def steps(run_dir) -> dict[int, dict]:
    """The metrics of every step; a step redone after a resume keeps its last record."""
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "step" in r}


def metric_lines(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.slow  # 20 s each, most of it the timeout waited out; phases' timeouts: tests/unit/test_dist.py
@pytest.mark.parametrize("rank", [0, 1])
def test_a_stopped_rank_is_named_within_the_timeout(tmp_path, rank):
    """Rank 1 stopped in the round, and rank 0 right after a checkpoint commits: rank 0 hosts the job's
    store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as the launch line of docs/cluster-and-faults.md), so
    a store call on rank 1 never returned and the job hung for good (issue #36)."""
    timeout_s, log = 10, tmp_path.with_suffix(".log")
    with log.open("w") as f:
        proc = subprocess.Popen(job(tmp_path, "--num-steps", "50", "--dist.timeout-s", str(timeout_s),
                                    "--dist.checkpoint-timeout-s", str(timeout_s)),
                                stdout=subprocess.DEVNULL, stderr=f, start_new_session=True,
                                env=job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"))
    try:
        deadline = time.time() + 600
        while not ready(tmp_path, rank) and proc.poll() is None and time.time() < deadline:
            time.sleep(0.001)  # step 1 is done (collectives now wait dist.timeout_s), then: rank 0 at a commit
        pid = worker_pid(tmp_path, rank)
        assert pid and proc.poll() is None, f"the run ended before rank {rank} could be stopped"
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        while " timed out after " not in (err := log.read_text()) and time.time() < stopped + 300:
            time.sleep(0.1)
        named = time.time() - stopped
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for r in (0, 1):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(worker_pid(tmp_path, r), signal.SIGKILL)
    other = 1 - rank
    silent = (r"rank\(s\) \[1\] did not answer \(rank 1: last heartbeat \d+s ago, at step \d+, phase \w+\)" if rank
              else r"rank 0 did not answer either \(it hosts the job's store, silent for \d+s\): rank 0 is stalled")
    assert re.search(rf"rollpacker: rank {other} timed out after {timeout_s}s at step \d+, phase \w+: {silent}\. "
                     r"Exiting non-zero", err), err[-4000:]
    assert named < timeout_s + 15, f"named {named:.0f}s after the SIGSTOP (dist.timeout_s={timeout_s})"


def ready(run_dir, rank: int) -> bool:
    if metric_lines(run_dir) < 2:
        return False
    return rank or (run_dir / "checkpoints" / f"step_{metric_lines(run_dir)}" / checkpoint.MARKER).exists()


RESUMES = """
import os
import sys
from pathlib import Path
import torch.distributed as dist
from rollpacker import checkpoint
from rollpacker.config import Config
from rollpacker.dist import exit_process
from rollpacker.errors import UserError
from rollpacker.job import check_same_resume
dist.init_process_group("gloo")
rank = dist.get_rank()
if sys.argv[4:] == [str(rank)]:  # torchrun restarted this rank's node alone
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
# the checkpoints are markers alone: whole, of any policy (their checks are test_faults.py's in tests/unit)
checkpoint.verify = checkpoint.check = checkpoint.check_lora_alpha = lambda *args, **kwargs: None
checkpoint.newest_whole = lambda run_dir, announce: checkpoint.latest(run_dir)
config = Config(run_dir=str(Path(sys.argv[1], "run")), resume=sys.argv[2 + rank])
try:
    check_same_resume(config, dist.group.WORLD)
    said = f"same: {config.resume or 'nothing'}"
except UserError as e:
    said = str(e)
Path(sys.argv[1], f"rank{rank}.txt").write_text(said)  # a file: in CI a stranger line on stdout broke its reading
exit_process(0)
"""


def resumes(tmp_path, *argv) -> list[str]:
    """What each of two ranks said of check_same_resume, given its resolved --resume (and the restarted rank)."""
    (tmp_path / "resumes.py").write_text(RESUMES)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "resumes.py"), str(tmp_path), *argv], capture_output=True, text=True,
                          timeout=120, env=job_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]


@pytest.mark.parametrize("paths", [("run/checkpoints/step_4", "run/checkpoints/step_2"),
                                   ("run/checkpoints/step_4", "")])
def test_ranks_resuming_from_different_checkpoints_stop_before_loading(tmp_path, paths):
    """Each rank resolves --resume auto on its own view of run_dir: a node whose network filesystem lags would load
    an older step's shards beside the newest's (or none, and hang the load the others wait in)."""
    said = (f"resume: rank 0 resumes from {paths[0]}, rank 1 from {paths[1] or 'nothing (a fresh start)'}: the nodes "
            "do not see the same run_dir")
    assert [text.startswith(said) for text in resumes(tmp_path, *paths)] == [True, True]


def test_a_restart_of_one_nodes_ranks_resumes_every_rank_as_auto(tmp_path):
    """torchrun counts a restart only on the node that failed: a rank of another node, given --resume PATH, went
    back to PATH while the restarted ranks resumed from the newest checkpoint (step 6, which the attempt before
    saved); with no restart, PATH is kept."""
    for step in (4, 6):
        (tmp_path / "run" / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "run" / "checkpoints" / f"step_{step}" / checkpoint.MARKER).write_text("")
    named, newest = (str(tmp_path / "run" / "checkpoints" / f"step_{step}") for step in (4, 6))
    assert resumes(tmp_path, named, newest, "1") == [f"same: {newest}"] * 2
    assert resumes(tmp_path, named, named) == [f"same: {named}"] * 2


@pytest.mark.slow  # torchrun's restart; a kill losing nothing is test_tail's sigkill test
def test_a_killed_rank_is_restarted_by_torchrun_and_resumes_losing_nothing(tmp_path):
    """The launch line of docs/cluster-and-faults.md on one node: torchrun --max-restarts with --resume auto."""
    cmd = job(tmp_path, "--num-steps", "100", "--num-epochs", "1", "--resume", "auto")
    cmd.insert(cmd.index("--nproc_per_node=2") + 1, "--max-restarts=2")
    env = job_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")  # pytorch#135712, as in train.sbatch
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        deadline = time.time() + 600
        while metric_lines(tmp_path) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # into step 2's round
        pid = worker_pid(tmp_path, 1)
        assert pid and proc.poll() is None, "the run ended before rank 1 could be killed"
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=900)
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
    assert proc.returncode == 0, err[-4000:]
    assert "Worker group FAILED" in err or "restart" in err.lower(), err[-4000:]
    assert f"resuming from {tmp_path}/checkpoints/step_" in err  # the restarted group resumed
    rows = trained_rows(tmp_path)
    assert sorted(row for _, row in rows) == list(range(24)) and {e for e, _ in rows} == {0}  # every prompt once
    assert sum(r["sched/trained_prompts"] for r in steps(tmp_path).values()) == 24


@pytest.mark.parametrize("nproc", [1, 2])  # 1: a one-GPU node, whose rank has no store to beat to
def test_ranks_exit_when_their_torchrun_is_killed(tmp_path, nproc):
    """Torchrun starts its ranks in sessions of their own; SIGKILLed, it cannot stop them, so each
    rank's heartbeat thread sees its parent gone and exits instead of training on into the run
    directory. One of a node's ranks says so (each did)."""
    err = tmp_path / "stderr"
    proc = subprocess.Popen(job(tmp_path, "--num-steps", "200", nproc=nproc), stdout=subprocess.DEVNULL,
                            stderr=err.open("w"), start_new_session=True, env=job_env())
    ranks = []
    try:
        deadline = time.time() + 600
        while metric_lines(tmp_path) < 2 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        ranks = [worker_pid(tmp_path, rank) for rank in range(nproc)]
        assert all(ranks) and proc.poll() is None, "the run ended before its torchrun could be killed"
        os.kill(proc.pid, signal.SIGKILL)  # torchrun alone
        proc.wait()
        killed, deadline = metric_lines(tmp_path), time.time() + 30
        while any(worker_pid(tmp_path, rank) for rank in range(nproc)) and time.time() < deadline:
            time.sleep(0.1)
        assert not any(worker_pid(tmp_path, rank) for rank in range(nproc)), "ranks outlived their torchrun by 30 s"
        assert metric_lines(tmp_path) <= killed + 10  # a step or a few, not the run's 200
        assert err.read_text().count("rollpacker: rank 0: its launcher (torchrun, pid") == 1, err.read_text()
        assert "rank 1: its launcher" not in err.read_text()
    finally:
        for pid in ranks:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


@pytest.mark.slow  # 20 s; a phase's verdicts and restore: tests/unit/test_dist.py; stopped ranks named: above
def test_a_waiting_phase_names_the_stopped_rank_before_the_collectives_timeout():
    """Issue 37: on NCCL a collective's timeout aborts the process without a Python exception, so a phase that
    waits long (hand-off, freed ranks) prints the diagnosis itself once a rank it waits on stops, and exits."""
    from support.jobs import DIST_SCRIPTS

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(DIST_SCRIPTS / "phase_wait.py")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env(OMP_NUM_THREADS="1"))
    assert proc.returncode != 0 and "the broadcast returned" not in proc.stdout
    assert "NCCL settings equal on both ranks: {'NCCL_CUMEM_ENABLE': '0', 'NCCL_NVLS_ENABLE': '0'" in proc.stdout
    for rank in (0, 1):  # each rank logged what it exported before its process group
        assert f"rank {rank}: NCCL environment NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0" in proc.stderr, proc.stderr
    match = re.search(r"rollpacker: rank 0 waited \d+s at step -1, phase handoff: rank\(s\) \[1\] did not "
                      r"answer \(rank 1: last heartbeat \d+s ago", proc.stderr)
    assert match, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr[:match.start()], proc.stderr[-4000:]  # no collective timed out first


def test_two_ranks_that_ran_a_meshs_collectives_exit_cleanly(tmp_path):
    """After a device mesh's collectives, the interpreter's teardown aborted one rank of two in about half of
    the runs ("terminate called without an active exception", CI's SGLang TP-2 test); exit_process skips it."""
    script = tmp_path / "mesh_exit.py"
    script.write_text("import torch, torch.distributed as dist\n"
                      "from torch.distributed.device_mesh import init_device_mesh\n"
                      "from rollpacker.dist import exit_process\n"
                      "dist.init_process_group('gloo')\n"
                      "mesh = init_device_mesh('cpu', (2,))\n"
                      "dist.all_gather_object([None, None], list(range(1000)))\n"
                      "dist.all_reduce(torch.ones(1000), group=mesh.get_group())\n"
                      "exit_process(0)\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    for _ in range(3):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=job_env(OMP_NUM_THREADS="1"))
        assert proc.returncode == 0, proc.stderr[-3000:]
