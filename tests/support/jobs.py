"""The one launcher of real jobs in tests (:func:`launch_job`, :func:`torchrun` for the scripts in
``tests/dist/scripts``), their environments, and what a test reads back from a run directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
DIST_SCRIPTS = TESTS / "dist" / "scripts"
QUIET = ("--metrics.wandb-mode", "disabled", "--metrics.no-live")
"""Flags every test job takes: no wandb, no live display."""
NUM_ROWS = 24
TWO_EPOCHS = ("schedule:tail", "--data.num-toy-prompts", str(NUM_ROWS), "--rollout.num-prompts", "4",
              "--rollout.group-size", "2", "--rollout.max-new-tokens", "96", "--num-epochs", "2", "--num-steps", "100",
              "--checkpoint-every", "1", "--eval-every", "0", *QUIET)
"""The small job of the tail, one_step_off and pipe run tests: two epochs of NUM_ROWS prompts, 4 per step."""


def cause(stderr: str, limit: int = 6000) -> str:
    """A failed multi-process job's stderr for a test's message: every one-line error of ours
    (``rollpacker: ...``, each rank's), its first traceback (the cause; the other processes' reactions
    to it come after: a peer's lost connection, torchrun's summary) and its tail."""
    ours = "".join(f"{line}\n" for line in stderr.splitlines() if line.startswith("rollpacker: "))[-limit // 3:]
    first = stderr.find("Traceback (most recent call last)")
    if first < 0 or first >= len(stderr) - limit // 2:
        return f"{ours}[...]\n{stderr[-limit:]}"
    return f"{ours}[...]\n{stderr[first:first + limit // 2]}\n[...]\n{stderr[-limit // 2:]}"


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300) -> str:
    """Run ``tests/dist/scripts/<script>`` on ``nproc`` real gloo ranks; fail the test on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(DIST_SCRIPTS / script), *args]
    # the scripts import the tests' shared helpers (support.*) as the tests do: tests/ on the path
    env = job_env(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS),
                                                                            os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        pytest.fail(f"{script} on {nproc} ranks exited {proc.returncode}:\n{proc.stdout}\n{cause(proc.stderr)}")
    return proc.stdout


SGLANG_STUBS = Path(__file__).resolve().parent / "sglang_stubs"
"""Test-only stand-ins that SGLang's CPU path imports but never calls (docs/sglang.md)."""


def sglang_env(**extra: str) -> dict[str, str]:
    """The environment of an SGLang test's processes (and SGLang's own, which inherit it): the stubs
    and tests/ on PYTHONPATH, one thread per process, Triton's interpreter off (SGLang runs no
    Triton kernel on CPU)."""
    path = os.pathsep.join(filter(None, [str(SGLANG_STUBS), str(TESTS), os.environ.get("PYTHONPATH")]))
    env = job_env(OMP_NUM_THREADS="1", PYTHONPATH=path, **extra)
    env.pop("TRITON_INTERPRET", None)
    return env


def job_env(**extra: str) -> dict[str, str]:
    """This process's environment without the distributed variables that an in-process test's
    one-rank group set here (its MASTER_PORT is taken), plus ``extra``."""
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return {k: v for k, v in os.environ.items() if k not in dist_vars} | extra


def job_command(*args: str, nproc: int = 2, module: str = "rollpacker.run") -> list[str]:
    """``python -m module args`` on one rank, under ``torchrun --standalone`` on ``nproc`` > 1."""
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module,
            *args]


