"""Stalled ranks are detected, never waited on forever.

Every process group gets a timeout from :class:`DistConfig` (a longer one until the first step
is done: model loading, first-step compilation), so a collective that a rank never joins raises
on the ranks that wait. Each rank also writes a heartbeat (time, step, phase) into the job's
TCPStore every second from a thread; a SIGSTOPped or wedged rank stops beating. When a timeout
fires, the error names this rank's step and phase and the ranks whose heartbeat went stale (or
never came), then the process exits non-zero so torchrun ``--max-restarts`` (or Slurm's requeue)
restarts the job. A phase that waits in one collective for long in normal operation (one_step_off's
hand-off, stream training's freed ranks, a checkpoint) runs under :func:`waiting`: its own timeout,
sized from the config, and a deadline at which the heartbeat thread prints the same diagnosis and
exits, before NCCL's watchdog, which aborts the process without a Python exception, would. The same
thread ends a rank whose launcher died: torchrun starts its ranks in
sessions of their own, so a SIGKILLed (or OOM-killed) torchrun would leave them training on into
the run directory beside the job that resumes there. Nothing here imports torch at module level:
:class:`DistConfig` is part of the config tree.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

BEAT_S = 1.0
"""Seconds between two heartbeats; a rank silent for 5 of them counts as not answering."""
GRACE_S = 30.0
"""Seconds a :func:`waiting` phase's collectives wait beyond its deadline: the diagnosis comes first."""


@dataclass(kw_only=True)
class DistConfig:
    timeout_s: float = 120.0
    """Seconds a collective waits for a rank before the job fails naming it (after the first step)."""
    first_step_timeout_s: float = 900.0
    """The same until the first step is done: model loading and first-step compilation take longer."""
    token_timeout_s: float = 0.25
    """Seconds per response token a rank may wait through a rollout (one_step_off's hand-off, stream training's
    freed ranks): rollout.max_new_tokens of them, at least dist.timeout_s."""
    checkpoint_timeout_s: float = 1800.0
    """Seconds a collective waits in a checkpoint save, load or Hugging Face export (a slow filesystem)."""
    device: Literal["auto", "cpu"] = "auto"
    """cpu: CPU and gloo even where a GPU is visible (as ROLLPACKER_DEVICE=cpu, which the test suite sets)."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout_s <= self.first_step_timeout_s:
            raise ValueError(f"dist.timeout_s={self.timeout_s} must be positive and at most "
                             f"dist.first_step_timeout_s={self.first_step_timeout_s}")
        if self.token_timeout_s <= 0 or self.checkpoint_timeout_s <= 0:
            raise ValueError(f"dist.token_timeout_s={self.token_timeout_s} and dist.checkpoint_timeout_s="
                             f"{self.checkpoint_timeout_s} must be positive")

    def rollout_wait_s(self, max_new_tokens: int) -> float:
        """How long a collective may wait through a rollout of ``max_new_tokens``-token responses."""
        return max(self.timeout_s, self.token_timeout_s * max_new_tokens)


_state = {"step": -1, "phase": "setup", "timeout": 0.0, "first": True, "deadline": 0.0}
_config: DistConfig | None = None
_stop = threading.Event()
_beats: list[threading.Thread] = []


def set_timeout(seconds: float, grace: float = 0.0) -> None:
    """Every process group's collectives (those built so far) wait at most ``seconds`` (+ ``grace``)."""
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    _state["timeout"] = seconds
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timedelta(seconds=seconds + grace), group)


@contextmanager
def waiting(name: str, seconds: float):
    """Phase ``name``, in which this rank may wait up to ``seconds`` in one collective: every group's
    timeout is ``seconds`` + :data:`GRACE_S` meanwhile, and at ``seconds`` the heartbeat thread prints
    the diagnosis (:func:`diagnose`) and exits non-zero, before a collective's own timeout (NCCL's
    aborts the process and prints none). Restores the phase, timeout and deadline it found."""
    before = _state["phase"], _state["timeout"], _state["deadline"]
    started = _config is not None
    if started:
        set_timeout(max(seconds, before[1]), GRACE_S)
    _state["phase"], _state["deadline"] = name, time.time() + max(seconds, before[1])
    try:
        yield
    finally:
        _state["phase"], _state["deadline"] = before[0], before[2]
        if started:
            set_timeout(before[1])


