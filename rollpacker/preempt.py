"""Stop cleanly: at a step boundary, with a checkpoint, when asked to.

SIGUSR1 (Slurm's warning before the time limit, ``#SBATCH --signal=B:USR1@120``, forwarded to every
process of the job step by ``launch/slurm/train.sbatch``), SIGTERM (scancel, preemption,
``scontrol requeue``, torchrun passing on its own) and SIGINT (Ctrl-C) only set a flag here. The
training loop reads rank 0's flag at the next step boundary, broadcast with its other per-step
decision so that every rank stops after the same step, saves a checkpoint and exits 0: a clean
stop, which torchrun must not restart; the job script requeues the job and ``--resume auto``
picks the checkpoint up. The reward workers ignore these signals (the signal reaches them too),
so the step in progress is scored by live workers. A second SIGINT aborts at once: the step in
progress is lost, and a checkpoint being written stays uncommitted, which resume skips.

The handlers are installed before the job is built (Python's rule: from the main thread), so a
stop during setup stops before the first step.
"""

from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
_received: signal.Signals | None = None
_interrupts = 0


def install() -> None:
    """From now on SIGUSR1/SIGTERM/SIGINT ask for a stop at the next step boundary instead of killing."""
    for sig in SIGNALS:
        signal.signal(sig, _note)


def _note(signum: int, frame) -> None:
    global _received, _interrupts
    from rollpacker import watchdog

    rank0 = os.environ.get("RANK", "0") == "0"
    where = f"step {max(watchdog.step(), 0)}"
    if signum == signal.SIGINT:
        _interrupts += 1
        if _interrupts > 1:
            _say(rank0, f"rollpacker: stopped at once on a second Ctrl-C at {where}: that step is lost, and a "
                        "checkpoint being written stays uncommitted; --resume auto resumes from the newest "
                        "committed checkpoint")
            os._exit(130)
    if _received is None:  # the first one says why (a requeue's SIGTERM may come with the script's USR1)
        _received = signal.Signals(signum)
        again = " (Ctrl-C again to stop at once, losing it)" if signum == signal.SIGINT else ""
        _say(rank0, f"rollpacker: {_received.name}: stopping after {where} with a checkpoint{again}")


def _say(rank0: bool, line: str) -> None:
    if rank0:  # every rank gets the signal: one says it; os.write is safe in a signal handler, print is not
        os.write(2, (line + "\n").encode())


def requested() -> str | None:
    """The name of the first stop signal received (``"SIGUSR1"``), or None."""
    return _received.name if _received else None
