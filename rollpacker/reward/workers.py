"""Reward workers: score samples asynchronously, in processes that can be killed, or (``async def``
functions) on an event loop of the controller's.

:class:`RewardPool` is the generic :class:`~rollpacker.workers.WorkerPool` with reward tasks. The
controller calls :meth:`RewardPool.submit` the moment a response finishes (it returns at once),
collects finished scores with ``poll`` while rollout goes on, and waits for the rest with ``wait``
at the end of the round. That wait is ``time/reward_exposed``; the per-sample ``seconds`` summed is
the total reward time.

A worker calls one reward function on one response at a time
(:func:`rollpacker.reward.functions.call`): a built-in (math with math-verify, whose signal-based
timeout only works on a main thread, ours is the pool's kill; the toy check; code in the sandbox)
or the user's own, imported once per worker. A sample whose function raised, returned a bad value,
overran ``reward.timeout`` or lost its worker comes back flagged (``error`` set, ``score`` None),
never as a silent 0.

An ``async def`` function waits on I/O (a remote reward model, an LLM judge's API), so one call per
worker would leave most of its time idle. :class:`AsyncCalls` awaits such calls on an event loop
in a thread of the controller, up to ``reward.max_concurrent`` at once, as TRL awaits its async
reward functions together; one over its timeout is cancelled, and flagged the same way.
"""

from __future__ import annotations

import asyncio
import collections
import multiprocessing as mp
import multiprocessing.connection
import queue
import resource
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollpacker.imports import warm_up
from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BadValue, Ref, RewardFunctionError, Value, acall, call
from rollpacker.workers import STOP_GRACE, Retired, WorkerPool, ignore_stops, leaving, tasks  # noqa: F401  (STOP_GRACE: the tests')

STALL_GRACE_S = 30.0
"""Seconds past the longest timeout an async call may take to come back before its loop counts as stalled."""


@dataclass
class Scored:
    """One finished sample."""

    key: Hashable
    score: float | None | list[float | None]
    """The function's value; None when it does not apply to the row, or failed (then ``error`` says why). A
    group function's: one per response of the group (its ``metrics`` and ``info`` one dict each)."""
    error: str | None
    """Set when the function failed: it raised, returned a bad value, timed out, or its worker died."""
    seconds: float
    """Wall time spent scoring it in a worker (queueing excluded)."""
    cpu_seconds: float
    """CPU time of the worker and its sandboxes; a killed worker counts its wall time."""
    metrics: dict | list[dict] = field(default_factory=dict)
    """The numbers of a dict the function returned, besides its score, and what it logged (``log_metric``)."""
    info: dict = field(default_factory=dict)
    """The rest of such a dict, e.g. code's ``{"verdicts", "seconds"}`` per test run."""


def score(ref: Ref, sample: dict | list[dict]) -> tuple[float | None | list, str | None, dict, dict | list]:
    """Call one reward function on one response (a group function: on a group's, a list) in this process,
    what a worker runs: ``(value, error, metrics, info)``, with ``error`` the cause when it failed."""
    try:
        return _scored(call(ref, sample))
    except (Retired, KeyboardInterrupt):
        raise
    except BaseException as e:  # noqa: BLE001  (the user's code: whatever it raises, sys.exit() and math-verify's
        return _failed(e)       # TimeoutException, a BaseException, too)


async def ascore(ref: Ref, sample: dict | list[dict]) -> tuple[float | None | list, str | None, dict, dict | list]:
    """:func:`score`, awaited on the running event loop (its cancellation passes)."""
    try:
        return _scored(await acall(ref, sample))
    except (Retired, KeyboardInterrupt):
        raise
    except asyncio.CancelledError as e:  # not an Exception: the function's own (a cancelled sibling of a gather)
        if asyncio.current_task().cancelling():  # ours: its timeout, or the loop stopping
            raise
        return _failed(e)
    except BaseException as e:  # noqa: BLE001  (as score's)
        return _failed(e)


def _scored(value: Value | list[Value]) -> tuple[float | None | list, str | None, dict | list, dict | list]:
    if not isinstance(value, list):
        return value[0], None, value[1], value[2]
    return [v for v, _, _ in value], None, [m for _, m, _ in value], [info for _, _, info in value]


def _failed(e: Exception) -> tuple[None, str, dict, dict]:
    return None, str(e) if isinstance(e, BadValue) else f"raised {type(e).__name__}: {str(e)[:500]}", {}, {}


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _work(conn: mp.connection.Connection, parent: int, targets: tuple[str, ...]) -> None:
    """A worker's life: warm up (the functions of ``targets`` imported and warmed up), say ready (None; why a
    warm_up() failed, and wait to be stopped), then score ``(ref, sample)`` until told None."""
    ignore_stops(parent)
    failed = next(filter(None, (warm_up(target, "reward.funcs", imported=True) for target in targets)), "")
    try:
        conn.send(failed or None)
        for task in tasks(conn):
            ref, sample = task
            wall, cpu = time.perf_counter(), _cpu_seconds()
            value, error, metrics, info = score(ref, sample)
            seconds = time.perf_counter() - wall, _cpu_seconds() - cpu
            try:
                conn.send((value, error, metrics, info, *seconds))
            except (EOFError, OSError):
                raise
            except Exception as e:  # noqa: BLE001  (pickled before a byte is sent: a lock, recursion, a __reduce__)
                conn.send((None, f"returned what cannot be sent from its reward worker (a lock, a generator?): "
                                 f"{type(e).__name__}: {str(e)[:200]}", {}, {}, *seconds))
    except (EOFError, ConnectionError):  # the pool closed our pipe (unread: a reset): stopping, or its process died
        return
    finally:
        leaving()


