"""Stalled ranks are detected, never waited on forever.

Every process group gets a timeout from :class:`DistConfig`, longer until the first step is done.
Each rank writes a heartbeat (time, step, phase, when its main thread last moved) into the job's
TCPStore every second. When a timeout fires, one line names this rank's step and phase and the ranks
whose heartbeat went stale, then the process exits non-zero so that torchrun (or Slurm) restarts the job.

Invariants:

- A phase that waits long in normal operation runs under :func:`waiting`: a deadline (a checkpoint's) or,
  while the ranks it waits on work (one pool for the other, freed ranks for the round), none: the
  heartbeat thread prints the diagnosis and exits once one of them stops beating or moving, before NCCL
  would abort.
- No store call waits without a deadline (``STORE_WAIT_S``); a silent store names its host.
- A rank whose launcher died ends too.
- A rank ends at once (:func:`exit_at_once`: no lingering in a half-dead group), yet leaves nothing behind for
  good: what must not outlive it (SGLang's files in /dev/shm) is registered with :func:`at_every_exit`.
- Nothing here imports torch at module level: :class:`DistConfig` is part of the config tree.

Why: a stalled rank otherwise hangs the whole job with no message. The timeouts and messages:
``docs/cluster-and-faults.md`` (A rank stalls).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Literal, NoReturn

BEAT_S = 1.0
"""Seconds between two heartbeats; a rank silent for 5 of them counts as not answering."""
STORE_WAIT_S = 5.0
"""Seconds a store call of the error path may take before its host counts as stalled."""
GRACE_S = 30.0
"""Seconds a :func:`waiting` phase's collectives wait beyond its deadline: the diagnosis comes first."""
CHECK_S = 5.0
"""Seconds between two reads of the job's heartbeats by a rank waiting on working ranks."""


@dataclass(kw_only=True)
class DistConfig:
    timeout_s: float = 120.0
    """Seconds a collective waits for a rank before the job fails naming it (after the first step)."""
    first_step_timeout_s: float = 900.0
    """The same until the first step is done: model loading and first-step compilation take longer."""
    checkpoint_timeout_s: float = 1800.0
    """Seconds a collective waits in a checkpoint save, load or Hugging Face export (a slow filesystem)."""
    device: Literal["auto", "cpu"] = "auto"
    """cpu: CPU and gloo even where a GPU is visible (as ROLLPACKER_DEVICE=cpu, which the test suite sets)."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= self.first_step_timeout_s:
            raise ValueError(f"dist.timeout_s={self.timeout_s} must be positive and at most "
                             f"dist.first_step_timeout_s={self.first_step_timeout_s}")
        if self.checkpoint_timeout_s <= 0:
            raise ValueError(f"dist.checkpoint_timeout_s={self.checkpoint_timeout_s} must be positive")


LIVE_WAIT_S = 86400.0
"""A collective's own timeout while its rank waits on working ranks (:func:`waiting` without a deadline): the
heartbeat thread's liveness check ends the wait first."""

_state = {"step": -1, "phase": "setup", "timeout": 0.0, "first": True, "deadline": 0.0, "sent": float("inf"),
          "moved": time.time(), "waits": 0.0, "checked": 0.0}
"""This rank's step and phase, its collectives' timeout, a :func:`waiting` phase's deadline, when its last
heartbeat got through, when its main thread last moved (:func:`progress`), since when it waits on working
ranks (0: it does not), and when that wait last read their heartbeats."""
_config: DistConfig | None = None
_stop = threading.Event()
_threads: list[threading.Thread] = []
"""The heartbeat thread, then its last sender."""


