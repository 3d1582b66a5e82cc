"""The GPU check on CPU (issues 37 and 48): the prepared command of docs/gpu-check.md rehearsed as a GPU machine
would run it, every stage at toy size, so it cannot rot; then what must not be lost (a stop, a missing git, an
unwritable home) and what stage (c) must catch."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from support.jobs import job_env

from rollpacker.gpu_check import DEFAULT_STAGES
from rollpacker.gpu_check.stages import KERNEL_CONFIGS, compiled_result

ROOT = Path(__file__).resolve().parents[2]
TRITON_ON_THE_GPU_MACHINE = "3.6.0"
"""The lent GPU machine's Triton (beside its torch 2.11): the rehearsal's interpreter is that Triton's."""


def lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def rehearsal_venv(path: Path) -> Path:
    """A fresh virtual environment with torch, Triton and transformers and what they require, nothing else
    (what the GPU machine has); its python. This machine's torch and transformers, linked in rather than
    installed again (half a minute of unpacking), the GPU machine's Triton, and NumPy < 2.4, whose int() of a
    1-element array Triton 3.6's interpreter needs (CPU only)."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    python = path / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    pins = [f"triton=={TRITON_ON_THE_GPU_MACHINE}", "numpy<2.4"]
    # the venv's own setuptools is older than torch requires: this machine's is linked in with torch
    subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "setuptools"], check=True, timeout=300)
    link_installed(["torch", "transformers"], site, installed_there=["triton", "numpy"])
    proc = subprocess.run([python, "-m", "pip", "install", "-q", *pins], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"pip install {' '.join(pins)} into a fresh venv:\n{proc.stderr[-3000:]}"
    return python


def link_installed(names: list[str], site: Path, installed_there: list[str]) -> None:
    """Link this environment's distributions ``names`` and every distribution they require (without extras),
    but ``installed_there``, into the site-packages ``site``: their packages, modules and metadata."""
    seen, todo = {canonicalize_name(n) for n in installed_there}, list(names)
    while todo:
        if (name := canonicalize_name(todo.pop())) in seen:
            continue
        seen.add(name)
        dist = importlib.metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files} - {"..", "__pycache__"}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
        required = map(Requirement, dist.requires or [])
        todo += [r.name for r in required if r.marker is None or r.marker.evaluate({"extra": ""})]


def working_tree_copy(dest: Path) -> Path:
    """What a GPU machine gets: the tracked and the untracked, not ignored, files of this checkout, no ``.git``."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def rehearse(tmp_path: Path, *flags: str) -> tuple[list[dict], dict, Path]:
    """docs/gpu-check.md's command with ``--device cpu`` and ``flags``: .whl/ made by our script here, the working
    tree copied as a GPU machine gets it, a venv of torch, Triton and transformers only, results in $OUT. It
    exits 0 (every stage passed); its stage lines, its summary and $OUT."""
    python = rehearsal_venv(tmp_path / "venv")
    tree, out, home = working_tree_copy(tmp_path / "tree"), tmp_path / "out", tmp_path / "home"
    wheels = subprocess.run(["bash", "launch/gpu_check_wheels.sh", str(tree / ".whl")], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert wheels.returncode == 0, wheels.stderr[-2000:]
    home.mkdir()
    env = {"PATH": f"{python.parent}{os.pathsep}{os.environ['PATH']}", "OUT": str(out), "HOME": str(home),
           "LANG": "C.UTF-8", "TMPDIR": str(tmp_path)}
    proc = subprocess.run(["bash", "launch/gpu_check.sh", "--device", "cpu", *flags], cwd=tree, capture_output=True,
                          text=True, timeout=3600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    preflight, *stages, summary = lines(proc.stdout)
    assert (out / "results.jsonl").read_text().splitlines() == proc.stdout.splitlines()
    assert preflight["gpu_check"] == "preflight" and preflight["ok"] and preflight["says"].startswith("nothing missing")
    assert all(s["ok"] and s["seconds"] <= s["limit_s"] for s in stages), stages
    return stages, summary, out


def test_the_prepared_command_rehearsed_on_cpu_in_a_fresh_venv(tmp_path):
    """The prepared command: every stage but (h) passes and $OUT holds only the small files a GPU run returns."""
    stages, summary, out = rehearse(tmp_path)
    assert [s["stage"] for s in stages] == DEFAULT_STAGES and [s["letter"] for s in stages] == list("abcdefg")
    assert summary["gpu_check"] == "summary" and summary["ok"] and summary["device"] == "cpu"
    assert summary["triton"] == TRITON_ON_THE_GPU_MACHINE and summary["torch"] == torch.__version__
    assert summary["transformers"] == transformers.__version__
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    assert summary["commit"] == f"{commit} (.whl/COMMIT)"  # the copy has no git
    by = {s["stage"]: s for s in stages}
    assert by["toy"]["trained_steps"] == [0, 1, 2, 3] and "config.json" in by["toy"]["hf_export"]  # resumed at 2
    assert by["toy"]["resumed"]  # steps 0 and 1 as the first run wrote them: not trained again
    assert by["train"]["push"]["within_bar"] and by["train"]["push"]["max_dlogprob"] < 1e-3  # fp32 on CPU
    assert by["offload"]["full_tensor_device"] == "cpu" and set(by["offload"]["cpu_collectives"].values()) == {None}
    assert by["kernel"]["max_abs_diff"]["logprob"] < 1e-5 and by["kernel"]["kernel_T128"]["timed_calls"] >= 1
    assert all(by["kernel"][f"max_abs_diff_{c}"]["logprob"] < 1e-5 for c in ("32x64x32_w8", "ieee"))
    compiled = by["kernel"]["compiled"]["sm_90"]  # by the GPU machine's Triton and its ptxas, for the H200
    assert sorted(compiled) == sorted(KERNEL_CONFIGS), compiled
    for config in compiled.values():
        assert sorted(config) == ["forward", "grad_hidden", "grad_weight"]
        assert all(0 < k["registers"] <= 255 and 0 < k["shared_bytes"] <= 227 * 1024 for k in config.values())
    for config in ("kernel", "kernel_32x64x32_w8"):  # KERNEL_CONFIGS's claim: TF32 tiles that fit in registers
        assert all(k["local_bytes"] == 0 for k in compiled[config].values()), compiled[config]
    assert by["engine"]["fp32"]["not_greedy"] == 0 and by["engine"]["preemptions"] > 0
    assert by["engine"]["workspace"]["within_plan"] and by["engine"]["preempted_tokens_differ"] == 0
    assert by["spec"]["draft_lens"][0] == 0 and by["judge"]["bit_equal"]
    returned = sorted(p.name for p in out.iterdir())
    assert returned == sorted(["results.jsonl", "toy_metrics.jsonl", *(f"{name}.log" for name in DEFAULT_STAGES)])
    assert sum(p.stat().st_size for p in out.iterdir()) < 1 << 20  # no model, no checkpoint
    assert not list(tmp_path.glob("rollpacker-gpu-check-*/random_model"))  # the work folder went away


@pytest.mark.slow
def test_issue_47s_measurement_rehearsed_in_the_same_bare_environment(tmp_path):
    """Stage (h), the second command of docs/gpu-check.md: bench episodes' runs (toy job, environment workers,
    the workload) need nothing the GPU machine lacks; each trains every prompt once and reports its speedup."""
    (stage,), summary, out = rehearse(tmp_path, "--stages", "episodes")
    assert stage["stage"] == "episodes" and stage["letter"] == "h" and summary["ok"]
    for policy in ("sync", "tail", "tail+warm"):
        assert stage[policy]["prompts"] == 8 and stage[policy]["lost"] == stage[policy]["twice"] == 0
    assert stage["rollout_speedup_tail"] > 0 and stage["step_speedup_tail_warm"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["episodes.log", "results.jsonl"]


def test_an_unknown_stage_is_refused_naming_the_stages():
    proc = subprocess.run([sys.executable, "-m", "rollpacker.gpu_check", "--device", "cpu", "--stages", "nope"],
                          capture_output=True, text=True, timeout=120, env=job_env())
    assert proc.returncode == 2 and "invalid choice: 'nope' (choose from 'toy', 'train', 'offload'" in proc.stderr


def processes_naming(text: str) -> dict[int, str]:
    """Live processes whose command line contains ``text``: pid -> command line."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # not a process, or gone meanwhile
            continue
        if proc.name.isdigit() and text in cmdline:
            found[int(proc.name)] = cmdline
    return found


def test_a_stopped_check_kills_the_running_stage_whole_and_still_writes_its_summary(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    driver = subprocess.Popen([sys.executable, "-m", "rollpacker.gpu_check", "--device", "cpu", "--out", str(out),
                               "--work", str(work), "--stages", "toy", "judge"], stdout=subprocess.PIPE, text=True,
                              env=job_env())
    deadline = time.monotonic() + 240
    while "building the job" not in ((out / "toy.log").read_text() if (out / "toy.log").exists() else ""):
        assert time.monotonic() < deadline and driver.poll() is None, "the toy job never started"
        time.sleep(0.5)
    assert any("rollpacker.run" in cmdline for cmdline in processes_naming(str(work)).values())
    driver.send_signal(signal.SIGTERM)
    stdout, _ = driver.communicate(timeout=60)
    preflight, toy, summary = lines(stdout)
    assert toy["stage"] == "toy" and toy["ok"] is False and toy["stopped"] == "SIGTERM"
    assert summary["gpu_check"] == "summary" and summary["ok"] is False and summary["failed"] == ["toy"]
    assert summary["not_run"] == ["judge"] and summary["torch"] == torch.__version__
    assert (out / "results.jsonl").read_text().splitlines() == stdout.splitlines()
    assert processes_naming(str(work)) == {}  # the stage and the toy job it ran


def test_the_summary_survives_an_unwritable_home_and_no_git(tmp_path):
    """HOME a file (nothing can be made in it, even as root) and a PATH without git: the caches move into the
    work folder, the stage passes, and the summary is written."""
    env = job_env(HOME="/dev/null", PATH=str(Path(sys.executable).parent), PYTHONPATH=str(ROOT))
    for name in ("TRITON_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-m", "rollpacker.gpu_check", "--device", "cpu", "--out", str(tmp_path),
                           "--stages", "judge"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    preflight, judge, summary = lines(proc.stdout)
    assert preflight["home_writable"] is False and "TRITON_CACHE_DIR" in preflight["env"]
    assert judge["ok"] and summary["ok"] and summary["torch"] == torch.__version__
    assert summary["commit"] is None or summary["commit"].endswith("(.whl/COMMIT)")


def test_the_offload_stage_fails_on_a_group_without_a_cpu_backend(tmp_path):
    """Stage (c) on a one-rank group whose only backend serves CUDA tensors (``cuda:gloo``, as an NCCL-only
    group serves nothing on the host): its CPU collectives name the missing backend and it fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import sys, torch.distributed as dist\n"
              f"dist.init_process_group('cuda:gloo', init_method='tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
              "from rollpacker.gpu_check.stages import main\n"
              "main(sys.argv[1:])\n")
    proc = subprocess.run([sys.executable, "-c", script, "offload", "--device", "cpu", "--out", str(tmp_path),
                           "--work", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env=job_env(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1"))
    result = json.loads(proc.stdout.splitlines()[-1].removeprefix("GPU_CHECK_RESULT "))
    assert proc.returncode == 1 and result["ok"] is False, proc.stdout + proc.stderr[-2000:]
    assert set(result["cpu_collectives"]) == {"world", "train.replicate", "train.shard"}
    assert all("No backend type associated with device type cpu" in e for e in result["cpu_collectives"].values())


def test_the_trainer_stage_runs_with_the_torch_head_where_triton_cannot_compile(tmp_path):
    """What the preflight chooses on a GPU machine without a C compiler or Python.h: (b) with the torch head."""
    proc = subprocess.run([sys.executable, "-m", "rollpacker.gpu_check.stages", "train", "--device", "cpu", "--out",
                           str(tmp_path), "--work", str(tmp_path), "--logprobs-impl", "torch"], capture_output=True,
                          text=True, timeout=600, env=job_env(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1"))
    result = json.loads(proc.stdout.splitlines()[-1].removeprefix("GPU_CHECK_RESULT "))
    assert proc.returncode == 0 and result["ok"], proc.stdout + proc.stderr[-2000:]
    assert [k for k in result if k.startswith("ac=")] == ["ac=none,head=torch", "ac=full,head=torch"]
    assert result["push"]["within_bar"]


def test_the_kernel_stage_reports_a_compile_that_fails_or_overruns():
    """Stage (d)'s ahead-of-time compile: a failure's message becomes the stage's ``error``; a compile still
    running at the deadline is killed and reported skipped."""
    def start(code: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    assert compiled_result(start("import sys; sys.exit('ptxas failed')"), 60) == {"error": "ptxas failed"}
    slow = start("import time; time.sleep(60)")
    assert compiled_result(slow, 0.5) == {"skipped": "not compiled before the stage's deadline"}
    assert slow.returncode is not None
