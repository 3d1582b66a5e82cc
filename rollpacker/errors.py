"""Errors a user can fix, and how the job reports one: once, without a traceback, in the flags' spelling.

A :class:`UserError` is a problem in what the user gave the job: a data file or row, a reward
function, a model directory, a checkpoint. Its message names what and where, and the fix. The
entry point (:mod:`rollpacker.run`) reports it with :func:`fail` and exits non-zero. Any other
exception is a bug and keeps its traceback.

Under torchrun the rank that meets the error claims the report in the job's store
(:func:`rollpacker.watchdog.claim_report`); the first claimant reports. The other ranks are left
waiting in a collective with the rank that exited. The collective fails, and
:mod:`rollpacker.watchdog`'s exception hook sees the claim and exits quietly. Under the
``rollpacker`` launcher (:mod:`rollpacker.launch`) the first claimant writes the line to the
launcher's file instead, and the launcher prints it after torchrun is done: the last line.

A message names settings as config paths (``data.eval_path``); the entry point writes them as the
flags the user typed (``--data.eval-path``, :func:`rollpacker.config.as_flags`) before reporting.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


class UserError(Exception):
    """Bad input the user can fix; the message names what, where and the fix."""


def fail(error: BaseException | str, prefix: str = "rollpacker: ", exit_code: int = 1) -> NoReturn:
    """Report ``error`` once for the whole job (:func:`report`) and exit at once."""
    from rollpacker.watchdog import exit_at_once

    report(error, prefix)
    exit_at_once(exit_code)  # the others see this rank leave


def report(error: BaseException | str, prefix: str = "rollpacker: ") -> None:
    """Say ``error`` once for the whole job: by the first rank to claim it, or through the launcher."""
    from rollpacker import watchdog

    line = f"{prefix}{error}"
    first = watchdog.claim_report(int(os.environ.get("RANK", "0")))
    if path := watchdog.error_file():  # the launcher prints the first one, after torchrun is done
        _claim_file(path, line)
    elif first:
        print(line, file=sys.stderr, flush=True)


def _claim_file(path: str, line: str) -> None:
    """Write ``line`` to ``path`` unless a rank of this node did first."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return
    except OSError:  # the launcher's directory is gone: say it here rather than not at all
        print(line, file=sys.stderr, flush=True)
        return
    with os.fdopen(fd, "w") as f:
        f.write(line + "\n")
