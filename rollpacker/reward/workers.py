"""Reward workers: score samples asynchronously, in processes that can be killed.

The controller calls :meth:`RewardPool.submit` the moment a response finishes (it returns at once),
collects finished scores with :meth:`RewardPool.poll` while rollout goes on, and waits for the
rest with :meth:`RewardPool.drain` at the end of the round. That wait is ``time/reward_exposed``;
the per-sample ``seconds`` summed is the total reward time.

Each worker is a ``spawn``-ed process (the trainer has torch and threads: never fork it) that
calls one reward function on one response at a time (:func:`rollpacker.reward.functions.call`):
a built-in (math with math-verify, whose signal-based timeout only works on a main thread, ours
is the kill below; the toy check; code in the sandbox) or the user's own, imported once per
worker. A manager thread in the trainer hands out tasks and enforces each task's wall-clock
timeout: a worker that overruns, crashes or dies is replaced at once, so capacity recovers, and
its sample comes back flagged (``error`` set, ``score`` None), never as a silent 0; so does a
sample whose reward function raised or returned a bad value. The old worker gets ``RETIRE``
(SIGUSR2), which unwinds a sandbox run (killing and reaping its sandbox), then SIGKILL if it is
still there after ``STOP_GRACE`` seconds (a hang inside C code).

Workers ignore the job's stop signals (SIGTERM, SIGINT, SIGUSR1: :mod:`rollpacker.preempt`). They
reach the workers too (torchrun signals each rank's process group, Slurm every process of the
step), and the step in progress must be scored by live workers; the pool stops them after it.
They are spawned with those signals blocked, so no signal slips in before they ignore it, and die
with the process that started them (a parent-death signal), whatever ends it.

A script that starts a pool needs the ``if __name__ == "__main__":`` guard (``spawn`` imports it).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BadValue, Ref, call

logger = logging.getLogger(__name__)

STOP_GRACE = 2.0
"""Seconds a worker told to stop (``RETIRE``) gets before SIGKILL."""
RETIRE = signal.SIGUSR2
"""What the pool sends a worker to stop it: the stop signals (``STOP_SIGNALS``) are the trainer's."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1


@dataclass
class Scored:
    """One finished sample."""

    key: Hashable
    score: float | None
    """The function's value; None when it does not apply to the row, or failed (then ``error`` says why)."""
    error: str | None
    """Set when the function failed: it raised, returned a bad value, timed out, or its worker died."""
    seconds: float
    """Wall time spent scoring it in a worker (queueing excluded)."""
    cpu_seconds: float
    """CPU time of the worker and its sandboxes; a killed worker counts its wall time."""
    metrics: dict = field(default_factory=dict)
    """The numbers of a dict the function returned, besides its score."""
    info: dict = field(default_factory=dict)
    """The rest of such a dict, e.g. code's ``{"verdicts", "seconds"}`` per test run."""


def score(ref: Ref, sample: dict) -> tuple[float | None, str | None, dict, dict]:
    """Call one reward function on one response in this process, what a worker runs:
    ``(value, error, metrics, info)``, with ``error`` the cause when it failed."""
    try:
        value, metrics, info = call(ref, sample)
    except BadValue as e:
        return None, str(e), {}, {}
    except Exception as e:  # noqa: BLE001  (the user's code: whatever it raises is the cause to report)
        return None, f"raised {type(e).__name__}: {str(e)[:500]}", {}, {}
    return value, None, metrics, info


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _ignore_stops(parent: int) -> None:
    """In a new worker: the stop signals ignored, then unblocked; RETIRE unwinds; die with ``parent``."""
    import ctypes

    for sig in STOP_SIGNALS:  # the trainer's to handle: it stops after the step, then closes the pool
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the spawning thread: pending ones drop
    signal.signal(RETIRE, lambda *_: sys.exit(1))  # unwinds a sandbox run, which kills its sandbox
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _work(conn: mp.connection.Connection, parent: int) -> None:
    """A worker's life: warm up, say ready (None), then score ``(ref, sample)`` until told None."""
    _ignore_stops(parent)
    import math_verify  # noqa: F401  (sympy behind it: a second, not part of the first sample's time)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout is disabled": ours is the kill

    try:
        conn.send(None)
        while (task := conn.recv()) is not None:
            ref, sample = task
            wall, cpu = time.perf_counter(), _cpu_seconds()
            value, error, metrics, info = score(ref, sample)
            conn.send((value, error, metrics, info, time.perf_counter() - wall, _cpu_seconds() - cpu))
    except (EOFError, BrokenPipeError):  # the pool closed our pipe: it is shutting down, or its process died
        return
    finally:
        _leaving()


