"""The cluster path for real: launch/slurm/train.sbatch on a two-node Slurm brought up on this machine
(launch/slurm/local-cluster.sh), 2 nodes x 1 rank with the toy model and tail batching. The job is
requeued after its first committed checkpoint (``scontrol requeue``: SIGTERM, then SIGKILL), then
sent the time-limit warning (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@120``
does): the workers save after the current step, exit and the script requeues the job. Each attempt
resumes from the newest committed checkpoint; every prompt is trained exactly once.

Marked ``slurm`` (run by .ci/run after the default tier); skipped unless Slurm is installed and we
are root. Also here, unmarked: the script's argument handling, through its dry run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
CLUSTER = ROOT / "launch" / "slurm" / "local-cluster.sh"
NUM_ROWS = 32
ARGS = ["--policy", "tail", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
        "--rollout.group-size", "4", "--rollout.max-new-tokens", "96", "--num-epochs", "1", "--num-steps", "100",
        "--checkpoint-every", "1", "--eval-every", "0", "--metrics.wandb-mode", "disabled", "--metrics.no-live"]


def dry_run(*args: str, **env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NPROC_", "RDZV_", "MAX_RESTARTS"))}
    out = subprocess.run(["bash", str(SBATCH), *args], env={**base, "DRY_RUN": "1", **env},
                         capture_output=True, text=True, check=True).stdout
    return shlex.split(out)


def test_sbatch_dry_run_builds_the_torchrun_line():
    argv = dry_run("--num-steps", "3", "--run-dir", "runs/a b", SLURM_JOB_NUM_NODES="4", SLURM_JOB_ID="77",
                   SLURM_GPUS_PER_NODE="a100:8", RDZV_HOST="node-001", RDZV_PORT="29600", MAX_RESTARTS="2")
    assert argv[:2] == ["srun", "torchrun"]
    assert {"--nnodes=4", "--nproc_per_node=8", "--rdzv_id=77", "--rdzv_backend=c10d",
            "--rdzv_endpoint=node-001:29600", "--max-restarts=2", "--shutdown-timeout=100"} <= set(argv)
    assert "SIGUSR1" in next(a for a in argv if a.startswith("--signals-to-handle=")).split(",")
    module = argv.index("-m")
    assert argv[module:] == ["-m", "rollpacker.run", "--resume", "auto", "--num-steps", "3", "--run-dir", "runs/a b"]


def test_sbatch_dry_run_without_gpus_runs_one_rank_per_node():
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h")  # no --gpus-per-node (SBATCH_GPUS_PER_NODE=0)
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="0")
    assert "--nproc_per_node=2" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="8", NPROC_PER_NODE="2")


def test_sbatch_outside_slurm_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RDZV_"))}
    run = subprocess.run(["bash", str(SBATCH)], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert run.returncode != 0 and "submit with sbatch" in run.stderr


def test_sbatch_directives():
    text = SBATCH.read_text()
    for directive in ("--open-mode=append", "--signal=B:USR1@120", "--requeue", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}" in text


# --- the real thing ------------------------------------------------------------------------------

def _skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root: the test cluster's daemons run as SlurmUser=root"
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "scontrol") if not shutil.which(b)]
    if missing:
        return f"Slurm not installed ({', '.join(missing)} missing): run launch/slurm/local-cluster.sh install"
    for name in (socket.gethostname().split(".")[0], "localhost"):
        try:
            socket.gethostbyname(name)
        except OSError:
            return f"node name {name} does not resolve"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cluster(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "SLURM_LOCAL_DIR": str(tmp_path / "slurm")}
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        env["SLURM_CONF"] = str(tmp_path / "slurm" / "slurm.conf")
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "down"], env=env, capture_output=True, text=True, timeout=120)


def _job(env: dict, job: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _wait(what: str, ready, timeout: float, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = ready()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _committed(run_dir: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*/COMMITTED"))


def _attempts(log: str) -> list[str]:
    """The log split at each attempt's first line (written by train.sbatch)."""
    return re.split(r"^train\.sbatch: job \d+ attempt \d+", log, flags=re.M)[1:]


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+) \|", text, flags=re.M)]


