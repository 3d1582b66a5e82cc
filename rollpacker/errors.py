"""Errors a user can fix, and how the job reports one: once, without a traceback.

A :class:`UserError` is a problem in what the user gave the job: a data file or row, a reward
function, a model directory, a checkpoint. Its message names what and where, and the fix. The
entry point (:mod:`rollpacker.run`) prints it once and exits non-zero. Any other exception is a bug
and keeps its traceback.

Under torchrun the rank that meets the error claims the report in the job's store
(:func:`rollpacker.watchdog.claim_report`); the first claimant prints. The other ranks are left
waiting in a collective with the rank that exited. The collective fails, and
:mod:`rollpacker.watchdog`'s exception hook sees the claim and exits quietly.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


class UserError(Exception):
    """Bad input the user can fix; the message names what, where and the fix."""


def fail(error: BaseException, prefix: str = "rollpacker: ") -> NoReturn:
    """Print ``error`` once for the whole job (the first rank to claim it) and exit 1 at once."""
    from rollpacker import watchdog

    if watchdog.claim_report(int(os.environ.get("RANK", "0"))):
        print(f"{prefix}{error}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)  # never linger in a half-dead process group: the others see this rank leave
