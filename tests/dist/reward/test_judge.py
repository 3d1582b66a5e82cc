"""launch/mps.sh, the CUDA MPS wrapper of a colocated judge: off by default, and the daemon started and
stopped around the command (a stand-in daemon; the real one needs a GPU). The judge itself:
tests/unit/reward/test_judge.py."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

MPS_SH = Path(__file__).parents[3] / "launch" / "mps.sh"


def run_mps(tmp_path: Path, *cmd: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path), **env}
    return subprocess.run(["bash", str(MPS_SH), *cmd], env=full_env, capture_output=True, text=True, timeout=30)


def stand_in_daemon(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in ``nvidia-cuda-mps-control`` that logs how it is called (the real one needs a GPU): its
    directory, for PATH, and its log."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = -d ]; then echo "start $CUDA_MPS_PIPE_DIRECTORY" >> {log}; '
                    f'else read cmd; echo "$cmd" >> {log}; fi\n')
    fake.chmod(0o755)
    return bin_dir, log


def test_mps_off_by_default_and_without_the_daemon(tmp_path):
    off = run_mps(tmp_path, "sh", "-c", "echo ran; exit 3")
    assert (off.returncode, off.stdout, off.stderr) == (3, "ran\n", "")
    missing = run_mps(tmp_path, "sh", "-c", "echo ran", ROLLPACKER_MPS="1", PATH="/usr/bin:/bin")
    assert missing.returncode == 0 and missing.stdout == "ran\n"
    assert "nvidia-cuda-mps-control not found; running without MPS" in missing.stderr


def test_mps_starts_and_stops_the_daemon(tmp_path):
    bin_dir, log = stand_in_daemon(tmp_path)
    result = run_mps(tmp_path, "sh", "-c", 'echo "$CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY"; exit 5',
                     ROLLPACKER_MPS="1", PATH=f"{bin_dir}:/usr/bin:/bin", SLURM_JOB_ID="42")
    assert result.returncode == 5, result.stderr
    pipe, logs = result.stdout.split()
    assert pipe.startswith(str(tmp_path)) and "42" in pipe and logs.startswith(str(tmp_path))
    assert log.read_text().splitlines() == [f"start {pipe}", "quit"]
    assert not Path(pipe).exists()  # the job-local directory is removed with the daemon


def test_slurms_time_limit_warning_lets_the_command_save_and_stops_the_daemon(tmp_path):
    """srun passes SIGUSR1 to every process of the step, mps.sh's shell too: it waits while the command saves,
    then stops the daemon (the signal killed the shell: the daemon stayed, and the step ended under the ranks)."""
    bin_dir, log = stand_in_daemon(tmp_path)
    command = 'trap "echo saved; exit 0" USR1; echo ready; while :; do sleep 0.05; done'
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "TMPDIR": str(tmp_path), "ROLLPACKER_MPS": "1"}
    proc = subprocess.Popen(["bash", str(MPS_SH), "sh", "-c", command], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # a step of its own, as srun's
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGUSR1)
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == "saved\n"
    assert log.read_text().splitlines()[-1] == "quit"
