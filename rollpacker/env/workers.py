"""Environment workers: environments live and step in processes that can be killed, beside rollout.

:class:`EnvPool` is the generic :class:`~rollpacker.workers.WorkerPool` (spawned processes, a
manager thread that feeds them and kills one that overruns its timeout or dies, replacing it at
once) with environment tasks. An episode's environment lives on one worker from
``open_episode`` (``make_env(row)``, then ``reset``) to ``close_episode``; its calls run
there in order, one at a time per worker, each under ``env.timeout``. Every call returns at once;
its :class:`~rollpacker.env.contract.EnvReply` comes back from ``poll`` (never waits) or ``drain``.

A call that raises, returns something the contract does not allow
(:class:`~rollpacker.env.contract.BadReturn`), hangs past the timeout (its worker is killed), or replies
with what the trainer cannot load (a class of the environment's own file, which only its worker imports; its
worker is killed too) comes back with ``error`` naming the environment, the episode's row and the cause, once; the
environment is closed and dropped, and closing it later is a no-op. Episodes whose environments
lived on a killed worker lose them too: their next step comes back with an error saying why (one
whose open had not run yet waits for the fresh worker). An open that raised, hung or lost its
worker is tried again ``env.reset_retries`` times, each after a delay that doubles
(``env.reset_retry_delay``), unless its episode is closed meanwhile; one that returned what the
contract does not allow (or cannot be sent back, or read here) fails at once, as it would again; a step is
never retried: the caller decides (``env.on_error``). A worker that stops (the pool closed, the worker replaced,
the job's process gone) closes the environments it still holds first, each within ``env.timeout``.

A script that starts a pool needs the ``if __name__ == "__main__":`` guard (``spawn`` imports it in each worker),
and its workers start sooner with its heavy imports (torch, rollpacker.job) under the guard too.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import multiprocessing.connection
import signal
import sys
import time
from collections.abc import Hashable
from dataclasses import dataclass, field, replace
from typing import Any

from rollpacker.env import contract
from rollpacker.env.config import FACTORIES, EnvConfig
from rollpacker.env.contract import EnvError, EnvReply
from rollpacker.imports import load, target, warm_up
from rollpacker.reward.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from rollpacker.workers import STOP_GRACE, Retired, WorkerPool, ignore_stops, leaving, tasks


@dataclass(frozen=True)
class EnvSpec:
    """What a worker needs to build environments: plain data, so it pickles."""

    factory: str = ""
    """The factory's importable target (``env.factory`` resolved), or empty: tools alone."""
    tools: tuple[str, ...] = ()
    tool_parser: str = "hermes"
    observation_role: str = "user"
    label: str = ""
    """The environment as the user named it (``env.factory``), for messages."""
    max_turns: int = 4
    """``env.max_turns``: a TRL environment's reward comes after the last turn (:mod:`rollpacker.env.trl`); an
    environment's reset gets it (``options["max_turns"]``)."""
    states: bool = False
    """Send back a copy of the environment after each call, for reward functions that take ``environments``
    (environments that make one: TRL's)."""
    max_tool_result_chars: int = EnvConfig.max_tool_result_chars
    timeout: float = EnvConfig.timeout
    """``env.timeout``: a turn's tool calls answer within it (:class:`~rollpacker.env.tools.ToolEnv`)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """``reward.sandbox``: the built-in ``python`` tool's sandbox, as the code reward's."""

    @classmethod
    def from_config(cls, cfg: EnvConfig, states: bool = False, sandbox: SandboxConfig | None = None) -> EnvSpec:
        return cls(target(cfg.factory, FACTORIES) if cfg.factory else "", cfg.tools, cfg.tool_parser,
                   cfg.observation_role, cfg.factory, cfg.max_turns, states, cfg.max_tool_result_chars, cfg.timeout,
                   sandbox or SandboxConfig())

    @property
    def name(self) -> str:
        """The environment, for messages."""
        return self.label or self.factory or f"tools {', '.join(self.tools)}"

    def warm(self) -> str:
        """Import the modules :meth:`build` uses (ours, transformers for the tools' schemas, the factory's and the
        tools', running the factory's ``warm_up()``) before the worker says ready, so its first call does not pay for
        them against ``env.timeout``: 32 workers starting together on 2 cores took over 30 s, a verifiers
        environment may load a dataset. ``env.start_timeout`` catches a hang here; ``make_env`` runs in the call.
        Returns why a ``warm_up()`` failed or the tools cannot be offered ("" if neither)."""
        import torch  # noqa: F401  transformers' first tool schema (tools', a TRL environment's) imports it: 1.4 s

        from rollpacker.env import tools, trl  # noqa: F401

        warmed = ([warm_up(self.factory, "env.factory", mapping=True, options={"max_turns": self.max_turns})]
                  if self.factory else [])
        warmed += [warm_up(target(spec, tools.TOOLS), "env.tools") for spec in self.tools]
        if self.tools and not any(warmed):
            try:  # two named alike, or one with no schema: every open would fail the same way
                tools.schemas(tools.load_tools(self.tools))
            except EnvError as e:
                warmed.append(str(e))
        if tools.TOOLS["python"] in (target(spec, tools.TOOLS) for spec in self.tools):
            tools.python_sandbox = self.sandbox
            try:
                Sandbox(self.sandbox)  # no isolation: every call's answer would be this error, trained on
            except SandboxUnavailable as e:
                warmed.append(f"env.tools python: {e}")
        return next(filter(None, warmed), "")

    def build(self, row: dict):
        """A fresh environment for ``row``: the factory's, wrapped in the tools if any; a TRL environment's
        episode (:mod:`rollpacker.env.trl`) when the factory has TRL's shape. A factory that reads tool calls itself
        (``takes_tool_parser``: a verifiers one) gets ``env.tool_parser``."""
        from rollpacker.env import trl

        factory = load(self.factory, "env.factory", EnvError, mapping=True) if self.factory else None
        trl_factories = trl.factories(factory, self.name) if factory is not None else None
        if trl_factories is not None:
            return trl.make(self, trl_factories, row)
        parser = {"tool_parser": self.tool_parser} if getattr(factory, "takes_tool_parser", False) else {}
        inner = factory(row, **parser) if factory is not None else None
        if not self.tools:
            return inner
        from rollpacker.env.tools import ToolEnv, load_tools

        return ToolEnv(load_tools(self.tools), self.tool_parser, inner, max_result_chars=self.max_tool_result_chars,
                       timeout=self.timeout)


@dataclass
class _Call:
    key: Hashable
    kind: str
    payload: Any
    timeout: float
    row_id: Any = None
    attempt: int = 0
    """An open's retries so far."""
    ready_at: float = 0.0
    """``time.monotonic()`` from which a retried open may run."""
    error: str = ""
    """A retried open's last error (its reply's, should its episode close before it runs again)."""


