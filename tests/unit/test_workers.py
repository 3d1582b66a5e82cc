"""A worker's stop (``rollpacker.workers``): in a real process, as the pools start theirs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

WORKER = textwrap.dedent("""
    import atexit, os, time
    from rollpacker.workers import RETIRE, ignore_stops

    ignore_stops(os.getppid())
    atexit.register(lambda: (os.kill(os.getpid(), RETIRE), time.sleep(0.2)))  # its process's death, while it exits
    os.kill(os.getpid(), RETIRE)  # the pool's, before the worker's loop began (it was still importing)
    time.sleep(10)
""")


def test_a_second_retire_while_the_first_unwinds_prints_nothing():
    """The pool's RETIRE, then the death of the worker's process (its PDEATHSIG, RETIRE too) during the exit the
    first began: the worker exits 1 and says nothing (a SystemExit raised inside an atexit callback would print
    a traceback that reads like a crash, under the run's one-line message)."""
    proc = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, "")
