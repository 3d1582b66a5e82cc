"""The GPU check's preflight: what a first run on a bare machine needs, found in a second and said in one line.

Contract: :func:`preflight` returns the facts, what is missing (each with its fix), the stages that cannot run
and why, the trainer's log-prob head, and the environment the stages get. It never raises for a missing
thing: the driver runs what still can.

Why these checks: Triton compiles its launchers with a C compiler and ``Python.h`` on first use and looks for
``libcuda.so.1`` through ``ldconfig``; a runtime-only image lacks them. Without them the trainer stages use the
torch head and the kernel stage is skipped. Caches move into the work folder when the home folder is not
writable (Triton's cache would fail on first compile).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollpacker.gpu_check import DEFAULT_STAGES, STAGES

MIN_FREE_GB = 2.0
"""Free disk the work folder needs: the toy job's checkpoints and export, stage (e)'s 0.4 GB random model."""


@dataclass
class Preflight:
    facts: dict[str, Any]
    """What was found: the GPU, driver, compiler, ``Python.h``, free disk, cache folders."""
    missing: list[str] = field(default_factory=list)
    """One phrase each: what is missing and its fix."""
    skip: dict[str, str] = field(default_factory=dict)
    """Stage name -> why it cannot run here."""
    logprobs_impl: str = "triton"
    """The trainer stages' head: ``torch`` where Triton cannot run."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the stages get (cache folders, Triton's libcuda path)."""

    def row(self, stages: list[str] = DEFAULT_STAGES) -> dict[str, Any]:
        """The preflight's line, for a check of ``stages``."""
        runs, skips = [s for s in stages if s not in self.skip], [s for s in stages if s in self.skip]
        head = "" if self.logprobs_impl == "triton" else f" (trainer stages with the {self.logprobs_impl} head)"
        says = (f"missing: {'; '.join(self.missing)}. " if self.missing else "nothing missing. ") + (
            f"Runs {', '.join(runs) or 'nothing'}{head}" + (f"; skips {', '.join(skips)}" if skips else ""))
        return {"gpu_check": "preflight", "ok": not self.missing, "says": says, "missing": self.missing,
                "skip": self.skip, "logprobs_impl": self.logprobs_impl, "env": self.env, **self.facts}


def c_compiler() -> str | None:
    """The compiler Triton would use (``CC``, else gcc, else clang), or None: also where ``CC`` names one that is
    not there (Triton takes ``CC`` as given, and every compile would fail)."""
    if cc := os.environ.get("CC", "").strip():
        return shutil.which(shlex.split(cc)[0])
    return shutil.which("gcc") or shutil.which("clang")


def python_header() -> Path:
    """Where Triton looks for ``Python.h`` (Debian's ``posix_local`` scheme read as ``posix_prefix``)."""
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    return Path(sysconfig.get_paths(scheme=scheme)["include"]) / "Python.h"


def writable(path: Path) -> bool:
    """Whether a file can be created in ``path`` (made if absent)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def free_gb(path: Path) -> float:
    return round(shutil.disk_usage(path).free / 1e9, 1)


def triton_cache_dir() -> Path:
    """Triton's cache folder: ``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache`` (home by default)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    return Path(os.environ.get("TRITON_HOME") or os.path.expanduser("~")) / ".triton" / "cache"


def libcuda_listed() -> bool:
    """Whether Triton finds ``libcuda.so.1`` by itself (``TRITON_LIBCUDA_PATH``, ``ldconfig -p``,
    ``LD_LIBRARY_PATH``)."""
    if os.environ.get("TRITON_LIBCUDA_PATH"):
        return True
    try:
        listed = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False  # Triton calls /sbin/ldconfig itself: it would fail too
    return "libcuda.so.1" in listed or any(
        (Path(d) / "libcuda.so.1").exists() for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d)


def loaded_libcuda_dir(maps: str | None = None) -> str | None:
    """The folder of the ``libcuda.so.1`` this process loaded (after CUDA's init), from ``/proc/self/maps``
    (``maps``), which names the file the link points to (``libcuda.so.550.54.15``)."""
    try:
        maps = Path("/proc/self/maps").read_text() if maps is None else maps
    except OSError:
        return None
    found = [line.split()[-1] for line in maps.splitlines()
             if len(line.split()) >= 6 and os.path.basename(line.split()[-1]).startswith("libcuda.so")]
    return os.path.dirname(found[0]) if found else None