@dataclass
class _Episode:
    worker: int
    row_id: Any
    lost: str = ""
    """Why its environment is gone (its worker was killed), or empty."""
    calls: int = 0
    """Calls submitted and not yet answered."""


def _serve(conn: mp.connection.Connection, parent: int, spec: EnvSpec) -> None:
    """A worker's life: the pool's signals (stops ignored, RETIRE unwinds a sandbox run of the
    python tool, death with ``parent``), say ready (None), then run ``(kind, key, payload)`` calls
    until told None."""
    ignore_stops(parent)
    envs: dict[Hashable, Any] = {}
    failed = spec.warm()
    try:
        conn.send(failed or None)
        for task in tasks(conn):
            wall = time.perf_counter()
            value, error, state, finishes, transient = _run(spec, envs, *task)
            try:
                conn.send((value, error, time.perf_counter() - wall, state, finishes, transient))
            except (EOFError, OSError):
                raise
            except Exception as e:  # noqa: BLE001  (pickling it failed: ctypes, recursion, an object's __reduce__)
                _drop(envs, *task[:2])
                conn.send((None, f"{task[0]} returned something that cannot be sent back ({type(e).__name__}: {e})",
                           time.perf_counter() - wall, None, False, False))
    except (EOFError, ConnectionError):  # the pool closed our pipe (unread: a reset): stopping, or its process died
        return
    finally:
        try:  # the pool's RETIRE follows a closed pipe: it may land here, before RETIRE is ignored
            leaving()
        finally:
            _close_all(spec, envs)


def _close_all(spec: EnvSpec, envs: dict) -> None:
    """The worker stops (the pool closed, the worker replaced, its process gone): every environment it holds
    is closed, each within ``env.timeout`` (SIGALRM's default kills the worker at a close that hangs; the pool
    waits as long, :meth:`EnvPool._stop_grace`), a second RETIRE (its process's death after the pool's) ignored."""
    leaving()
    for env in envs.values():
        signal.alarm(math.ceil(spec.timeout))
        try:
            contract.close(env)
        except Retired:
            raise
        except BaseException as e:  # noqa: BLE001  (the user's close, sys.exit() too: the others still close)
            print(f"{spec.name}: an environment's close() raised {type(e).__name__}: {e}", file=sys.stderr)
    signal.alarm(math.ceil(STOP_GRACE))  # as leaving() set it


