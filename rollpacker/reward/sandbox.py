"""The code sandbox: run an untrusted Python program on one test input, isolated by the OS.

Isolation comes in layers: fresh namespaces (bubblewrap, else ``unshare`` and
:mod:`rollpacker.reward.sandbox_init`), rlimits, and killing the sandbox's pid 1 at the deadline.

Invariants:

- No network, a read-only root, a private ``/tmp``, an empty environment. A trainer running as
  root runs the sandbox as ``nobody``.
- In the namespace modes the program is never pid 1, and a call returns only after pid 1 is gone:
  nothing the program started survives it.
- The verdict is the program's stdout against the expected output, never its exit code.
- Without isolation, :class:`Sandbox` refuses to start and says how to enable it.
  ``isolation = "none"`` is an explicit opt-out: rlimits only.

Why layers: each one alone would not do. What each layer holds: ``docs/rewards-and-judge.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rollpacker.choices import check_choices
from rollpacker.errors import UserError

logger = logging.getLogger(__name__)

Isolation = Literal["auto", "bwrap", "unshare", "none"]
VERDICTS = ("PASS", "WRONG", "TIMEOUT", "MEMORY", "OUTPUT_LIMIT", "RUNTIME_ERROR", "SANDBOX_ERROR")
NOBODY = 65534
MASKED = ("/root", "/home", "/run")
"""Hidden behind an empty read-only tmpfs: home directories (tokens, keys) and runtime sockets."""
SCRATCH = ("/tmp", "/dev/shm")
"""A fresh size-capped tmpfs each, the program's to write; /tmp is its working directory."""
STDERR_TAIL = 4096
EXIT_DRAIN = 0.5
"""Seconds the output is read on after the program exits (it is in the pipes already; only a child left holding
them writes more, and is killed with the rest)."""
INIT_SOURCE = (Path(__file__).parent / "sandbox_init.py").read_text()


