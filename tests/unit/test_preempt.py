"""The stop signals: the wakeup pipe survives an engine's asyncio loop (SGLang's) taking it over; what a stop says."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import asyncio, signal
from rollpacker import preempt

preempt.install()
loop = asyncio.new_event_loop()
loop.add_signal_handler(signal.SIGTERM, lambda: None)  # takes the wakeup pipe over
loop.remove_signal_handler(signal.SIGTERM)  # and leaves none
lost = signal.set_wakeup_fd(-1) == -1
preempt.install()  # again, as the loops do once the engines are up
print(lost, signal.set_wakeup_fd(-1) != -1)
"""


def test_installing_again_gives_the_wakeup_pipe_back_after_an_asyncio_loop_took_it():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True"], out.stderr


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_stop_before_the_first_step_says_nothing_will_be_saved(signame):
    """Ctrl-C while starting said a second one would stop at once "losing it": there is nothing to lose."""
    script = ("import os, signal, time\nfrom rollpacker import preempt\npreempt.install()\n"
              f"os.kill(os.getpid(), signal.{signame})\ntime.sleep(0.5)\nprint(preempt.requested())")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == [signame], out.stderr
    again = " (Ctrl-C again to stop at once)" if signame == "SIGINT" else ""
    assert out.stderr == (f"rollpacker: {signame}: stopping before the first step (still starting: nothing to "
                          f"save){again}\n")


def test_a_signal_after_another_rank_reported_an_error_is_no_stop_to_announce(tmp_path):
    """A rank's failed save, then torchrun's teardown SIGTERMs the others: rank 0 said it was stopping after step 2
    with a checkpoint that never came. The error said is the story; the signal still stops the rank."""
    (tmp_path / "error.0").write_text("rollpacker: checkpoint: saving step 3 failed")
    script = ("import os, signal, time\nfrom rollpacker import preempt\npreempt.install()\n"
              "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(0.5)\nprint(preempt.requested())")
    env = {**os.environ, "ROLLPACKER_ERROR_FILE": str(tmp_path / "error"), "TORCHELASTIC_RESTART_COUNT": "0"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.stdout.split() == ["SIGTERM"] and out.stderr == "", out.stderr