def start(config: DistConfig) -> None:
    """After the process groups exist: the first-step timeout, the heartbeat and the diagnosis of a timeout."""
    import signal

    global _config
    _config = config
    # a file-size limit (quota) then fails the write with EFBIG, reported like a full disk, instead of killing us
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    set_timeout(config.first_step_timeout_s)
    store = _store()
    if store is None:
        return
    rank = int(os.environ.get("RANK", "0"))
    _stop.clear()
    atexit.register(stop)  # a daemon thread inside a store call at interpreter exit aborts the process
    launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
    _beats.append(threading.Thread(target=_beat, args=(store, rank, launcher), daemon=True,
                                   name="rollpacker-heartbeat"))
    _beats[-1].start()
    previous = sys.excepthook

    def hook(kind, error, tb):
        if reported_elsewhere(rank):  # another rank printed a user error and left: nothing to add
            os._exit(1)
        previous(kind, error, tb)
        if _is_timeout(error):  # in a thread: a store hosted by a stopped rank 0 may never answer
            report = threading.Thread(target=lambda: print(f"rollpacker: {diagnose(rank)}", file=sys.stderr,
                                                           flush=True), daemon=True)
            report.start()
            report.join(timeout=20)
            if report.is_alive():
                print(f"rollpacker: rank {rank} timed out after {_state['timeout']:g}s at step {_state['step']}, "
                      f"phase {_state['phase']}; the heartbeat store (hosted by rank 0 or torchrun) did not answer "
                      "either: rank 0 or the launcher is stalled", file=sys.stderr, flush=True)
        sys.stderr.flush()
        os._exit(1)  # never linger in a half-dead process group: torchrun sees the failure now

    sys.excepthook = hook


def at_step(step: int, phase: str = "step") -> None:
    """The loop reached ``step``; after the first step is done, collectives get ``dist.timeout_s``."""
    if _config and _state["first"] and _state["step"] >= 0 and step > _state["step"]:
        _state["first"] = False
        set_timeout(_config.timeout_s)
    _state["step"] = step
    _state["phase"] = phase


def phase(name: str) -> None:
    """This rank's current phase (rollout, train, weight_sync, checkpoint, ...), reported on a timeout."""
    _state["phase"] = name


def _key(rank: int) -> str:
    return f"rollpacker/heartbeat/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _report_key() -> str:
    return f"rollpacker/reported/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def claim_report(rank: int) -> bool:
    """Whether this rank is the first to report a user error (always, outside torchrun or if the store is gone)."""
    try:
        store = _store()
        return store is None or store.compare_set(_report_key(), "", str(rank)).decode() == str(rank)
    except Exception:  # the store's host went first: print rather than say nothing
        return True


def reported_elsewhere(rank: int) -> bool:
    """Whether another rank reported a user error (then this rank's failure is its echo)."""
    try:
        store = _store()
        return store is not None and store.check([_report_key()]) and store.get(_report_key()).decode() != str(rank)
    except Exception:
        return False


def _store():
    """A client of the job's TCPStore (torchrun's MASTER_ADDR:MASTER_PORT), or None outside torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or "MASTER_PORT" not in os.environ:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=10), wait_for_workers=False)


def stop() -> None:
    """The heartbeat stops and its thread is joined."""
    _stop.set()
    while _beats:
        _beats.pop().join(timeout=30)


def _beat(store, rank: int, launcher: int | None) -> None:
    while not _stop.is_set():
        if launcher is not None and os.getppid() != launcher:  # reparented: torchrun is gone
            print(f"rollpacker: rank {rank}: its launcher (torchrun, pid {launcher}) died at step {_state['step']}, "
                  f"phase {_state['phase']}; exiting", file=sys.stderr, flush=True)
            os._exit(1)
        if _state["deadline"] and time.time() > _state["deadline"]:  # a waiting() phase overran: say who, then go
            print(f"rollpacker: {diagnose(rank)}", file=sys.stderr, flush=True)
            os._exit(1)
        try:
            store = store or _store()
            store.set(_key(rank), json.dumps({"t": time.time(), "step": _state["step"], "phase": _state["phase"]}))
        except Exception:  # a busy machine or a restarting store: a new client at the next beat
            store = None
        _stop.wait(BEAT_S)


def diagnose(rank: int) -> str:
    """What a rank that timed out knows: its step and phase, and the ranks that stopped answering."""
    from datetime import timedelta

    where = f"rank {rank} timed out after {_state['timeout']:g}s at step {_state['step']}, phase {_state['phase']}"
    silent = []
    try:
        store = _store()
        store.set_timeout(timedelta(seconds=3))
        now = time.time()
        for r in range(int(os.environ["WORLD_SIZE"])):
            try:
                beat = json.loads(store.get(_key(r)))
            except Exception:
                silent.append((r, "no heartbeat at all"))
                continue
            if now - beat["t"] > 5 * BEAT_S:
                silent.append((r, f"last heartbeat {now - beat['t']:.0f}s ago, at step {beat['step']}, "
                                  f"phase {beat['phase']}"))
    except Exception as e:  # the store lives in rank 0 (or torchrun's agent): it may be the one stalled
        return (f"{where}; the heartbeat store did not answer either ({type(e).__name__}): rank 0 or the launcher "
                "is stalled")
    if not silent:
        return f"{where}; every rank's heartbeat is live: a slow collective, raise dist.timeout_s"
    who = "; ".join(f"rank {r}: {why}" for r, why in silent)
    return (f"{where}: rank(s) {[r for r, _ in silent]} did not answer ({who}). Exiting non-zero so torchrun "
            "--max-restarts or Slurm's requeue restarts the job (--resume auto)")


def _is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return any(s in text for s in ("timed out", "timeout", "connection closed by peer", "connection reset by peer"))