def _run(spec: EnvSpec, envs: dict, kind: str, key: Hashable,
         payload: Any) -> tuple[Any, str | None, Any, bool, bool]:
    """One call in a worker: ``(value, error, state, finishes)`` (:class:`EnvReply`'s) and whether its failure
    may pass on a retry (it raised, rather than broke the contract); a failed environment is dropped."""
    try:
        if kind == "open":
            row, seed = payload
            envs[key] = env = spec.build(row)
            prompt = contract.reset(env, seed=seed, row=row, max_turns=spec.max_turns)
            return prompt, None, _state(spec, env), contract.finishes(env), False
        if kind == "step":
            return contract.step(envs[key], payload, spec.observation_role), None, _state(spec, envs[key]), False, False
        if kind == "finish":  # get_reward may change what reward functions read of the environment
            return contract.finish(envs[key]), None, _state(spec, envs[key]), False, False
        env = envs.pop(key, None)
        if env is not None:
            contract.close(env)
        return None, None, None, False, False
    except contract.BadReturn as e:
        cause, transient = f"returned garbage: {e}", False
    except EnvError as e:  # a setup an adapter refuses: the same on every try
        cause, transient = f"raised {type(e).__name__}: {str(e)[:500]}", False
    except Retired:
        raise
    except BaseException as e:  # noqa: BLE001  (the user's environment: whatever it raises, sys.exit() and
        cause, transient = f"raised {type(e).__name__}: {str(e)[:500]}", True  # CancelledError too)
    _drop(envs, kind, key)
    return None, f"{kind} {cause}", None, False, transient


def _drop(envs: dict, kind: str, key: Hashable) -> None:
    """A failed call's environment is dropped and closed, so that a sandbox it started goes with it."""
    env = envs.pop(key, None)
    if env is not None and kind != "close":
        try:
            contract.close(env)
        except Retired:
            raise
        except BaseException:  # noqa: BLE001, S110  (its failure is the cause reported already)
            pass


def _state(spec: EnvSpec, env) -> Any:
    """A copy of ``env`` for the reward functions, if they take ``environments`` and it makes one (TRL's, a
    verifiers rollout's state). Raises where it needs one and none takes it (``unscored_alone``: why)."""
    if not spec.states and (why := getattr(env, "unscored_alone", None)):
        raise EnvError(why)
    make = getattr(env, "reward_state", None)
    return make() if spec.states and callable(make) else None