def _leaving() -> None:
    """A worker's loop is over: the RETIRE that follows a closed pipe must not raise in the interpreter's exit
    (a SystemExit inside an atexit finalizer prints a traceback that reads like a crash)."""
    signal.signal(RETIRE, signal.SIG_IGN)


@dataclass
class _Task:
    key: Hashable
    ref: Ref
    sample: dict
    timeout: float


@dataclass
class _Worker:
    process: Any
    conn: mp.connection.Connection
    ready: bool = False
    task: _Task | None = None
    started: float = 0.0
    """When ``task`` was handed over (time.monotonic)."""


class RewardPool:
    """``num_workers`` reward worker processes and the manager thread that feeds and polices them.

    Use as a context manager, or call :meth:`close`: it stops every worker and sandbox.

    The environment workers (:class:`rollpacker.env.workers.EnvPool`) are this pool with other
    tasks: a subclass overrides the worker's main function (``_main``, ``_main_args``), which task a
    free worker takes (``_next_task``), what goes down its pipe (``_wire``), what comes back
    (``_received``) and what a task lost with its worker becomes (``_lost``).
    """

    _name = "reward"
    """Names the workers and their timeout setting (``reward.timeout``) in messages."""

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._todo: collections.deque[_Task] = collections.deque()
        self._done: list[Scored] = []
        self._num_unfinished = 0
        self._closing = False
        self._failure: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._retiring: list[tuple[Any, float]] = []  # stopping workers: (process, when to SIGKILL it)
        self._workers = [self._start_worker() for _ in range(self.cfg.num_workers)]
        self._manager = threading.Thread(target=self._manage, name=f"{self._name}-pool", daemon=True)
        self._manager.start()
        atexit.register(self.close)  # before multiprocessing's exit hook, whose SIGTERM the workers ignore

    # the caller's side

    def submit(self, key: Hashable, ref: Ref, sample: dict, timeout: float | None = None) -> None:
        """Queue one call of ``ref`` on one response (``sample``, see :func:`~rollpacker.reward.functions.call`);
        returns at once. ``timeout`` defaults to ``cfg.timeout``."""
        with self._cond:
            self._check_alive()
            self._todo.append(_Task(key, ref, sample, self.cfg.timeout if timeout is None else timeout))
            self._num_unfinished += 1
        os.write(self._wake_w, b".")

    def poll(self) -> list[Scored]:
        """The samples finished since the last call (maybe none); never waits."""
        with self._cond:
            self._check_alive()
            done, self._done = self._done, []
        return done

    def drain(self, timeout: float | None = None) -> list[Scored]:
        """Wait until every submitted sample is finished; return those not yet returned by poll()."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._num_unfinished == 0 or self._failure, timeout):
                raise TimeoutError(f"reward pool: {self._num_unfinished} samples still unscored after {timeout} s")
        return self.poll()

    def close(self) -> None:
        """Stop the manager, every worker and their sandboxes; unfinished samples are dropped."""
        if self._closing:
            return
        atexit.unregister(self.close)
        with self._cond:
            self._closing = True
        os.write(self._wake_w, b".")
        self._manager.join()
        for w in self._workers:
            self._retire(w)
        deadline = time.monotonic() + STOP_GRACE
        for process, _ in self._retiring:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._reap_retired(force=True)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"reward pool: its manager thread failed: {self._failure!r}") from self._failure
        if self._closing:
            raise RuntimeError("reward pool is closed")

    # the manager thread's side

    def _manage(self) -> None:
        try:
            while not self._closing:
                self._dispatch()
                deadlines = [w.started + w.task.timeout for w in self._workers if w.task is not None]
                deadlines += [deadline for _, deadline in self._retiring]
                wait = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
                handles = [self._wake_r, *(w.conn for w in self._workers), *(w.process.sentinel for w in self._workers),
                           *(process.sentinel for process, _ in self._retiring)]
                ready = set(mp.connection.wait(handles, wait))
                self._reap_retired()
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError):
                        while os.read(self._wake_r, 4096):
                            pass
                for i in range(len(self._workers)):
                    self._check(i, ready)
        except BaseException as e:  # noqa: BLE001  (surfaced to the caller by poll/drain/submit)
            logger.exception("reward pool manager failed")
            with self._cond:
                self._failure = e
                self._cond.notify_all()

    def _check(self, i: int, ready: set) -> None:
        """Take worker ``i``'s message, if any; replace it if it died or overran its task's timeout."""
        w = self._workers[i]
        if w.conn in ready:
            try:
                message = w.conn.recv()
            except (EOFError, OSError):
                w.process.join(timeout=1)
                self._replace(i, f"its {self._name} worker died (exit code {w.process.exitcode})")
                return
            if message is None:
                w.ready = True
            else:
                task, w.task = w.task, None
                self._received(task, message)
        elif w.process.sentinel in ready:
            w.process.join(timeout=1)
            if not w.ready:
                raise RuntimeError(f"a {self._name} worker exited while starting (exit code {w.process.exitcode}); "
                                   f"see its traceback above (a script that starts a {type(self).__name__} needs "
                                   "if __name__ == '__main__':)")
            self._replace(i, f"its {self._name} worker died (exit code {w.process.exitcode})")
        elif w.task is not None and time.monotonic() - w.started > w.task.timeout:
            self._replace(i, f"timed out after {w.task.timeout:g} s ({self._name}.timeout); its worker was replaced")

    def _dispatch(self) -> None:
        for i, w in enumerate(self._workers):
            if w.ready and w.task is None:
                with self._cond:
                    task = self._next_task(i)
                if task is None:
                    continue
                w.task, w.started = task, time.monotonic()
                with contextlib.suppress(OSError):  # it just died: its sentinel says so next, the task is flagged
                    w.conn.send(self._wire(task))

    def _next_task(self, i: int) -> Any:
        """The task free worker ``i`` takes now, or None (called holding ``_cond``)."""
        return self._todo.popleft() if self._todo else None

    def _wire(self, task: _Task) -> Any:
        """What a worker gets for ``task``."""
        return task.ref, task.sample

    def _received(self, task: _Task, message: Any) -> None:
        """A worker's answer to ``task``."""
        value, error, metrics, info, seconds, cpu_seconds = message
        self._finish(Scored(task.key, value, error, seconds, cpu_seconds, metrics, info))

    def _lost(self, i: int, task: _Task | None, reason: str, seconds: float) -> None:
        """Worker ``i`` was replaced for ``reason`` while running ``task`` (None: while idle)."""
        if task is not None:
            self._finish(Scored(task.key, None, reason, seconds, seconds))

    def _finish(self, scored: Scored) -> None:
        with self._cond:
            self._done.append(scored)
            self._num_unfinished -= 1
            self._cond.notify_all()

    def _replace(self, i: int, reason: str) -> None:
        """Stop worker ``i`` and start a fresh one in its place; flag its task with ``reason``."""
        w = self._workers[i]
        self._retire(w)
        self._workers[i] = self._start_worker()
        self._lost(i, w.task, reason, time.monotonic() - w.started)

    _main = staticmethod(_work)
    """A worker process's main function: ``main(conn, parent_pid, *_main_args())``; it starts with
    :func:`_ignore_stops` (``parent_pid``)."""

    def _main_args(self) -> tuple:
        return ()

    def _start_worker(self) -> _Worker:
        conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(target=self._main, args=(child_conn, os.getpid(), *self._main_args()),
                                    name=f"{self._name}-worker", daemon=True)
        mp.resource_tracker.ensure_running()  # its first start would unblock SIGINT and SIGTERM below
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # inherited: see _ignore_stops
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        child_conn.close()
        return _Worker(process, conn)

    def _retire(self, w: _Worker) -> None:
        """Ask ``w`` to exit (RETIRE unwinds a sandbox run, which kills and reaps its sandbox); SIGKILL it
        if it is still there ``STOP_GRACE`` seconds later (a hang in C code), see :meth:`_reap_retired`."""
        w.conn.close()
        if w.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid, RETIRE)
        self._retiring.append((w.process, time.monotonic() + STOP_GRACE))

    def _reap_retired(self, force: bool = False) -> None:
        still = []
        for process, deadline in self._retiring:
            if process.is_alive() and (force or time.monotonic() > deadline):
                process.kill()  # its sandbox, if any, dies with it (parent-death signal)
                process.join()
            if process.is_alive():
                still.append((process, deadline))
            else:
                process.join()
                process.close()
        self._retiring = still
