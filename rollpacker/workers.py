"""Killable worker processes: the pool that reward functions and environments run in.

:class:`WorkerPool` spawns ``num_workers`` processes (never ``fork``: the trainer has torch and
threads) and a manager thread in the caller that hands out tasks and enforces each task's
wall-clock timeout. A worker that overruns, crashes or dies is replaced at once, so capacity
recovers, and its task comes back failed (:meth:`WorkerPool._lost`), never silently. The old worker
gets ``RETIRE`` (SIGUSR2), which unwinds a sandbox run, then SIGKILL after ``STOP_GRACE`` seconds.

A tenant (:class:`~rollpacker.reward.workers.RewardPool`, :class:`~rollpacker.env.workers.EnvPool`)
says what a worker runs (``_main``, ``_main_args``), which task a free worker takes (``_next_task``),
what goes down its pipe (``_wire``), what comes back (``_received``) and what a task lost with its
worker becomes (``_lost``); results go to :meth:`poll` and :meth:`drain` through :meth:`_finish`.

Workers ignore the job's stop signals (SIGTERM, SIGINT, SIGUSR1: :mod:`rollpacker.preempt`): the
step in progress must finish with live workers, and the pool stops them after it. They are spawned
with those signals blocked, so none slips in before they ignore it. Each runs in a process group of
its own, out of reach of a kill of its rank's group (torchrun's teardown): it unwinds when its parent
dies (RETIRE is its parent-death signal), and is killed if that does not end it. A worker stuck in C code
when its parent dies cannot run RETIRE's handler: the task's own watchdog (:func:`tasks`) ends it.
A script that starts a pool needs the ``if __name__ == "__main__":`` guard (``spawn`` imports it in each worker),
and its workers start sooner with its heavy imports (torch, rollpacker.job) under the guard too.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import math
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from typing import Any

from rollpacker.errors import UserError

logger = logging.getLogger(__name__)

STOP_GRACE = 2.0
"""Seconds a worker told to stop (``RETIRE``) gets before SIGKILL."""
RETIRE = signal.SIGUSR2
"""What the pool sends a worker to stop it: the stop signals (``STOP_SIGNALS``) are the trainer's."""
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1
ORPHAN_GRACE = 10.0
"""Seconds past a task's timeout and ``STOP_GRACE`` after which a worker still in the task exits by itself: its
pool has killed it by then, unless the pool's process is gone while the task is stuck in C code."""


def ignore_stops(parent: int) -> None:
    """In a new worker: a process group of its own, the stop signals ignored, then unblocked; RETIRE unwinds;
    unwind when ``parent`` dies."""
    import ctypes

    os.setpgid(0, 0)  # torchrun kills a failed rank's process group: a worker follows its rank instead, unwinding
    for sig in STOP_SIGNALS:  # the trainer's to handle: it stops after the step, then closes the pool
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # blocked by the spawning thread: pending ones drop
    signal.signal(RETIRE, _retired)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, RETIRE, 0, 0, 0)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


@contextlib.contextmanager
def stops_blocked() -> Iterator[None]:
    """The stop signals blocked in this thread, for the processes it spawns meanwhile to inherit the block: a stop
    is the trainer's to handle. One sent meanwhile reaches this process as the block lifts."""
    mp.resource_tracker.ensure_running()  # its first start would unblock SIGINT and SIGTERM
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def tasks(conn: mp.connection.Connection) -> Iterator[Any]:
    """In a worker: the tasks its pool sends, until told None. Each runs under a watchdog of faulthandler's, a C
    thread, which dumps the worker's stack and exits it ``ORPHAN_GRACE`` seconds after the pool should have
    killed it: a task stuck in C code (a regex, a hash, a solver) does not run RETIRE's handler, and would
    outlive a dead rank. The watchdog is disarmed as the next task is asked for, and by :func:`leaving`: not in a
    ``finally`` here, which an error leaving the loop runs as it closes the generator, inside a finalizer, where
    the pool's RETIRE landing meanwhile was printed as a crash ("Exception ignored in: <generator ...>")."""
    while True:
        _Watchdog.disarm()
        if (message := conn.recv()) is None:
            return
        timeout, task = message
        _Watchdog.arm(timeout + STOP_GRACE + ORPHAN_GRACE)
        yield task