def gpu_facts() -> dict[str, Any]:
    """The CUDA device, the driver and the ``libcuda.so.1`` loaded; ``missing`` says what lacks. Initializes
    CUDA: run it in a process of its own (:func:`probe_gpu`), never in the driver, which would hold a context
    on the GPU through every stage."""
    import torch

    facts: dict[str, Any] = {"torch_cuda": torch.version.cuda}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        facts["driver"] = smi.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        facts["driver"] = None
    if not torch.cuda.is_available():
        return facts | {"missing": f"a CUDA device (torch {torch.__version__} sees none; check the driver, "
                                   f"{facts['driver'] or 'nvidia-smi not found'}, against CUDA {torch.version.cuda})"}
    props = torch.cuda.get_device_properties(0)
    return facts | {"gpu": props.name, "capability": f"{props.major}.{props.minor}",
                    "gpu_memory_gb": round(props.total_memory / 1e9, 1), "libcuda_dir": loaded_libcuda_dir()}


def probe_gpu(env: dict[str, str]) -> dict[str, Any]:
    """:func:`gpu_facts` from a process of its own, in environment ``env``."""
    cmd = [sys.executable, "-m", "rollpacker.gpu_check.preflight"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    except subprocess.SubprocessError as e:
        return {"missing": f"an answer from the GPU probe ({' '.join(cmd[1:])}: {e!r})"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):  # it died first: what it said is the cause
        said = proc.stderr.strip()[-600:] or "nothing on stderr"
        return {"missing": f"an answer from the GPU probe ({' '.join(cmd[1:])} exited {proc.returncode}: {said})"}


def triton_facts(device: str, facts: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """(what Triton lacks to compile on ``device``, the env that fixes what can be fixed here)."""
    try:
        import triton
    except ImportError:
        return ["Triton (pip install triton: the one torch requires)"], {}
    facts["triton"] = triton.__version__
    facts["c_compiler"], facts["python_h"] = c_compiler(), str(python_header())
    if device != "cuda":
        return [], {}  # the interpreter compiles nothing
    lacks, env = [], {}
    if not facts["c_compiler"]:
        cc = os.environ.get("CC", "").strip()
        lacks.append(f"the C compiler CC={cc} names (fix or unset CC)" if cc else
                     "a C compiler for Triton's launchers (apt-get install gcc, or set CC)")
    if not python_header().exists():
        lacks.append(f"Python.h at {facts['python_h']} (apt-get install python3-dev)")
    if not libcuda_listed():
        if facts.get("libcuda_dir"):
            env["TRITON_LIBCUDA_PATH"] = facts["libcuda_dir"]
        else:
            lacks.append("libcuda.so.1 where Triton looks (set TRITON_LIBCUDA_PATH to its folder)")
    return lacks, env


def cache_env(work: Path, facts: dict[str, Any]) -> dict[str, str]:
    """Cache folders under ``work`` when the home folder or Triton's cache is not writable."""
    home, cache = Path(os.path.expanduser("~")), triton_cache_dir()
    facts["home_writable"], facts["triton_cache"] = writable(home), str(cache)
    env = {}
    if not facts["home_writable"]:
        env |= {"XDG_CACHE_HOME": str(work / "cache"), "HF_HOME": str(work / "cache" / "huggingface"),
                "MPLCONFIGDIR": str(work / "cache" / "matplotlib")}
    if not writable(cache):
        env["TRITON_CACHE_DIR"] = str(work / "triton-cache")
        facts["triton_cache"] = env["TRITON_CACHE_DIR"]
    return env


def preflight(device: str, out: Path, work: Path, env: dict[str, str]) -> Preflight:
    """Check what the stages need on ``device``, results going to ``out``, scratch to ``work``, the
    stages' environment ``env``."""
    facts: dict[str, Any] = {"device": device, "out_free_gb": free_gb(out), "work": str(work),
                             "work_free_gb": free_gb(work)}
    check = Preflight(facts)
    if device == "cuda":
        facts |= probe_gpu(env)
        if "missing" in facts:
            check.missing.append(facts.pop("missing"))
            check.skip = {name: "no CUDA device" for name in STAGES}
            return check
    lacks, check.env = triton_facts(device, facts)
    if lacks:
        check.missing += lacks
        check.logprobs_impl = "torch"
        check.skip |= {n: "Triton cannot run here" for n, s in STAGES.items() if s.needs_triton}
    check.env |= cache_env(work, facts)
    if facts["work_free_gb"] < MIN_FREE_GB:
        check.missing.append(f"{MIN_FREE_GB} GB free in the work folder {work} (--work elsewhere)")
        check.skip |= {n: f"{facts['work_free_gb']} GB free in {work}" for n, s in STAGES.items() if s.writes_models}
    return check


if __name__ == "__main__":
    print(json.dumps(gpu_facts()))