def launch_job(*args: str, nproc: int = 2, module: str = "rollpacker.run", timeout: float = 600,
               cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a real job (:func:`job_command`) to its end, in ``cwd``, in the process environment ``env``
    (None: :func:`job_env`); its output captured."""
    return subprocess.run(job_command(*args, nproc=nproc, module=module), capture_output=True, text=True,
                          timeout=timeout, env=env or job_env(), cwd=cwd)


FOUR_STEPS = ("schedule:tail", "--data.num-toy-prompts", "32", "--rollout.num-prompts", "4",
              "--rollout.group-size", "4", "--rollout.max-new-tokens", "96", "--num-steps", "4", "--eval-every", "0",
              *QUIET)
"""The small job of the stream and pipe run tests: 4 steps of 4 prompts x 4 responses."""


def run_four_steps(run_dir: Path, *args: str) -> list[dict]:
    """:data:`FOUR_STEPS` then ``args`` as a real 2-rank job in ``run_dir``, to its end; its metrics."""
    proc = launch_job(*FOUR_STEPS, "--run-dir", str(run_dir), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return records(run_dir)


def start_job(run_dir: Path, *args: str, nproc: int = 2) -> subprocess.Popen:
    """Start :data:`TWO_EPOCHS` then ``args`` as a real ``rollpacker.run`` job in ``run_dir``, in its
    own session (so that a test can kill it whole)."""
    cmd = job_command(*TWO_EPOCHS, "--run-dir", str(run_dir), *args, nproc=nproc)
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=job_env())


def finish(proc: subprocess.Popen) -> None:
    """Wait for a job from :func:`start_job`; fail the test with its stderr if it failed."""
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]


def records(run_dir: Path) -> list[dict]:
    """Every line of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps(run_dir: Path) -> dict[int, dict]:
    """The metrics of every step; a step redone after a resume keeps its last record."""
    return {r["step"]: r for r in records(run_dir)}


def ledger(run_dir: Path) -> dict:
    """The sample ledger in a run's newest checkpoint (which must be committed)."""
    newest = max((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    assert (newest / "COMMITTED").exists()
    return json.loads((newest / "train_state.json").read_text())["policy"]["ledger"]


def trained(run_dir: Path) -> dict[int, list[int]]:
    """Per epoch, the dataset rows the ledger says were trained, sorted."""
    per_epoch: dict[int, list[int]] = {}
    for epoch, row in ledger(run_dir)["trained"]:
        per_epoch.setdefault(epoch, []).append(row)
    return {e: sorted(rows) for e, rows in per_epoch.items()}


def per_group(lengths: list[int], group_size: int = 4) -> list[list[int]]:
    """A step's response lengths, sorted within each group."""
    return [sorted(lengths[i:i + group_size]) for i in range(0, len(lengths), group_size)]


def sandboxed_pids() -> set[int]:
    """Processes on this machine that live in another pid namespace than ours: sandboxes, less those of a test
    that another pytest-xdist worker runs beside this one (an orphaned sandbox, whose parent is gone, counts)."""
    own = os.stat("/proc/self/ns/pid").st_ino
    pids = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.stat(f"/proc/{entry.name}/ns/pid").st_ino != own and not _another_workers(int(entry.name)):
                    pids.add(int(entry.name))
            except OSError:
                pass  # exited meanwhile, or not ours to inspect
    return pids


def _another_workers(pid: int) -> bool:
    """Whether ``pid`` descends from another pytest-xdist worker than this one: a process of the chain of parents
    up from it is a sibling of this process (xdist's workers are its controller's children). False outside xdist."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return False
    ours, controller = os.getpid(), os.getppid()
    while pid > 1 and pid != ours:
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
        except (OSError, IndexError, ValueError):
            return False  # exited meanwhile, or not ours to inspect
        if parent == controller:
            return True
        pid = parent
    return False


def kill_when(proc: subprocess.Popen, run_dir: Path, ready, timeout: float = 300) -> bool:
    """SIGKILL the whole run as soon as ``ready()``; False if it ended first. Torchrun starts its
    ranks in sessions of their own, which a SIGKILLed torchrun cannot stop: killing its group alone
    leaves them training on into the run directory, beside the resumed run. So each rank's
    session (the rank and its reward workers) is killed too, right after torchrun's group."""
    from rollpacker.bench.faults import worker_pid

    deadline = time.time() + timeout
    ranks: list[int] = []
    while proc.poll() is None and time.time() < deadline:
        if len(ranks) < 2:
            ranks = [pid for pid in (worker_pid(run_dir, rank) for rank in (0, 1)) if pid]
        elif ready():
            for group in (proc.pid, *ranks):
                os.killpg(group, signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.002)
    proc.communicate()
    return False
