"""Stop cleanly: at a step boundary, with a checkpoint, when asked to.

SIGUSR1 (Slurm's warning before the time limit, ``#SBATCH --signal=B:USR1@120``, forwarded to every
process of the job step by ``launch/slurm/train.sbatch``), SIGTERM (scancel, preemption,
``scontrol requeue``, torchrun passing on its own) and SIGINT (Ctrl-C) only set a flag here. The
training loop reads every rank's flag at the next step boundary (:func:`requested_anywhere`: one
node's torchrun, stopped alone, signals its own ranks only), so that every rank stops after the
same step, saves a checkpoint and exits 0: a clean stop, which torchrun must not restart; the job
script requeues the job and ``--resume auto`` picks the checkpoint up. The reward workers ignore
these signals (the signal reaches them too), so the step in progress is scored by live workers. A
second SIGINT aborts at once: the step in progress is lost, and a checkpoint being written stays
uncommitted, which resume skips.

"At once" holds while the main thread is inside a long C call (a collective, a checkpoint
write), where Python runs no signal handler and two signals of one kind merge into one: Python's
own C-level handler writes each signal's number to a wakeup pipe
(:func:`signal.set_wakeup_fd`), and a thread here reads them. The handlers are installed before
the job is built (Python's rule: from the main thread), so a stop during setup stops before the
first step; one the launcher got before they were installed is in its stop file (:data:`STOP_FILE`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Installed in this order: SIGUSR1, caught by nothing before, last (the launcher reads it caught as installed)."""
STOP_FILE = "ROLLPACKER_STOP_FILE"
"""The launcher's file of the first stop signal it got, for the ranks whose handlers were not in yet (a signal then
would have killed them, and torchrun restarted them): :func:`install` reads it."""
_received: signal.Signals | None = None
_watcher: threading.Thread | None = None
_wakeup: int | None = None  # the pipe's write end
_lock = threading.RLock()  # a handler may interrupt itself in the main thread


def install() -> None:
    """From now on SIGUSR1/SIGTERM/SIGINT ask for a stop at the next step boundary instead of killing.
    Again once the engines are up: an asyncio loop's signal handler (SGLang's) takes the wakeup pipe over,
    and leaves none when it is removed."""
    global _watcher, _wakeup
    for sig in SIGNALS:
        signal.signal(sig, _note)
    if _watcher is None:
        read, _wakeup = os.pipe()
        os.set_blocking(_wakeup, False)
        _watcher = threading.Thread(target=_watch, args=(read,), daemon=True, name="rollpacker-stop-signals")
        _watcher.start()
        _asked_before()
    signal.set_wakeup_fd(_wakeup, warn_on_full_buffer=False)


def _asked_before() -> None:
    """The launcher's stop file, read under its lock once the handlers are in: its signal as if received (the watcher
    counts it: a second Ctrl-C stops at once), unless the launcher signalled this rank too (it names the ranks it
    signalled, those whose handlers were in, under the same lock)."""
    path = os.environ.get(STOP_FILE)
    if not path:
        return
    with contextlib.suppress(OSError, ValueError), open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        asked, *signalled = map(int, f.read().split())
        if asked in SIGNALS and os.getpid() not in signalled:
            os.write(_wakeup, bytes([asked]))


def _note(signum: int, frame) -> None:
    """The Python-level handler: a stop signal does not kill (the watcher thread keeps the count)."""
    _seen(signum)


def _watch(read: int) -> None:
    interrupts = 0
    while data := os.read(read, 64):
        for signum in data:
            if signum not in SIGNALS:
                continue
            interrupts += signum == signal.SIGINT
            if interrupts > 1:
                from rollpacker import watchdog

                _say(f"rollpacker: stopped at once on a second Ctrl-C at step {max(watchdog.step(), 0)}: that step "
                     "is lost, and a checkpoint being written stays uncommitted; --resume auto resumes from the "
                     "newest committed checkpoint")
                watchdog.exit_at_once(130)
            _seen(signum)


def _seen(signum: int) -> None:
    global _received
    from rollpacker import watchdog

    with _lock:  # the watcher and the handler both see each signal
        if _received is not None:  # the first one says why (a requeue's SIGTERM may come with the script's USR1)
            return
        _received = signal.Signals(signum)
        step = watchdog.step()
        again = "" if signum != signal.SIGINT else (" (Ctrl-C again to stop at once, losing it)" if step >= 0 else
                                                    " (Ctrl-C again to stop at once)")
        when = (f"after step {step} with a checkpoint" if step >= 0 else
                "before the first step (still starting: nothing to save)")
        if not watchdog.error_reported():  # a rank failed first: torchrun's teardown signals the rest, no stop
            _say(f"rollpacker: {_received.name}: stopping {when}{again}")


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # every rank gets the signal: one says it
        os.write(2, (line + "\n").encode())


def requested() -> str | None:
    """The name of the first stop signal received (``"SIGUSR1"``), or None."""
    return _received.name if _received else None


def requested_anywhere(meshes) -> str | None:
    """Collective over ``meshes``' control plane (every rank): the stop signal of the lowest rank that
    received one, or None."""
    import torch.distributed as dist

    names = [None] * dist.get_world_size(meshes.control)
    dist.all_gather_object(names, requested(), group=meshes.control)
    return next(filter(None, names), None)