class _Watchdog:
    """faulthandler's watchdog over a worker's task. Paused across a fork by the task's code: the child has no
    watchdog thread, and its exit would wait for one forever."""

    deadline: float | None = None
    """``time.monotonic()`` at which the worker exits; None: no task runs."""

    @classmethod
    def arm(cls, seconds: float) -> None:
        if math.isfinite(seconds):
            cls.deadline = time.monotonic() + seconds
            cls.resume()

    @classmethod
    def disarm(cls) -> None:
        cls.pause()
        cls.forget()

    @classmethod
    def pause(cls) -> None:
        if cls.deadline is not None:
            faulthandler.cancel_dump_traceback_later()

    @classmethod
    def resume(cls) -> None:
        if cls.deadline is None:
            return
        try:  # to the worker's own stderr: the task's code may have replaced sys.stderr (a StringIO, None)
            faulthandler.dump_traceback_later(max(cls.deadline - time.monotonic(), 0.001), exit=True,
                                              file=sys.__stderr__)
        except (AttributeError, RuntimeError, ValueError, OSError):  # no stderr to write to: no watchdog
            cls.deadline = None

    @classmethod
    def forget(cls) -> None:
        cls.deadline = None


os.register_at_fork(before=_Watchdog.pause, after_in_parent=_Watchdog.resume, after_in_child=_Watchdog.forget)


class Retired(SystemExit):
    """The worker's unwinding on RETIRE: user code that catches ``SystemExit`` (its own ``sys.exit()``, said as its
    error) lets this one pass."""


def _retired(*_) -> None:
    """RETIRE (the pool's, or its process's death): unwind, so a sandbox run kills its sandbox and an environment
    worker closes its environments; SIGALRM's default kills the worker ``STOP_GRACE`` seconds on if that hangs
    (no pool is left to SIGKILL it when its process died). Once: a second RETIRE (the pool's, then its process's
    death) must not raise again inside the unwinding, where an atexit callback would print it as a crash."""
    signal.signal(RETIRE, _absorbed)
    signal.alarm(math.ceil(STOP_GRACE))
    raise Retired(1)


def leaving() -> None:
    """A worker's loop is over: the RETIRE that follows a closed pipe must not raise in the interpreter's exit
    (a SystemExit inside an atexit finalizer prints a traceback that reads like a crash). The task's watchdog is
    disarmed (the loop may have ended on an error) and SIGALRM's default ends the worker ``STOP_GRACE`` seconds on,
    as the pool would: a thread the user's code left running (not a daemon) holds the exit in a lock no signal
    handler interrupts, forever when the worker's process died (no pool to SIGKILL it)."""
    signal.signal(RETIRE, _absorbed)
    _Watchdog.disarm()
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(math.ceil(STOP_GRACE))


def _absorbed(*_) -> None:
    """RETIRE once the worker is leaving: nothing. Not ``SIG_IGN``: a RETIRE that lands while ``signal.signal``
    installs that is run later as ignored, which Python prints as a traceback ("Signal 12 ignored due to race
    condition") under a run that ended well."""


class PoolError(UserError, RuntimeError):
    """A pool cannot go on, said in full by its message: a worker that could not start (the user's code it loads
    hangs, exits or raises)."""


@dataclass
class _Worker:
    process: Any
    conn: mp.connection.Connection
    ready: bool = False
    task: Any = None
    """The task it runs (it has a ``timeout`` in seconds), or None."""
    started: float = 0.0
    """When ``task`` was handed over, or, until it is ready, when it was started (time.monotonic)."""


