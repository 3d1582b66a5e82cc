"""Reward workers: score samples asynchronously, in processes that can be killed.

:class:`RewardPool` is the generic :class:`~rollpacker.workers.WorkerPool` with reward tasks. The
controller calls :meth:`RewardPool.submit` the moment a response finishes (it returns at once),
collects finished scores with ``poll`` while rollout goes on, and waits for the rest with ``drain``
at the end of the round. That wait is ``time/reward_exposed``; the per-sample ``seconds`` summed is
the total reward time.

A worker calls one reward function on one response at a time
(:func:`rollpacker.reward.functions.call`): a built-in (math with math-verify, whose signal-based
timeout only works on a main thread, ours is the pool's kill; the toy check; code in the sandbox)
or the user's own, imported once per worker. A sample whose function raised, returned a bad value,
overran ``reward.timeout`` or lost its worker comes back flagged (``error`` set, ``score`` None),
never as a silent 0.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import multiprocessing.connection
import resource
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from rollpacker.reward.config import RewardConfig
from rollpacker.reward.functions import BadValue, Ref, call
from rollpacker.workers import STOP_GRACE, WorkerPool, ignore_stops, leaving  # noqa: F401  (STOP_GRACE: the tests')


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


def _work(conn: mp.connection.Connection, parent: int) -> None:
    """A worker's life: warm up, say ready (None), then score ``(ref, sample)`` until told None."""
    ignore_stops(parent)
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

    def __init__(self, cfg: RewardConfig | None = None):
        self.cfg = cfg or RewardConfig()
        self._todo: collections.deque[_Task] = collections.deque()
        super().__init__(self.cfg.num_workers)

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

    def _lost(self, i: int, task: _Task | None, reason: str, seconds: float) -> None:
        if task is not None:
            self._finish(Scored(task.key, None, reason, seconds, seconds))
