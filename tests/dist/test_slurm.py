"""The cluster path for real: launch/slurm/train.sbatch on a two-node Slurm brought up on this machine
(launch/slurm/local-cluster.sh), 2 nodes x 1 rank with the toy model and tail batching. The job is
requeued after its first checkpoint (``scontrol requeue``: SIGTERM to every process, SIGKILL 10 s later), then sent the
time-limit warning (``scancel --signal=USR1 --batch``, what ``--signal=B:USR1@120``
does): the workers save after the current step, exit and the script requeues the job. Each attempt
resumes from the newest committed checkpoint; every prompt is trained exactly once. A second job
loses rank 1 (the second node's) to SIGKILL: torchrun restarts the group, which resumes.

Marked ``slurm`` (run by .ci/run after the default tier); skipped unless Slurm is installed and we
are root. Also here, without that mark: the script's argument handling, through its dry run, and the
trainer's side of a stop signal without Slurm (SIGUSR1 mid-run, during the last step, to one rank alone).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.jobs import job_env, start_job

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch" / "slurm" / "train.sbatch"
CLUSTER = ROOT / "launch" / "slurm" / "local-cluster.sh"
NUM_ROWS = 48
ARGS = ["schedule:tail", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
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


def test_a_requeued_job_started_from_a_named_checkpoint_resumes_from_its_newest():
    """A job started with --resume PATH (a run taken back to an earlier step) resumed from PATH again on every
    requeue, redoing, and un-committing, each step since."""
    named = ("--resume", "runs/a/checkpoints/step_4")
    assert dry_run(*named, RDZV_HOST="h")[-2:] == list(named)
    assert dry_run(*named, RDZV_HOST="h", SLURM_RESTART_COUNT="2")[-4:] == [*named, "--resume", "auto"]
    assert dry_run(RDZV_HOST="h", SLURM_RESTART_COUNT="1").count("--resume") == 2  # auto, and auto again


def test_sbatch_dry_run_without_gpus_runs_one_rank_per_node():
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h")  # no --gpus-per-node (SBATCH_GPUS_PER_NODE=0)
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="0")
    assert "--nproc_per_node=2" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="8", NPROC_PER_NODE="2")


def test_sbatch_runs_a_rank_per_gpu_asked_for_and_held():
    """sbatch --gres=gpu:2 beside the script's --gpus-per-node=8: Slurm may grant 2 (SLURM_GPUS_ON_NODE) and still say
    SLURM_GPUS_PER_NODE=8, and the script ran 8 ranks on 2 GPUs. --exclusive grants a node's every GPU: at
    --gpus-per-node=1 the script ran 8 ranks a node, at --gpus-per-node=0 too."""
    assert "--nproc_per_node=2" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="8", SLURM_GPUS_ON_NODE="2")
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="1", SLURM_GPUS_ON_NODE="8")
    assert "--nproc_per_node=1" in dry_run(RDZV_HOST="h", SLURM_GPUS_PER_NODE="0", SLURM_GPUS_ON_NODE="8")
    assert "--nproc_per_node=4" in dry_run(RDZV_HOST="h", SLURM_GPUS_ON_NODE="h100:4")


def test_sbatch_takes_the_first_node_of_a_long_list_and_torchruns_nproc_words(tmp_path):
    """The head node read through ``| head -n 1`` ended scontrol by SIGPIPE on long node lists: exit 141 under
    pipefail, the job gone without a word. Here a stand-in ``scontrol`` prints 200000 names, as Slurm's would
    for that many nodes; ``NPROC_PER_NODE=auto`` (torchrun's word) was an unbound variable."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\nseq -f 'node-%06g' 1 200000\n")
    (tmp_path / "scontrol").chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    for _ in range(3):
        assert "--rdzv_endpoint=node-000001:29500" in dry_run(SLURM_JOB_NODELIST="node-[000001-200000]", PATH=path)
    assert "--nproc_per_node=auto" in dry_run(RDZV_HOST="h", NPROC_PER_NODE="auto")
    run = subprocess.run(["bash", str(SBATCH)], env={**os.environ, "DRY_RUN": "1", "RDZV_HOST": "h",
                                                     "NPROC_PER_NODE": "eight"}, capture_output=True, text=True)
    assert run.returncode == 2 and "NPROC_PER_NODE=eight: a number, or auto" in run.stderr, run.stderr


def test_sbatch_outside_slurm_says_so():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RDZV_"))}
    run = subprocess.run(["bash", str(SBATCH)], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert run.returncode != 0 and "submit with sbatch" in run.stderr


def test_sbatch_directives():
    text = SBATCH.read_text()
    for directive in ("--open-mode=append", "--signal=B:USR1@120", "--requeue", "--ntasks-per-node=1"):
        assert f"#SBATCH {directive}" in text


def test_sigusr1_saves_after_the_current_step_and_exits_0(tmp_path):
    """The trainer's side of the time-limit warning, without Slurm: one rank, SIGUSR1 after the
    first checkpoint; it saves after the step it is in, says so and exits 0."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "rollpacker.run", *ARGS, "--run-dir", str(run_dir)],
                            env=job_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait("the first committed checkpoint", lambda: _committed(run_dir) or proc.poll() is not None, 300, poll=0.01)
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    stopped = re.search(r"stopped on SIGUSR1 with (\d+) of \d+ steps done", out)
    assert proc.returncode == 0 and stopped, out[-3000:]
    steps = int(stopped.group(1))
    assert _committed(run_dir)[-1] == steps and steps < NUM_ROWS // 4, (steps, out[-3000:])
    assert _steps(out)[-1] == steps - 1


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_step(tmp_path):
    """One node's torchrun stopped alone (a drained node) signals its own ranks only: rank 1's signal
    stops the whole job after the step it is in, saved, as rank 0's does (it was not heard)."""
    from rollpacker.bench.faults import worker_pid

    run_dir = tmp_path / "run"
    proc = start_job(run_dir)
    try:
        _wait("the first committed checkpoint", lambda: _committed(run_dir) or proc.poll() is not None, 300, poll=0.01)
        os.kill(worker_pid(run_dir, 1), signal.SIGUSR1)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = re.search(r"stopped on SIGUSR1 with (\d+) of (\d+) steps done", err)
    assert proc.returncode == 0 and stopped, err[-3000:]
    assert _committed(run_dir)[-1] == int(stopped[1]) < int(stopped[2]) // 2


WARN_IN_REWARD = '''
import os, signal

def warn(completions, **kwargs):  # Slurm's time-limit warning, to the rank scoring (the worker's parent)
    os.kill(os.getppid(), signal.SIGUSR1)
    return [0.0] * len(completions)
'''


@pytest.mark.timeout(400)
def test_sigusr1_during_the_last_step_lets_the_run_end_with_its_export(tmp_path):
    """A stop signal during the last step has nothing left to stop: the run ends as it would have, its
    policy exported (it used to stop without one, and a resume found nothing to train). A resume of a
    finished run whose export is gone names the command that writes it."""
    (tmp_path / "warn.py").write_text(WARN_IN_REWARD)
    run_dir, env = tmp_path / "run", job_env(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "rollpacker.run", *ARGS, "--num-steps", "1", "--reward.funcs", "warn.py:warn",
            "--run-dir", str(run_dir)]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "stop on SIGUSR1 during the last step: the run ends" in said, said[-3000:]
    assert "stopped on" not in said and "done after 1 steps" in said
    assert _committed(run_dir) == [1] and (run_dir / "hf" / "config.json").exists()
    shutil.rmtree(run_dir / "hf")
    again = subprocess.run([*argv, "--resume", "auto"], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (f"step_1 is at step 1 of num_steps 1: nothing to train (raise --num-steps to go on); its Hugging Face "
            f"export {run_dir / 'hf'} is missing (stopped while writing it): python -m rollpacker.export "
            f"{run_dir / 'checkpoints' / 'step_1'} --out {run_dir / 'hf'}") in again.stderr, again.stderr[-3000:]


def _steps(text: str) -> list[int]:
    return [int(s) for s in re.findall(r"^step (\d+)(?:/\d+)? \|", text, flags=re.M)]


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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The two-node cluster, up for this module's Slurm tests; its environment for sbatch."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    tmp_path = tmp_path_factory.mktemp("slurm")
    env = job_env(SLURM_LOCAL_DIR=str(tmp_path / "slurm"))
    up = subprocess.run(["bash", str(CLUSTER), "up"], env=env, capture_output=True, text=True, timeout=60)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield {**env, "SLURM_CONF": str(tmp_path / "slurm" / "slurm.conf"), "PYTHONPATH": str(ROOT),
               "PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "OMP_NUM_THREADS": "1"}
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


def _events(log: str) -> list[tuple[str, int]]:
    """What the log says happened, in order: ("attempt", n) (train.sbatch's first line of an attempt),
    ("resume", k) (rank 0 resuming from checkpoints/step_k), ("step", n) (step n done), ("usr1_stop", n) (the
    time-limit warning's save after n steps) and ("done", n)."""
    patterns = {"attempt": r"^train\.sbatch: job \d+ attempt (\d+)",
                "resume": r"rollpacker: resuming from \S*step_(\d+)$", "step": r"^step (\d+)(?:/\d+)? \|",
                "usr1_stop": r"rollpacker: stopped on SIGUSR1 with (\d+) of \d+ steps done",
                "done": r"rollpacker: done after (\d+) steps"}
    events = []
    for line in log.splitlines():
        for kind, pattern in patterns.items():
            if m := re.search(pattern, line):
                events.append((kind, int(m.group(1))))
    return events


def _job_processes(job: str, rank: int | None = None) -> dict[int, str]:
    """Processes whose environment says they belong to ``job`` (every process Slurm started for it),
    or only its training rank ``rank``: pid -> command line."""
    wanted = {f"SLURM_JOB_ID={job}".encode()} | ({f"RANK={rank}".encode()} if rank is not None else set())
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if wanted <= set((proc / "environ").read_bytes().split(b"\0")):
                found[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    return found


class Job:
    """A toy run submitted with the real train.sbatch: its job id, run dir and log."""

    def __init__(self, env: dict, tmp_path: Path, *sbatch_flags: str, **script_env: str):
        self.env = {**env, "RDZV_PORT": str(_free_port()), **script_env}
        self.run_dir, self.log_path = tmp_path / "run", tmp_path / "train.out"
        submit = subprocess.run(["sbatch", "--parsable", "--gpus-per-node=1", f"--output={self.log_path}",
                                 *sbatch_flags, str(SBATCH), *ARGS, "--run-dir", str(self.run_dir)],
                                cwd=tmp_path, env=self.env, capture_output=True, text=True)
        assert submit.returncode == 0, submit.stderr
        self.id = submit.stdout.strip().split(";")[0]

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def after_new_checkpoint(self, what: str, timeout: float = 120) -> None:
        seen = set(_committed(self.run_dir))
        _wait(f"a checkpoint after {what}", lambda: set(_committed(self.run_dir)) - seen, timeout)

    def slurm(self, *argv: str) -> None:
        run = subprocess.run([*argv, self.id], env=self.env, capture_output=True, text=True)
        assert run.returncode == 0, run.stderr + self.log()[-3000:]

    def wait_end(self, timeout: float = 240) -> dict[str, str]:
        _wait("the job to end", lambda: _job(self.env, self.id).get("JobState") in {"COMPLETED", "FAILED", "CANCELLED"},
              timeout, poll=0.5)
        return _job(self.env, self.id)

    def check_resumes_and_ledger(self) -> list[tuple[str, int]]:
        """Each resume went on from a committed checkpoint that the run had reached; the run ended
        with every prompt trained exactly once and one metrics record per step. The log's events."""
        events, committed = _events(self.log()), set(_committed(self.run_dir))
        resumes = [i for i, (kind, _) in enumerate(events) if kind == "resume"]
        for i, j in zip(resumes, [*resumes[1:], len(events)]):
            k = events[i][1]
            before = [n for kind, n in events[:i] if kind == "step"]
            after = [n for kind, n in events[i:j] if kind == "step"]
            assert k >= 1 and k in committed and before and before[-1] >= k - 1 and after and after[0] == k, (k, events)
        num_steps = events[-1][1]
        assert events[-1] == ("done", num_steps) and num_steps == max(committed), events
        newest = self.run_dir / "checkpoints" / f"step_{num_steps}"
        ledger = json.loads((newest / "train_state.json").read_text())["policy"]["ledger"]
        rows = [row for _, row in ledger["trained"] + ledger["filtered"]]
        assert sorted(rows) == list(range(NUM_ROWS)) and ledger["queue"] == [], ledger
        records = {r["step"]: r for r in map(json.loads, (self.run_dir / "metrics.jsonl").read_text().splitlines())}
        assert sorted(records) == list(range(num_steps))
        assert sum(r["sched/trained_prompts"] for r in records.values()) == NUM_ROWS
        assert _job_processes(self.id) == {}
        assert "nproc_per_node=1," in self.log()  # the --gpus-per-node=1 asked for, of the node's 8
        return events


@pytest.mark.slurm
@pytest.mark.timeout(420)
def test_two_node_job_requeued_then_warned_resumes_and_trains_every_prompt_once(cluster, tmp_path):
    start = time.monotonic()
    job = Job(cluster, tmp_path)
    try:
        # attempt 1: requeued after its first checkpoint (SIGTERM to every process, SIGKILL 10 s later)
        _wait("the first committed checkpoint", lambda: _committed(job.run_dir), 240)
        job.slurm("scontrol", "requeue")
        requeued_at = time.monotonic()
        # attempt 2: the time-limit warning (what --signal=B:USR1@120 sends), once it has saved a checkpoint
        _wait("attempt 2", lambda: ("attempt", 2) in _events(job.log()), 120)
        job.after_new_checkpoint("attempt 2 started")
        job.slurm("scancel", "--signal=USR1", "--batch")
        info = job.wait_end()
        done_at = time.monotonic()
    finally:
        subprocess.run(["scancel", job.id], env=job.env, capture_output=True)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, job.log()[-5000:])
    events = job.check_resumes_and_ledger()
    attempts = [i for i, (kind, _) in enumerate(events) if kind == "attempt"]
    resumes = [i for i, (kind, _) in enumerate(events) if kind == "resume"]
    assert [events[i][1] for i in attempts] == [1, 2, 3], events  # the log holds every attempt
    assert attempts[0] < attempts[1] < resumes[0] < attempts[2] < resumes[1] and len(resumes) == 2, events
    stop = next(i for i, (kind, _) in enumerate(events) if kind == "usr1_stop")
    saved = events[stop][1]  # the warning's save, in attempt 2, is where attempt 3 starts
    assert attempts[1] < stop < attempts[2] and events[stop + 1:stop + 3] == [  # a stop is not "done"
        ("attempt", 3), ("resume", saved)], events
    assert "requeueing job" in job.log()
    print(f"slurm requeue test: submit->done {done_at - start:.0f} s (requeue->done {done_at - requeued_at:.0f} s), "
          f"{events[-1][1]} steps, resumed at {[events[i][1] for i in resumes]}")


@pytest.mark.slurm
@pytest.mark.timeout(300)
def test_killed_worker_is_restarted_by_torchrun_and_resumes(cluster, tmp_path):
    """Rank 1 (the second node's) SIGKILLed after the first checkpoint: both nodes' torchrun restart
    their workers in a new rendezvous round (no requeue), and the new group resumes."""
    start = time.monotonic()
    job = Job(cluster, tmp_path)
    try:
        _wait("the first committed checkpoint", lambda: _committed(job.run_dir), 240)
        victim = _wait("rank 1's process", lambda: [pid for pid, cmd in _job_processes(job.id, rank=1).items()
                                                     if "rollpacker.run" in cmd], 30)
        for pid in victim:
            os.kill(pid, signal.SIGKILL)
        info = job.wait_end()
    finally:
        subprocess.run(["scancel", job.id], env=job.env, capture_output=True)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", (info, job.log()[-5000:])
    events = job.check_resumes_and_ledger()
    assert [kind for kind, _ in events].count("resume") == 1 and ("attempt", 2) not in events, events
    print(f"slurm worker-restart test: submit->done {time.monotonic() - start:.0f} s, resumed at "
          f"{[n for kind, n in events if kind == 'resume']}")