class WorkerPool:
    """``num_workers`` worker processes and the manager thread that feeds and polices them (the module
    docstring). Use as a context manager, or call :meth:`close`: it stops every worker."""

    _name = "worker"
    """Names the workers and their timeout setting (``NAME.timeout``) in messages."""
    _unfinished = "tasks unfinished"
    """What :meth:`drain`'s timeout says of the tasks left (the reward pool's: samples still unscored)."""
    _start_timeout: float | None = None
    """Seconds a worker may take to say ready (``NAME.start_timeout``: it loads the user's code); None: no limit."""
    _loads = "its modules"
    """What a starting worker loads, for the message when it takes longer than ``_start_timeout``."""

    def __init__(self, num_workers: int):
        self._ctx = mp.get_context("spawn")
        self._cond = threading.Condition()
        self._done: list[Any] = []
        self._num_unfinished = 0
        self._closing = False
        self._failure: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._retiring: list[tuple[Any, float]] = []  # stopping workers: (process, when to SIGKILL it)
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._manager = threading.Thread(target=self._manage, name=f"{self._name}-pool", daemon=True)
        self._manager.start()
        atexit.register(self.close)  # before multiprocessing's exit hook, whose SIGTERM the workers ignore

    # the caller's side

    def poll(self) -> list[Any]:
        """The results finished since the last call (maybe none); never waits."""
        with self._cond:
            self._check_alive()
            done, self._done = self._done, []
        return done

    def drain(self, timeout: float | None = None) -> list[Any]:
        """Wait until every task submitted is finished; return the results not yet returned by poll()."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._num_unfinished == 0 or self._failure, timeout):
                raise TimeoutError(f"{self._name} pool: {self._num_unfinished} {self._unfinished} after {timeout} s")
        return self.poll()

    @property
    def unfinished(self) -> int:
        """Tasks submitted and not finished yet."""
        return self._num_unfinished

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds (None: no limit) for a result, when a task is unfinished and none is ready."""
        with self._cond:
            self._cond.wait_for(lambda: self._done or not self._num_unfinished or self._failure, timeout)

    def close(self) -> None:
        """Stop the manager, every worker and their sandboxes; unfinished tasks are dropped."""
        if self._closing:
            return
        atexit.unregister(self.close)
        with self._cond:
            self._closing = True
        os.write(self._wake_w, b".")
        self._manager.join()
        for i, w in enumerate(self._workers):
            self._retire(w, self._stop_grace(i))
        for process, deadline in self._retiring:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
        self._reap_retired(force=True)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_alive(self) -> None:
        if isinstance(self._failure, PoolError):
            raise PoolError(str(self._failure)) from None
        if self._failure is not None:
            raise RuntimeError(f"{self._name} pool: its manager thread failed: {self._failure!r}") from self._failure
        if self._closing:
            raise RuntimeError(f"{self._name} pool is closed")

    def _wake(self) -> None:
        """Tell the manager thread that a task was queued."""
        os.write(self._wake_w, b".")

    # what a tenant says

    @staticmethod
    def _main(conn: mp.connection.Connection, parent: int, *args) -> None:
        """A worker process's main function: ``main(conn, parent_pid, *_main_args())``; it starts with
        :func:`ignore_stops` (``parent_pid``), says ready (sends None; or why it cannot start, a str, the
        pool's :class:`PoolError`), then answers each task :func:`tasks` gives it."""
        raise NotImplementedError

    def _main_args(self) -> tuple:
        return ()

    def _next_task(self, i: int) -> Any:
        """The task free worker ``i`` takes now, or None (called holding ``_cond``)."""
        raise NotImplementedError

    def _timers(self) -> list[float]:
        """When (``time.monotonic()``) a task held back becomes ready to take (called holding ``_cond``)."""
        return []

    def _wire(self, task: Any) -> Any:
        """What a worker gets for ``task`` (from :func:`tasks`: the pool sends it with the task's timeout)."""
        raise NotImplementedError

    def _received(self, task: Any, message: Any) -> None:
        """A worker's answer to ``task``."""
        raise NotImplementedError

    def _lost(self, i: int, task: Any, reason: str, seconds: float, again: bool = True) -> None:
        """Worker ``i`` was replaced for ``reason`` while running ``task`` (None: while idle); ``again``: whether
        ``task`` might go otherwise if tried again (False: its reply could not be read, and would not be)."""
        raise NotImplementedError

    def _finish(self, result: Any) -> None:
        """One task is done: ``result`` goes to :meth:`poll`."""
        with self._cond:
            self._done.append(result)
            self._num_unfinished -= 1
            self._cond.notify_all()

    # the manager thread's side

    def _manage(self) -> None:
        try:
            while not self._closing:
                self._dispatch()
                deadlines = [w.started + w.task.timeout for w in self._workers if w.task is not None]
                if self._start_timeout is not None:
                    deadlines += [w.started + self._start_timeout for w in self._workers if not w.ready]
                deadlines += [deadline for _, deadline in self._retiring]
                with self._cond:
                    deadlines += self._timers()
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
            if not isinstance(e, PoolError):
                logger.exception("%s pool manager failed", self._name)
            with self._cond:
                self._failure = e
                self._cond.notify_all()

    def _check(self, i: int, ready: set) -> None:
        """Take worker ``i``'s message, if any; replace it if it died or overran its task's timeout."""
        w = self._workers[i]
        if w.conn in ready:
            try:
                raw = w.conn.recv_bytes()
            except (EOFError, OSError):  # it died: its pipe and its sentinel are ready together
                self._died(i)
                return
            try:
                message = ForkingPickler.loads(raw)
            except Exception as e:  # noqa: BLE001  (a class of a file only the worker imported, an __init__ it lacks)
                self._replace(i, f"its reply cannot be read here ({type(e).__name__}: {str(e)[:200]}): return plain "
                                 "data (str, numbers, lists, dicts); its worker was replaced", again=False)
                return
            if message is None:
                w.ready = True
            elif not w.ready:  # why it cannot start: every worker would meet it
                raise PoolError(f"the {self._name} workers could not start: {message}")
            else:
                task, w.task = w.task, None
                self._received(task, message)
        elif w.process.sentinel in ready:
            self._died(i)
        elif w.task is not None and time.monotonic() - w.started > w.task.timeout:
            self._replace(i, f"timed out after {w.task.timeout:g} s ({self._name}.timeout); its worker was replaced")
        elif not w.ready and self._start_timeout is not None and time.monotonic() - w.started > self._start_timeout:
            raise PoolError(f"a {self._name} worker did not start within {self._start_timeout:g} s "
                               f"({self._name}.start_timeout) loading {self._loads}: it hangs, or needs longer "
                               f"(--{self._name}.start-timeout)")

    def _died(self, i: int) -> None:
        """Worker ``i`` exited: replace it, or, still starting, stop the pool (each new one would exit alike)."""
        w = self._workers[i]
        w.process.join(timeout=1)
        if not w.ready:
            raise PoolError(f"a {self._name} worker exited while starting (exit code {w.process.exitcode}); "
                            f"see its traceback above (a script that starts a {type(self).__name__} needs "
                            "if __name__ == '__main__':)")
        self._replace(i, f"its {self._name} worker died (exit code {w.process.exitcode})")

    def _dispatch(self) -> None:
        for i, w in enumerate(self._workers):
            if w.ready and w.task is None:
                with self._cond:
                    task = self._next_task(i)
                if task is None:
                    continue
                w.task, w.started = task, time.monotonic()
                with contextlib.suppress(OSError):  # it just died: its sentinel says so next, the task is flagged
                    w.conn.send((task.timeout, self._wire(task)))

    def _replace(self, i: int, reason: str, again: bool = True) -> None:
        """Stop worker ``i`` and start a fresh one in its place; flag its task with ``reason`` (:meth:`_lost`)."""
        w = self._workers[i]
        self._retire(w, self._stop_grace(i))
        self._workers[i] = self._start_worker()
        self._lost(i, w.task, reason, time.monotonic() - w.started, again)

    def _start_worker(self) -> _Worker:
        conn, child_conn = self._ctx.Pipe()
        process = self._ctx.Process(target=self._main, args=(child_conn, os.getpid(), *self._main_args()),
                                    name=f"{self._name}-worker", daemon=True)
        with stops_blocked():  # inherited: see ignore_stops
            process.start()
        child_conn.close()
        return _Worker(process, conn, started=time.monotonic())

    def _retire(self, w: _Worker, grace: float) -> None:
        """Ask ``w`` to exit (RETIRE unwinds a sandbox run, which kills and reaps its sandbox); SIGKILL it
        if it is still there ``grace`` seconds later (a hang in C code), see :meth:`_reap_retired`."""
        w.conn.close()
        if w.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.process.pid, RETIRE)
        self._retiring.append((w.process, time.monotonic() + grace))

    def _stop_grace(self, i: int) -> float:
        """Seconds worker ``i`` gets to stop before SIGKILL."""
        return STOP_GRACE

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
                with contextlib.suppress(ProcessLookupError, PermissionError):  # what the user's code started
                    os.killpg(process.pid, signal.SIGKILL)  # in the worker's process group (ignore_stops) goes too
                process.close()
        self._retiring = still