def set_timeout(seconds: float, grace: float = 0.0) -> None:
    """Every process group's collectives (those built so far) wait at most ``seconds`` (+ ``grace``)."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    _state["timeout"] = seconds
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(seconds=seconds + grace), group)


@contextmanager
def waiting(name: str, seconds: float | None = None):
    """Phase ``name``, in which this rank may wait long in one collective, and the diagnosis comes before NCCL's
    timeout (which aborts the process and prints none).

    With ``seconds`` (at least the step's timeout): every group's timeout is ``seconds`` + :data:`GRACE_S`, and
    at ``seconds`` the heartbeat thread prints the diagnosis (:func:`diagnose`) and exits non-zero. Without: the
    wait lasts as long as the ranks it waits on work (:func:`stalled`, read every :data:`CHECK_S`); its
    collectives' own timeout is :data:`LIVE_WAIT_S`. Restores the phase (unless it raised) and deadline it found,
    and the timeout (the step's, which :func:`at_step` may have changed meanwhile, outside another such phase)."""
    before = _state["phase"], _state["timeout"], _state["deadline"], _state["waits"]
    started = _config is not None
    if seconds is not None:  # never shorter than the step's own timeout (the first step's is long)
        seconds = max(seconds, _step_timeout() if started else 0.0)
    if started:
        set_timeout(LIVE_WAIT_S if seconds is None else seconds, GRACE_S)
    _state["phase"] = name
    _state["deadline"] = 0.0 if seconds is None else time.time() + seconds
    _state["waits"], _state["checked"] = 0.0 if seconds is not None else time.time(), time.time()
    failed = True
    try:
        yield
        failed = False
    finally:  # a failure keeps the phase (the innermost's): the diagnosis names where the collective failed
        _state["phase"] = _state["phase"] if failed else before[0]
        _state["deadline"], _state["waits"] = before[2], before[3]
        if started:
            set_timeout(before[1] if before[2] or before[3] else _step_timeout())
        progress()


def progress() -> None:
    """This rank's main thread moved (a poll of the round, a micro-batch, a phase): ranks waiting on it wait on."""
    _state["moved"] = time.time()


def start(config: DistConfig) -> None:
    """After the process groups exist: the first-step timeout, the heartbeat and the diagnosis of a timeout."""
    import signal

    global _config
    _config = config
    # a file-size limit (quota) then fails the write with EFBIG, reported like a full disk, instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    set_timeout(config.first_step_timeout_s)
    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
    if _threads or not (_store_address() or launcher):  # a second job in this process (tests): it beats already
        return
    rank = int(os.environ.get("RANK", "0"))
    import torch.distributed as dist

    if dist.is_initialized():  # one attempt number for every rank's keys (collective)
        agreed = [os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")]
        dist.broadcast_object_list(agreed, src=0)
        _state["attempt"] = agreed[0]
    _stop.clear()
    atexit.register(stop)  # a daemon thread inside a store call at interpreter exit aborts the process
    # one rank under torchrun has no store to beat to, but still exits with its launcher
    _threads.insert(0, threading.Thread(target=_beat, args=(rank, launcher), daemon=True, name="rollpacker-heartbeat"))
    _threads[0].start()
    if not _store_address():
        return
    previous = sys.excepthook

    def hook(kind, error, tb):
        if error_reported():  # a rank of this node reported an error to the launcher and left
            exit_at_once(1)
        what = _fault(error)
        view = _read_view()
        if view and view[0] not in ("", str(rank)):  # another rank printed a user error and left: nothing to add
            exit_at_once(1)
        if what:  # a fault, diagnosed: one line, no traceback
            print(f"rollpacker: {diagnose(rank, what, view[1] if view else None)} ({type(error).__name__}: "
                  f"{_first_line(error)})", file=sys.stderr, flush=True)
        else:
            previous(kind, error, tb)
        exit_at_once(1)  # never linger in a half-dead process group: torchrun sees the failure now

    sys.excepthook = hook


def at_step(step: int, phase: str = "step") -> None:
    """The loop reached ``step``; after the first step is done, collectives get ``dist.timeout_s`` (also
    those of groups built since, a new rollout TP's: they would get the process group default, 30 min)."""
    if _config and _state["first"] and _state["step"] >= 0 and step > _state["step"]:
        _state["first"] = False
    if _config:
        set_timeout(_step_timeout())
    _state["step"] = step
    _state["phase"] = phase
    progress()


def _step_timeout() -> float:
    """A collective's timeout outside :func:`waiting` phases: longer until the first step is done."""
    return _config.first_step_timeout_s if _state["first"] else _config.timeout_s


def step() -> int:
    """The step this rank is at (-1 before the loop)."""
    return _state["step"]


def phase(name: str) -> None:
    """This rank's current phase (rollout, train, weight_sync, checkpoint, ...), reported on a timeout."""
    _state["phase"] = name
    progress()


def _attempt() -> str:
    """The group's torchrun attempt: rank 0's, as :func:`start` agreed it (torchrun counts a restart only on the
    node that failed, so the others' TORCHELASTIC_RESTART_COUNT lags); this node's count before."""
    return _state.get("attempt") or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def _key(rank: int) -> str:
    return f"rollpacker/heartbeat/{_attempt()}/{rank}"


def _report_key() -> str:
    return f"rollpacker/reported/{_attempt()}"


def _bounded(call, default):
    """``call()``, run in a thread of its own; ``default`` if it raised or did not return within
    STORE_WAIT_S (the store's host is stalled)."""
    box = []

    def run():
        try:
            box.append(call())
        except Exception:  # noqa: BLE001  (a store gone or restarting: the default says what to do)
            pass

    thread = threading.Thread(target=run, daemon=True, name="rollpacker-store-call")
    thread.start()
    thread.join(STORE_WAIT_S)
    return box[0] if box else default


def claim_report(rank: int) -> bool:
    """Whether this rank is the first to report a user error (always, outside torchrun or if the store is gone).
    Before the job's store is up (rank 0 hosts it, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), each node's first rank:
    a config error is the same on every rank of a node, not always on every node (a node-local model.path)."""
    if _config is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return int(os.environ.get("LOCAL_RANK", rank)) == 0

    def claim():
        store = _store()
        return store is None or store.compare_set(_report_key(), "", str(rank)).decode() == str(rank)

    return _bounded(claim, True)  # the store's host went first: print rather than say nothing


def store_host() -> str:
    """Who hosts the job's store: torchrun's agent, or (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) rank 0."""
    return "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"


def _store():
    """A client of the job's TCPStore (torchrun's MASTER_ADDR:MASTER_PORT), or None outside torchrun."""
    if not _store_address():
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=10), wait_for_workers=False)


def stop() -> None:
    """The heartbeat stops and its threads are joined."""
    _stop.set()
    while _threads:
        _threads.pop().join(timeout=30)


def _beat(rank: int, launcher: int | None) -> None:
    """Every BEAT_S: exit if the launcher died; send this rank's heartbeat, in a thread of its own (a
    stalled store host never answers), unless the last one has not returned yet."""
    sending = None
    while not _stop.is_set():
        if launcher is not None and os.getppid() != launcher:  # reparented: torchrun is gone
            if os.environ.get("LOCAL_RANK", "0") == "0":  # its node's ranks all see it: one says so
                print(f"rollpacker: rank {rank}: its launcher (torchrun, pid {launcher}) died at step "
                      f"{_state['step']}, phase {_state['phase']}; its node's ranks exit", file=sys.stderr, flush=True)
            exit_at_once(1)
        if _state["deadline"] and time.time() > _state["deadline"]:  # a waiting() phase overran: say who, then go
            print(f"rollpacker: {diagnose(rank, '', _heartbeats())}", file=sys.stderr, flush=True)
            exit_at_once(1)
        if _state["waits"] and time.time() - _state["checked"] >= CHECK_S:  # waiting on working ranks: are they?
            _state["checked"] = time.time()
            _check_wait(rank)
        if _store_address() and (sending is None or not sending.is_alive()):
            sending = threading.Thread(target=_send_beat, args=(rank,), daemon=True, name="rollpacker-beat-send")
            sending.start()
            _threads.append(sending)
            del _threads[1:-1]  # the heartbeat thread and its last sender
        _stop.wait(BEAT_S)


_client: list = []
"""The heartbeat's store client, made on first use, dropped on an error."""


def _send_beat(rank: int) -> None:
    if error_reported():  # its rank 0 may be gone with the store: no failed send to log
        return
    try:
        _client[:] = _client or [_store()]
        _client[0].set(_key(rank), json.dumps({"t": time.time(), "step": _state["step"], "phase": _state["phase"],
                                                   "moved": _state["moved"],
                                                   "waits": bool(_state["waits"] or _state["deadline"])}))
        _client[0].check([_key(rank)])  # a set is not answered; this is: the store's host is alive
        _state["sent"] = time.time()
    except Exception:  # noqa: BLE001  (a busy machine or a restarting store: a new client at the next beat)
        _client.clear()


def _check_wait(rank: int) -> None:
    """In a :func:`waiting` phase without a deadline: the diagnosis and exit once :func:`stalled` says so, or
    once the store (its host) has not answered for a collective timeout; quietly if a rank reported an error."""
    view, now = _read_view(), time.time()
    bound = _step_timeout()
    if view is None and now - max(_state["sent"], _state["waits"]) > bound:
        waited = now - _state["waits"]
        print(f"rollpacker: {diagnose(rank, f'waited {waited:.0f}s', None)}", file=sys.stderr, flush=True)
        exit_at_once(1)
    if view and view[0] not in ("", str(rank)):  # another rank printed a user error and left: nothing to add
        exit_at_once(1)
    why = stalled(rank, view[1], now, bound + 5 * BEAT_S) if view else None  # a heartbeat is up to 5 beats old
    if why:
        print(f"rollpacker: {why}", file=sys.stderr, flush=True)
        exit_at_once(1)


_AT_ONCE: list[Callable[[], None]] = []
"""What :func:`exit_at_once` runs."""


def at_every_exit(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` at this process's exit, :func:`exit_at_once` included, which runs no other exit handler:
    for what the process would otherwise leave behind for good (its files in /dev/shm). It must be quick and safe
    from any thread, as the watchdog's thread may exit while the main one waits in a collective."""
    atexit.register(cleanup)
    _AT_ONCE.append(cleanup)
    return cleanup


def exit_at_once(code: int) -> NoReturn:
    """Leave now, never lingering in a half-dead process group: :func:`at_every_exit`'s cleanups, the output
    flushed, then out without the other exit handlers (logging's, wandb's, a process group's) and teardown."""
    for done in [*_AT_ONCE, sys.stdout.flush, sys.stderr.flush]:  # a launcher gone: its pipe broken, no matter
        with suppress(Exception):
            done()
    os._exit(code)


def stalled(rank: int, beats: dict[int, dict | None], now: float, bound: float) -> str | None:
    """Why this rank's wait on working ranks ends (None: it waits on), from the other ranks' heartbeats: one
    stopped beating (:func:`diagnose`), one working (not waiting itself) did not move for ``bound`` seconds
    (a collective timeout), or all of them wait and none moved for as long."""
    what = f"waited {now - _state['waits']:.0f}s"
    beats = {r: b for r, b in beats.items() if r != rank}  # its own is older than what it knows
    if any(b is None or now - b["t"] > 5 * BEAT_S for b in beats.values()):
        return diagnose(rank, what, beats)
    working = {r: b for r, b in beats.items() if not b["waits"]}
    stuck = [r for r, b in (working or beats).items() if now - b["moved"] > bound]
    if not stuck or (not working and len(stuck) < len(beats)):
        return None
    who = "; ".join(f"rank {r}: step {beats[r]['step']}, phase {beats[r]['phase']}, last moved "
                    f"{now - beats[r]['moved']:.0f}s ago" for r in stuck)
    why = f"rank(s) {stuck} beat but did not move for over {bound:g}s" if working else "every rank waits on another"
    return (f"rank {rank} {what} at step {_state['step']}, phase {_state['phase']}: {why} ({who}): a hang. Exiting "
            "non-zero so torchrun --max-restarts or Slurm's requeue restarts the job (--resume auto)")


def _job_view() -> tuple[str, dict[int, dict | None]]:
    """From the store: the rank that reported a user error ("": none), and every rank's last heartbeat
    (None: none yet)."""
    from datetime import timedelta

    store = _store()
    store.set_timeout(timedelta(seconds=STORE_WAIT_S))
    reported = store.get(_report_key()).decode() if store.check([_report_key()]) else ""
    keys = [_key(r) for r in range(int(os.environ["WORLD_SIZE"]))]
    return reported, {r: json.loads(store.get(k)) if store.check([k]) else None for r, k in enumerate(keys)}


def _read_view() -> tuple[str, dict[int, dict | None]] | None:
    """:func:`_job_view`, in one bounded store visit; None when the store does not answer (at once if the
    heartbeat's sends stopped getting through)."""
    silent = time.time() - _state["sent"] > STORE_WAIT_S
    return None if silent else _bounded(_job_view, None)


def _heartbeats() -> dict[int, dict | None] | None:
    view = _read_view()
    return view[1] if view else None


def diagnose(rank: int, what: str, beats: dict[int, dict | None] | None) -> str:
    """What a rank whose collective failed or whose :func:`waiting` phase overran knows (``what``
    happened, :func:`_fault`'s; "" for a timeout): its step and phase, and the ranks that stopped
    answering, from every rank's heartbeat (``beats``: None when the store did not answer)."""
    what = what or f"timed out after {_state['timeout']:g}s"
    where = f"rank {rank} {what} at step {_state['step']}, phase {_state['phase']}"
    if beats is None and what.startswith("lost"):
        return f"{where}: {store_host()}, the job's store's host, is gone too (its error is above, or it was killed)"
    if beats is None:  # the store's host may be the one stalled
        host = store_host()
        silent = max(time.time() - _state["sent"], STORE_WAIT_S)  # since its last answer to this rank
        return (f"{where}: {host} did not answer either (it hosts the job's store, silent for {silent:.0f}s): "
                f"{host} is stalled. Exiting non-zero so torchrun --max-restarts or Slurm's requeue restarts the "
                "job (--resume auto)")
    now, silent = time.time(), []
    for r, beat in beats.items():
        if beat is None:
            silent.append((r, "no heartbeat at all"))
        elif now - beat["t"] > 5 * BEAT_S:
            silent.append((r, f"last heartbeat {now - beat['t']:.0f}s ago, at step {beat['step']}, "
                              f"phase {beat['phase']}"))
    if not silent and what.startswith("lost"):
        return f"{where}: another rank exited (its error is above, or it was killed); exiting too"
    if not silent:
        return f"{where}; every rank's heartbeat is live: a slow collective, raise dist.timeout_s"
    who = "; ".join(f"rank {r}: {why}" for r, why in silent)
    return (f"{where}: rank(s) {[r for r, _ in silent]} did not answer ({who}). Exiting non-zero so torchrun "
            "--max-restarts or Slurm's requeue restarts the job (--resume auto)")


ERROR_FILE = "ROLLPACKER_ERROR_FILE"
"""The environment variable naming the ``rollpacker`` launcher's file for the job's one error line."""


def error_file() -> str:
    """Where this attempt's ranks of this node report to the ``rollpacker`` launcher ("" outside it): one file per
    torchrun attempt, so that an error of a failed attempt neither outlives its restart nor silences the next."""
    base = os.environ.get(ERROR_FILE, "")
    return base and f"{base}.{_attempt()}"


def error_reported() -> bool:
    """Whether a rank of this node reported an error to the ``rollpacker`` launcher (rollpacker.errors)."""
    path = error_file()
    return bool(path) and os.path.exists(path)


def _store_address() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_PORT" in os.environ


def _first_line(error: BaseException) -> str:
    """The error's first line without a C++ source location (gloo's ``[path/pair.cc:534] ...``)."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*", "", lines[0])[:200] if lines else ""


def _fault(error: BaseException) -> str | None:
    """What a failed collective's ``error`` says happened to the job, or None (not a fault: a bug, or an error of
    ours that says itself, as a reward worker's start timeout)."""
    import torch.distributed as dist

    if not isinstance(error, dist.DistError) and type(error) is not RuntimeError:  # c10d's, or a plain C++ one
        return None
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return f"timed out after {_state['timeout']:g}s"
    if "connection closed by peer" in text or "connection reset by peer" in text:
        return "lost its connection to another rank"
    return None