@dataclass(kw_only=True)
class SandboxConfig:
    isolation: Isolation = "auto"
    """OS isolation of code rewards and the python tool: auto (bwrap, else unshare), bwrap, unshare, none (only for
    code you trust)."""
    python: str = ""
    """Interpreter of the programs (a path, or a name on PATH); empty = this one, or /usr/bin/python3 if the sandbox
    user cannot run it."""
    memory_mb: int = 1024
    """Address-space limit of a program (RLIMIT_AS), in MiB."""
    max_output_mb: float = 8.0
    """Stdout read from a program before it is killed with OUTPUT_LIMIT, in MiB."""
    file_size_mb: int = 16
    """Largest file a program may write (RLIMIT_FSIZE), in MiB."""
    tmpfs_mb: int = 64
    """Size of the program's /tmp working directory and of /dev/shm, in MiB."""
    num_files: int = 64
    """Open files per process (RLIMIT_NOFILE)."""
    num_procs: int = 64
    """Processes and threads in the sandbox (RLIMIT_NPROC)."""

    def __post_init__(self) -> None:
        check_choices(self, "reward.sandbox")
        for name in ("memory_mb", "max_output_mb", "file_size_mb", "tmpfs_mb", "num_files", "num_procs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"reward.sandbox.{name} must be positive, got {getattr(self, name)}")


class SandboxUnavailable(UserError, RuntimeError):
    """No OS isolation works on this machine; the message says how to enable it."""


@dataclass
class Run:
    """What one execution of a program did."""

    stdout: bytes
    stderr: bytes
    """The last few KiB of stderr."""
    exit_code: int | None
    """The program's exit code (128 + N when signal N killed it); None when it was killed."""
    seconds: float
    """Wall time from start to exit (or kill), sandbox setup included."""
    cpu_seconds: float
    """User + system CPU of the sandbox's processes; a killed run counts its wall time (the kernel does not say)."""
    started: bool
    """The program was exec'd; False means the sandbox failed to start."""
    timed_out: bool = False
    output_limited: bool = False


@dataclass
class CaseResult:
    verdict: str
    """One of :data:`VERDICTS`."""
    seconds: float
    detail: str = ""
    """Why, for a human: the end of stderr for a failure."""


def same_output(stdout: bytes, expected: str) -> bool:
    """Whether ``stdout`` is ``expected``, ignoring trailing whitespace on lines and at the end."""
    return _lines(stdout.decode("utf-8", "replace")) == _lines(expected)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def verdict(run: Run, expected: str) -> str:
    """The harness's verdict on one run: output first, the exit code only names the failure."""
    if not run.started:
        return "SANDBOX_ERROR"
    if run.output_limited:
        return "OUTPUT_LIMIT"
    if run.timed_out or run.exit_code == 128 + signal.SIGXCPU:
        return "TIMEOUT"
    if same_output(run.stdout, expected):
        return "PASS"
    if b"MemoryError" in run.stderr or b"Cannot allocate memory" in run.stderr:
        return "MEMORY"
    return "WRONG" if run.exit_code == 0 else "RUNTIME_ERROR"


class Sandbox:
    """Runs programs under the configured isolation; raises :class:`SandboxUnavailable` if there is none.

    Checking the isolation runs a tiny program (once per process and configuration).
    """

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self.isolation, self.python = _resolve(self.cfg)

    def check(self, program: str, test: dict, timeout: float) -> CaseResult:
        """Run ``program`` on ``test["input"]`` and judge its stdout against ``test["output"]``."""
        run = self.run(program, test.get("input") or "", timeout)
        result = CaseResult(verdict(run, test["output"]), run.seconds)
        if result.verdict != "PASS":
            result.detail = run.stderr.decode("utf-8", "replace")[-500:]
        return result

    def run(self, program: str, stdin: str = "", timeout: float = 2.0) -> Run:
        """Run ``program`` (Python source) on ``stdin`` for at most ``timeout`` wall-clock seconds."""
        return _run(self.isolation, self.python, self.cfg, program, stdin, timeout)


_RESOLVED: dict[tuple, tuple[str, str]] = {}


def _resolve(cfg: SandboxConfig) -> tuple[str, str]:
    """The (isolation, interpreter) to use: the first candidates under which ``print(6 * 7)`` works."""
    key = (cfg.isolation, cfg.python)
    if key in _RESOLVED:
        return _RESOLVED[key]
    isolations = ("bwrap", "unshare") if cfg.isolation == "auto" else (cfg.isolation,)
    found = shutil.which(cfg.python) if cfg.python else None
    if cfg.python and not found:
        raise SandboxUnavailable(f"code sandbox: reward.sandbox.python={cfg.python!r} is no executable here: give "
                                 f"the path of a Python 3 interpreter (this one is {sys.executable})")
    pythons = (os.path.abspath(found),) if found else (sys.executable, "/usr/bin/python3")
    failures, started = [], False
    for isolation in isolations:
        for python in dict.fromkeys(pythons):
            if not os.path.exists(python):
                continue
            try:
                run = _run(isolation, python, cfg, "print(6 * 7)", "", timeout=30)
            except OSError as e:  # the tool itself is missing or cannot start
                failures.append(f"{isolation} with {python}: {e}")
                continue
            if run.stdout.strip() == b"42":
                if python != pythons[0]:
                    who = f" as uid {NOBODY} (the sandbox's user when the trainer is root)" if os.geteuid() == 0 else ""
                    logger.warning("code sandbox: %s cannot run %s%s; using %s (set reward.sandbox.python to choose)",
                                   isolation, pythons[0], who, python)
                if isolation == "none":
                    logger.warning("code sandbox: isolation is off (reward.sandbox.isolation=none): untrusted code "
                                   "runs on this machine with rlimits only")
                _RESOLVED[key] = isolation, python
                return _RESOLVED[key]
            failures.append(f"{isolation} with {python}: {run.stderr.decode('utf-8', 'replace').strip()[-300:]}")
            started = started or run.started
    limits = (f"\nThe interpreter started and died: the sandbox's limits may not leave it room to start "
              f"(reward.sandbox.memory_mb={cfg.memory_mb}, num_files={cfg.num_files}, num_procs={cfg.num_procs}): "
              "raise them, or else" if started else "\nTo enable it:")
    raise SandboxUnavailable(
        "code sandbox: no OS isolation works here, so untrusted code will not run.\n  "
        + "\n  ".join(failures or [f"{cfg.isolation}: not found"])
        + f"{limits} install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) and allow "
        "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 also "
        "kernel.apparmor_restrict_unprivileged_userns=0); set reward.sandbox.python if the interpreter is the "
        "problem. Only for code you trust: --reward.sandbox.isolation none."
    )


def _interpreter_dirs(python: str) -> list[str]:
    """The directories the interpreter needs that a mask would hide: its install and its venv."""
    dirs = {os.path.dirname(os.path.dirname(p)) for p in (os.path.abspath(python), os.path.realpath(python))}
    return sorted(d for d in dirs if any(d.startswith(m + "/") for m in MASKED + SCRATCH))


def _rlimits(cfg: SandboxConfig, timeout: float) -> dict[str, tuple[int, int]]:
    cpu = math.ceil(timeout) + 1
    mib = 1 << 20
    limits = {"RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_AS": (cfg.memory_mb * mib,) * 2,
              "RLIMIT_FSIZE": (cfg.file_size_mb * mib,) * 2, "RLIMIT_NOFILE": (cfg.num_files,) * 2,
              "RLIMIT_CORE": (0, 0), "RLIMIT_NPROC": (cfg.num_procs,) * 2}
    return {name: tuple(int(v) for v in pair) for name, pair in limits.items()}


def _command(isolation: str, python: str, cfg: SandboxConfig, init: dict) -> list[str]:
    """The outer command line; ``init`` is the config handed to ``sandbox_init`` (completed here)."""
    tmpfs = str(cfg.tmpfs_mb << 20)
    masked = [d for d in MASKED if os.path.isdir(d) and not os.path.islink(d)]
    keep = _interpreter_dirs(python)
    launcher = [python, "-I", "-S", "-c", INIT_SOURCE]
    if isolation == "bwrap":
        init.update(mode="bwrap", workdir="/tmp")
        argv = [_tool("bwrap"), "--unshare-all", "--unshare-user", "--die-with-parent", "--as-pid-1", "--clearenv",
                "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev"]
        argv += [a for d in masked for a in ("--tmpfs", d)]
        argv += [a for d in SCRATCH for a in ("--size", tmpfs, "--tmpfs", d)]
        argv += [a for d in keep for a in ("--ro-bind", d, d)]
        argv += [a for d in masked for a in ("--remount-ro", d)]
        argv += ["--chdir", "/tmp", "--info-fd", str(init["info_fd"])]
        return [*argv, "--", *launcher, json.dumps(init)]
    if isolation == "unshare":
        init.update(mode="unshare", workdir="/tmp", masked=masked, scratch=[d for d in SCRATCH if os.path.isdir(d)],
                    keep=keep, tmpfs_bytes=int(tmpfs))
        return [_tool("setpriv"), "--pdeathsig", "KILL", "--", _tool("unshare"), "--user", "--map-root-user",
                "--net", "--pid", "--fork", "--mount", "--ipc", "--uts", "--kill-child=SIGKILL", "--",
                *launcher, json.dumps(init)]
    init.update(mode="none", parent=os.getpid())
    return [*launcher, json.dumps(init)]


def _tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise FileNotFoundError(f"{name} is not installed")
    return path


@contextlib.contextmanager
def _memfd(data: bytes):
    """A file descriptor holding ``data``, read from the start (for stdin and the program)."""
    fd = os.memfd_create("sandbox", 0)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        os.lseek(fd, 0, os.SEEK_SET)
        yield fd
    finally:
        os.close(fd)


def _run(isolation: str, python: str, cfg: SandboxConfig, program: str, stdin: str, timeout: float) -> Run:
    with contextlib.ExitStack() as stack:
        program_fd = stack.enter_context(_memfd(program.encode("utf-8", "surrogateescape")))
        stdin_fd = stack.enter_context(_memfd(stdin.encode("utf-8", "surrogateescape")))
        ready_r, ready_w = os.pipe()
        info_r, info_w = os.pipe()
        stack.callback(os.close, ready_r)
        stack.callback(os.close, info_r)
        workdir = None
        if isolation == "none":
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rollpacker-sandbox-"))
            if os.geteuid() == 0:
                os.chown(workdir, NOBODY, NOBODY)
        init = {"python": python, "program_fd": program_fd, "ready_fd": ready_w, "info_fd": info_w,
                "workdir": workdir, "rlimits": _rlimits(cfg, timeout)}
        try:
            argv = _command(isolation, python, cfg, init)
            as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
            start = time.monotonic()
            proc = subprocess.Popen(argv, stdin=stdin_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                    pass_fds=(program_fd, ready_w, info_w), start_new_session=True, **as_nobody)
        finally:
            os.close(ready_w)
            os.close(info_w)
        return _supervise(proc, start, start + timeout, int(cfg.max_output_mb * (1 << 20)), ready_r, info_r)


def _supervise(proc: subprocess.Popen, start: float, deadline: float, max_output: int, ready_r: int,
               info_r: int) -> Run:
    """Read the output until the program exits, the deadline passes or the output cap is hit; then kill it all.

    The killing is in a ``finally``: an exception here (a worker told to stop) still ends the sandbox.
    """
    out, err, info = bytearray(), b"", b""
    exited = timed_out = output_limited = False
    exit_fd = os.pidfd_open(proc.pid)
    init_fd = None  # pidfd of the sandbox's pid 1: once it is gone, so is every process in the sandbox
    try:
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            sel.register(info_r, selectors.EVENT_READ, "info")
            sel.register(exit_fd, selectors.EVENT_READ, "exit")
            while len(sel.get_map()) > 0 and not output_limited:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = not exited
                    break
                for key, _ in sel.select(remaining):
                    if key.data == "exit":  # the pipes are read EXIT_DRAIN more at most: a child the program left
                        exited = True  # (isolation none: no pid 1 takes it down) may hold them open
                        sel.unregister(exit_fd)
                        deadline = min(deadline, time.monotonic() + EXIT_DRAIN)
                        continue
                    data = os.read(key.fd, 1 << 16)
                    if not data:
                        sel.unregister(key.fd)
                    elif key.data == "out":
                        out += data
                        output_limited = len(out) > max_output
                    elif key.data == "err":
                        err = (err + data)[-STDERR_TAIL:]
                    else:
                        info += data
                        init_fd = init_fd if init_fd is not None else _open_init(info)
        seconds = time.monotonic() - start
    finally:
        try:  # a RETIRE landing here still kills the sandbox
            if init_fd is None and not exited:
                init_fd = _open_init(info + _read_now(info_r))  # not reported yet, or the program cannot have run
        finally:
            status, usage = _kill(proc, exit_fd, init_fd)
    killed = timed_out or output_limited or not exited
    code = None if killed else (os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
    return Run(stdout=bytes(out), stderr=err, exit_code=code, seconds=seconds,
               cpu_seconds=seconds if killed else usage.ru_utime + usage.ru_stime, started=_read_now(ready_r) == b"1",
               timed_out=timed_out, output_limited=output_limited)


def _kill(proc: subprocess.Popen, exit_fd: int, init_fd: int | None):
    """SIGKILL pid 1 (which ends the pid namespace), then the outer process group; reap. Returns (status, rusage)."""
    if init_fd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(init_fd, signal.SIGKILL)  # pid 1, checked by its pid namespace: ends it all
        _wait_readable(init_fd, 10, "pid 1 of a sandbox did not exit 10 s after SIGKILL")
        os.close(init_fd)
        _wait_readable(exit_fd, 5, "")  # the outer process reaps pid 1, then exits
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # the outer process is not reaped yet: its group id is still ours
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    os.close(exit_fd)
    proc.stdout.close()
    proc.stderr.close()
    return status, usage


def _wait_readable(fd: int, timeout: float, complaint: str) -> None:
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        if not sel.select(timeout) and complaint:
            logger.error("code sandbox: %s", complaint)


def _read_now(fd: int) -> bytes:
    """What ``fd`` holds right now, without waiting."""
    os.set_blocking(fd, False)
    with contextlib.suppress(BlockingIOError):
        return os.read(fd, 4096)
    return b""


def _open_init(info: bytes) -> int | None:
    """A pidfd for the sandbox's pid 1 from its ``{"child-pid", "pid-namespace"}`` report, if it still runs."""
    try:
        report = json.loads(info)
        pid = report["child-pid"]
        fd = os.pidfd_open(pid)
    except (ValueError, KeyError, ProcessLookupError):
        return None
    try:
        if os.stat(f"/proc/{pid}/ns/pid").st_ino == report["pid-namespace"]:
            return fd
    except OSError:
        pass
    os.close(fd)  # gone, and its pid already reused
    return None
