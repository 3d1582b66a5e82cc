"""Stop cleanly before Slurm kills the job.

SIGUSR1 (Slurm's warning before the time limit, ``#SBATCH --signal=B:USR1@120``, forwarded to every
process of the job step by ``launch/slurm/train.sbatch``) or SIGTERM (scancel, preemption,
``scontrol requeue``) only sets a flag here. The training loop reads rank 0's flag at the next step
boundary, broadcast with its other per-step decision so that every rank stops after the same step,
saves a checkpoint and exits 0: a clean stop, which torchrun must not restart; the job script
requeues the job and ``--resume auto`` picks the checkpoint up. Only the main thread may install
handlers (Python's rule); torchrun's own handler sends the signal on to the workers.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received: signal.Signals | None = None


def install() -> None:
    """From now on SIGUSR1/SIGTERM ask for a stop at the next step boundary instead of killing."""
    for sig in SIGNALS:
        signal.signal(sig, _note)


def _note(signum: int, frame) -> None:
    global _received
    if _received is None:  # the first one says why (a requeue's SIGTERM may come with the script's USR1)
        _received = signal.Signals(signum)


def requested() -> str | None:
    """The name of the first stop signal received (``"SIGUSR1"``), or None."""
    return _received.name if _received else None