class EnvPool(WorkerPool):
    """``env.num_workers`` environment workers (see the module docstring). Use as a context manager, or
    call :meth:`close`: it stops every worker, each closing the environments it still holds."""

    _name = "env"
    _unfinished = "calls still unanswered"
    _main = staticmethod(_serve)

    def __init__(self, cfg: EnvConfig, spec: EnvSpec | None = None):
        self.spec = spec or EnvSpec.from_config(cfg)
        self._queues: list[collections.deque[_Call]] = [collections.deque() for _ in range(cfg.num_workers)]
        self._episodes: dict[Hashable, _Episode] = {}
        self.cfg = cfg
        self._start_timeout, self._loads = cfg.start_timeout, self.spec.name
        super().__init__(cfg.num_workers)

    # the caller's side

    def open_episode(self, key: Hashable, row: dict, seed: int) -> None:
        """Make episode ``key``'s environment for ``row`` and reset it with ``seed``; the reply's value is
        ``(prompt or None, info)``. The worker hosting the fewest episodes hosts it until it is closed."""
        with self._cond:
            if key in self._episodes:
                raise ValueError(f"episode {key!r} is open already")
            homes = collections.Counter(e.worker for e in self._episodes.values())
            worker = min(range(len(self._queues)), key=lambda i: (homes[i], i))
            self._episodes[key] = _Episode(worker, row.get("id"))
        self._submit(_Call(key, "open", (row, seed), self.cfg.timeout, row.get("id")))

    def step_episode(self, key: Hashable, action: str) -> None:
        """Step episode ``key``'s environment with ``action``; the reply's value is a ``StepResult``."""
        self._submit(self._call(key, "step", action))

    def finish_episode(self, key: Hashable) -> None:
        """Ask episode ``key``'s environment for its reward, a token limit having ended the episode (it
        :attr:`~rollpacker.env.contract.EnvReply.finishes`); the reply's value is a reward or None."""
        self._submit(self._call(key, "finish", None))

    def close_episode(self, key: Hashable) -> None:
        """Close episode ``key``'s environment (``close()`` if it has one) and forget the episode."""
        self._submit(self._call(key, "close", None))

    def _call(self, key: Hashable, kind: str, payload: Any) -> _Call:
        episode = self._episodes.get(key)
        if episode is None:
            raise ValueError(f"episode {key!r} is not open")
        return _Call(key, kind, payload, self.cfg.timeout, episode.row_id)

    def _submit(self, call: _Call) -> None:
        with self._cond:
            self._check_alive()
            episode = self._episodes[call.key]
            if call.kind == "close":  # an open waiting to be retried fails now, with its last error
                queue = self._queues[episode.worker]
                for waiting in [c for c in queue if c.key == call.key and c.attempt]:
                    queue.remove(waiting)  # tried ``attempt`` times, not one more
                    self._reply(replace(waiting, attempt=waiting.attempt - 1), error=waiting.error)
            episode.calls += 1
            self._num_unfinished += 1
            if episode.lost:  # its environment is gone: a step fails saying why, a close has nothing to do
                self._reply(call, error=episode.lost if call.kind != "close" else None)
            else:
                self._queues[episode.worker].append(call)
        self._wake()

    # the manager thread's side

    def _main_args(self) -> tuple:
        return (self.spec,)

    def _stop_grace(self, i: int) -> float:
        """A stopping worker closes the environments it holds, each within ``env.timeout`` (:func:`_close_all`)."""
        with self._cond:
            held = sum(not e.lost for e in self._episodes.values() if e.worker == i)
        return STOP_GRACE + held * self.cfg.timeout

    def _next_task(self, i: int) -> _Call | None:
        now, queue = time.monotonic(), self._queues[i]
        for k, call in enumerate(queue):  # a retried open waiting for its delay lets the calls behind it pass
            if call.ready_at <= now:
                del queue[k]
                return call
        return None

    def _timers(self) -> list[float]:
        now = time.monotonic()
        return [call.ready_at for queue in self._queues for call in queue if call.ready_at > now]

    def _wire(self, task: _Call) -> tuple:
        return task.kind, task.key, task.payload

    def _received(self, task: _Call, message: Any) -> None:
        value, error, seconds, state, finishes, transient = message
        with self._cond:
            cause = self._cause(task, error) if error else None
            if not (cause and transient and self._retried(task, cause)):
                self._reply(task, value, cause, seconds, state, finishes)

    def _retried(self, task: _Call, error: str) -> bool:
        """Queue a failed open again if ``env.reset_retries`` allows and nothing else waits on its episode (a
        close); False: it fails (holding ``_cond``)."""
        episode = self._episodes[task.key]
        if task.kind != "open" or task.attempt >= self.cfg.reset_retries or episode.calls > 1:
            return False
        ready_at = time.monotonic() + self.cfg.reset_retry_delay * 2 ** task.attempt
        self._queues[episode.worker].append(replace(task, attempt=task.attempt + 1, ready_at=ready_at, error=error))
        return True

    def _lost(self, i: int, task: _Call | None, reason: str, seconds: float, again: bool = True) -> None:
        """Worker ``i`` was killed: its running call fails with ``reason`` (an open may be retried, ``again``); every
        episode it hosted loses its environment (their queued and later steps fail saying so), but those
        whose open had not run yet: they wait for the fresh worker."""
        with self._cond:
            culprit = (self._cause(task, f"its {task.kind} call: {reason}") if task is not None  # a close may hang
                       else f"its {self._name} worker died ({reason})")
            queued, self._queues[i] = self._queues[i], collections.deque()
            unopened = {call.key for call in queued if call.kind == "open"}  # no environment yet: the fresh worker's
            spared = unopened | ({task.key} if task is not None else set())
            for key, episode in self._episodes.items():
                if episode.worker == i and not episode.lost and key not in spared:
                    episode.lost = (f"{self.spec.name}: the environment of episode {key!r} (row {episode.row_id!r}) "
                                    f"was lost with its worker, killed because {culprit}")
            if task is not None and not (again and self._retried(task, culprit)):
                self._reply(task, error=culprit, seconds=seconds)
            for call in queued:
                if call.key in unopened:
                    self._queues[i].append(call)
                else:
                    lost = self._episodes[call.key].lost
                    self._reply(call, error=lost if call.kind != "close" else None)

    def _reply(self, call: _Call, value: Any = None, error: str | None = None, seconds: float = 0.0,
               state: Any = None, finishes: bool = False) -> None:
        """Hand back the outcome of ``call`` (holding ``_cond``); a closed episode is forgotten."""
        episode = self._episodes[call.key]
        episode.calls -= 1
        if error and call.attempt:
            error = f"{error} (tried {call.attempt + 1} times, env.reset_retries {self.cfg.reset_retries})"
        if error:
            episode.lost = episode.lost or error
        if call.kind == "close" and not episode.calls:
            del self._episodes[call.key]
        self._done.append(EnvReply(call.key, call.kind, value, error, seconds, state, finishes, call.attempt))
        self._num_unfinished -= 1
        self._cond.notify_all()

    def _cause(self, call: _Call, error: str) -> str:
        return f"{self.spec.name}: episode {call.key!r} (row {call.row_id!r}): {error}"