def _job_processes(job: str) -> list[str]:
    """Processes whose environment says they belong to ``job`` (every process Slurm started for it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if f"SLURM_JOB_ID={job}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline[:200]}")
        except OSError:
            continue
    return found


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_two_node_job_requeued_twice_resumes_and_trains_every_prompt_once(cluster, tmp_path):
    env, run_dir, log_path = cluster, tmp_path / "run", tmp_path / "train.out"
    env = {**env, "PYTHONPATH": str(ROOT), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}",
           "RDZV_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    submit = subprocess.run(
        ["sbatch", "--parsable", "--gpus-per-node=1", f"--output={log_path}", str(SBATCH), *ARGS,
         "--run-dir", str(run_dir)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    log = lambda: log_path.read_text() if log_path.exists() else ""  # noqa: E731
    try:
        # attempt 1: hard requeue (SIGTERM to every process, SIGKILL KillWait later) after the first checkpoint
        _wait("the first committed checkpoint", lambda: _committed(run_dir), 240)
        requeue = subprocess.run(["scontrol", "requeue", job], env=env, capture_output=True, text=True)
        assert requeue.returncode == 0, requeue.stderr + log()
        requeued_at = time.monotonic()
        # attempt 2: once it has committed a checkpoint of its own, the time-limit warning
        _wait("attempt 2", lambda: len(_attempts(log())) >= 2, 120)
        seen = set(_committed(run_dir))
        _wait("a checkpoint of attempt 2", lambda: set(_committed(run_dir)) - seen, 120)
        warn = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, capture_output=True, text=True)
        assert warn.returncode == 0, warn.stderr + log()
        _wait("the job to complete", lambda: _job(env, job).get("JobState") in {"COMPLETED", "FAILED", "CANCELLED"},
              240, poll=0.5)
        done_at = time.monotonic()
    finally:
        subprocess.run(["scancel", job], env=env, capture_output=True)
    text = log()
    info = _job(env, job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, text[-5000:])

    attempts = _attempts(text)
    assert len(attempts) == 3, text[-5000:]
    steps = [_steps(a) for a in attempts]
    assert all(steps), steps
    assert "stopped on SIGUSR1" in attempts[1] and "requeueing job" in attempts[1], attempts[1][-3000:]
    assert "done after" in attempts[2]
    committed = set(_committed(run_dir))
    for i in (1, 2):  # each attempt resumed from a committed checkpoint, at or after the last step it saw done...
        resumed = steps[i][0]
        assert resumed >= 1 and resumed in committed, (i, steps)
        assert steps[i - 1][-1] >= resumed - 1, (i, steps)  # ...that the previous attempt had reached
    stopped = int(re.search(r"stopped on SIGUSR1 after (\d+) steps", attempts[1]).group(1))
    assert steps[2][0] == stopped == steps[1][-1] + 1, steps  # the warning's save is where attempt 3 starts

    newest = run_dir / "checkpoints" / f"step_{max(committed)}"
    ledger = json.loads((newest / "train_state.json").read_text())["policy"]["ledger"]
    rows = [row for _, row in ledger["trained"] + ledger["filtered"]]
    assert sorted(rows) == list(range(NUM_ROWS)) and ledger["queue"] == [], ledger
    records = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(records) == list(range(max(committed)))
    assert sum(r["sched/trained_prompts"] for r in records.values()) == NUM_ROWS

    assert _job_processes(job) == []
    print(f"slurm test: requeue->done {done_at - requeued_at:.0f} s, submit->done {done_at - start:.0f} s, "
          f"attempts start at steps {[s[0] for s in steps]}, {max(committed)} steps")