@dataclass
class _Task:
    key: Hashable
    ref: Ref
    sample: dict
    timeout: float


class RewardPool(WorkerPool):
    """``reward.num_workers`` reward worker processes (the module docstring)."""

    _name = "reward"
    _unfinished = "samples still unscored"
    _main = staticmethod(_work)

    def __init__(self, cfg: RewardConfig | None = None, targets: tuple[str, ...] = ()):
        """``targets``: the functions the workers will call, loaded and warmed up as each starts."""
        self.cfg, self.targets = cfg or RewardConfig(), targets
        self._start_timeout, self._loads = self.cfg.start_timeout, ", ".join(targets) or self._loads
        self._todo: collections.deque[_Task] = collections.deque()
        super().__init__(self.cfg.num_workers)

    def _main_args(self) -> tuple:
        return (self.targets,)

    def submit(self, key: Hashable, ref: Ref, sample: dict, timeout: float | None = None) -> None:
        """Queue one call of ``ref`` on one response (``sample``, see :func:`~rollpacker.reward.functions.call`);
        returns at once. ``timeout`` defaults to ``cfg.timeout``."""
        with self._cond:
            self._check_alive()
            self._todo.append(_Task(key, ref, sample, self.cfg.timeout if timeout is None else timeout))
            self._num_unfinished += 1
        self._wake()

    def _next_task(self, i: int) -> _Task | None:
        return self._todo.popleft() if self._todo else None

    def _wire(self, task: _Task) -> Any:
        return task.ref, task.sample

    def _received(self, task: _Task, message: Any) -> None:
        value, error, metrics, info, seconds, cpu_seconds = message
        self._finish(Scored(task.key, value, error, seconds, cpu_seconds, metrics, info))

    def _lost(self, i: int, task: _Task | None, reason: str, seconds: float, again: bool = True) -> None:
        if task is not None:
            self._finish(Scored(task.key, None, reason, seconds, seconds))


class AsyncCalls:
    """``async def`` reward functions' calls, awaited on an event loop in a thread of this process, at
    most ``max_concurrent`` at once (the module docstring). ``poll``, ``wait`` and ``unfinished`` are the pool's."""

    def __init__(self, max_concurrent: int):
        self._loop = asyncio.new_event_loop()
        self._limit = asyncio.Semaphore(max_concurrent)
        self._done: queue.SimpleQueue[Scored] = queue.SimpleQueue()
        self._waited: list[Scored] = []
        """A result :meth:`wait` took from the queue, for the next :meth:`poll`."""
        self.unfinished = 0
        """Calls submitted and not polled yet."""
        self._longest = 0.0
        """The longest timeout of a call submitted: a live loop finishes some call within it."""
        self._since = 0.0
        """When a call last came back (or was submitted to an idle loop): the stall check counts from it."""
        self._running: dict[int, str] = {}
        """The calls being awaited (by task id): their function's name."""
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollpacker-async-rewards", daemon=True)
        self._thread.start()

    def submit(self, key: Hashable, ref: Ref, sample: dict, timeout: float) -> None:
        """Start awaiting ``ref`` on one response; returns at once."""
        if not self.unfinished:
            self._since = time.monotonic()
        self.unfinished += 1
        self._longest = max(self._longest, timeout)
        asyncio.run_coroutine_threadsafe(self._score(key, ref, sample, timeout), self._loop)

    async def _score(self, key: Hashable, ref: Ref, sample: dict, timeout: float) -> None:
        async with self._limit:
            start, me = time.perf_counter(), id(asyncio.current_task())
            self._running[me] = ref.name
            try:
                value, error, metrics, info = await asyncio.wait_for(ascore(ref, sample), timeout)
            except asyncio.TimeoutError:  # the builtin from 3.11; its own class on 3.10
                value, error, metrics, info = None, f"timed out after {timeout:g} s (reward.timeout): cancelled", {}, {}
            finally:
                del self._running[me]
            seconds = time.perf_counter() - start
            self._done.put(Scored(key, value, error, seconds, seconds, metrics, info))

    def poll(self) -> list[Scored]:
        """The calls finished since the last ``poll``. Raises :class:`RewardFunctionError` when calls are
        unfinished and none has come back within the longest timeout and :data:`STALL_GRACE_S`: a call that
        blocks the loop instead of awaiting cannot be cancelled, and would hold the run forever."""
        done, self._waited = self._waited, []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.unfinished -= len(done)
        if done:
            self._since = time.monotonic()
        elif self.unfinished and time.monotonic() - self._since >= self._longest + STALL_GRACE_S:
            names = ", ".join(sorted(set(self._running.values()))) or "?"
            raise RewardFunctionError(
                f"async reward function {names}: no call returned within {self._longest + STALL_GRACE_S:g} s, "
                "its timeout and a grace: a call that blocks (a sync request, time.sleep) instead of awaiting "
                "stalls every async call and cannot be cancelled. Await its I/O, or make it a plain def, which "
                "runs in the killable reward workers")
        return done

    def wait(self, timeout: float | None) -> None:
        """Wait up to ``timeout`` seconds (None: no limit), and no later than the stall check's deadline, for
        a call to finish, when one is unfinished and none is ready."""
        if not self.unfinished or self._waited:
            return
        stall = self._since + self._longest + STALL_GRACE_S - time.monotonic()
        try:
            self._waited.append(self._done.get(timeout=max(0.0, stall if timeout is None else min(stall, timeout))))
        except queue.Empty:
            pass

    def close(self) -> None:
        """Cancel the calls in flight and stop the loop."""
        def stop() -> None:
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(timeout=5)
