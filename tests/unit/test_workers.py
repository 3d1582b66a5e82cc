"""A worker's stop (``rollpacker.workers``): in a real process, as the pools start theirs."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rollpacker.env.workers import EnvSpec
from rollpacker.env.workers import _serve as env_serve
from rollpacker.reward.workers import _work as reward_work

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


RACE = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    from rollpacker.workers import RETIRE, leaving

    spam = subprocess.Popen([sys.executable, "-c", f"import os\\nwhile True: os.kill({os.getpid()}, {int(RETIRE)})"])
    signal.signal(RETIRE, lambda *_: None)
    time.sleep(0.5)
    end = time.monotonic() + 3
    while time.monotonic() < end:  # the pool's RETIRE, over and over, as the worker leaves its loop
        signal.signal(RETIRE, lambda *_: None)
        leaving()
    spam.kill()
    spam.wait()  # dead: a RETIRE it sent after kill() would find Python's exit resetting the handler, and kill us
    assert signal.getsignal(RETIRE) not in (signal.SIG_IGN, signal.SIG_DFL)  # the window is rarely met: name it
""")


def test_a_retire_as_the_worker_leaves_its_loop_prints_nothing():
    """The pool's RETIRE landing inside leaving()'s signal.signal: with SIG_IGN there, Python ran it later as
    ignored and printed "OSError: Signal 12 ignored due to race condition" with a traceback under a run that
    ended well (once in about 30 runs; a RETIRE every few microseconds for 3 s finds the window one time in
    five). A handler of Python's absorbs it."""
    proc = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")


WATCHED = textwrap.dedent("""
    import io, os, sys, time
    from rollpacker.workers import _Watchdog

    sys.stderr = io.StringIO()  # the task's code silences a noisy library
    _Watchdog.arm(1)
    pid = os.fork()  # the task's code forks a child, which ends through the worker loop's finally
    if pid == 0:
        _Watchdog.disarm()
        sys.exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    time.sleep(4)  # the task hangs past its deadline: the watchdog ends the worker
    print("not ended")
""")


def test_the_task_watchdog_survives_a_replaced_stderr_and_a_fork():
    """A task whose code replaced sys.stderr (a StringIO) killed its worker as the watchdog was armed, on every
    task; a child the task's code forked hung at its exit, waiting for a watchdog thread fork did not copy.
    The watchdog pauses across a fork, writes to the worker's own stderr, and still ends a hung task."""
    proc = subprocess.run([sys.executable, "-c", WATCHED], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (1, ""), proc.stderr
    assert proc.stderr.startswith("Timeout (0:00:0"), proc.stderr


@pytest.mark.parametrize(("main", "args"), [(reward_work, ((),)), (env_serve, (EnvSpec(),))], ids=["reward", "env"])
def test_a_worker_whose_pipe_is_closed_unread_exits_quietly(main, args, capfd):
    """A rank killed (torchrun's SIGTERM when another rank failed) before it read its worker's message: the
    worker's next read is a connection reset, an exit like a closed pipe's (it printed a traceback under the
    run's one-line error)."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    process = ctx.Process(target=main, args=(child, os.getpid(), *args))
    process.start()
    child.close()
    assert conn.poll(60)  # the worker is ready: its None stays unread
    conn.close()
    process.join(60)
    assert (process.exitcode, capfd.readouterr().err) == (0, "")


def test_an_environment_worker_imports_torch_before_it_is_ready():
    """transformers imports torch at the first tool schema, 1.4 s that a worker's first reset paid against
    env.timeout (its workers' first opens timed out at --env.timeout 2): the warm-up imports it first."""
    warm = textwrap.dedent("""
        import sys
        from rollpacker.env.workers import EnvSpec
        assert "torch" not in sys.modules
        EnvSpec(tools=("rollpacker.toy.tools:calculator",)).warm()
        assert "torch" in sys.modules
    """)
    proc = subprocess.run([sys.executable, "-c", warm], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_sys_exit_in_a_reward_function_is_its_error_and_a_retire_still_ends_the_worker(tmp_path):
    """A function's ``sys.exit()`` killed its reward worker (every task on it lost, no cause said); the pool's
    RETIRE, raised inside user code that catches SystemExit, must still unwind the worker."""
    from rollpacker.reward.functions import Ref
    from rollpacker.reward.workers import score
    from rollpacker.workers import Retired

    (tmp_path / "quits.py").write_text("import sys\nfrom rollpacker.workers import Retired\n\n"
                                       "def quits(completions, **kwargs):\n    sys.exit(5)\n\n"
                                       "def retired(completions, **kwargs):\n    raise Retired(1)\n")
    sample = {"prompt": "q", "completion": "x", "completion_ids": [1], "columns": {}}
    value, error, _, _ = score(Ref("quits", f"{tmp_path}/quits.py:quits"), sample)
    assert value is None and "SystemExit: 5" in error, error
    with pytest.raises(Retired):
        score(Ref("retired", f"{tmp_path}/quits.py:retired"), sample)


CLOSED = textwrap.dedent("""
    import os, signal, multiprocessing as mp
    from rollpacker.workers import RETIRE, _retired, _Watchdog, leaving, tasks

    signal.signal(RETIRE, _retired)
    ours, pools = mp.Pipe()
    pools.send((60.0, "a task"))
    pause, replying = _Watchdog.pause.__func__, False

    def retired_meanwhile(cls):  # the pool's RETIRE, landing as the task's watchdog is disarmed
        if replying:
            os.kill(os.getpid(), RETIRE)
        pause(cls)

    _Watchdog.pause = classmethod(retired_meanwhile)
    try:
        for task in tasks(ours):
            replying = True
            raise EOFError  # the reply's send: the pool closed the pipe, stopping
    except EOFError:
        pass
    finally:
        leaving()
""")


def test_a_retire_as_the_worker_leaves_its_loop_on_a_closed_pipe_prints_nothing():
    """The pool closes a worker's pipe and RETIREs it as the worker replies: the error leaving the loop closed the
    task generator, whose ``finally`` disarmed the watchdog inside a finalizer, where the RETIRE landing raised
    and was printed as "Exception ignored in: <generator object tasks>" with a traceback under the run's one-line
    error (CI, once, in --reward.on-error fail's test)."""
    proc = subprocess.run([sys.executable, "-c", CLOSED], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "")


LINGERING = textwrap.dedent("""
    import threading, time
    from rollpacker.workers import leaving

    threading.Thread(target=time.sleep, args=(40,)).start()  # a task's client left a thread running, not a daemon
    leaving()  # the worker's loop is over (its pipe closed: its rank died, no pool will SIGKILL it)
""")


def test_a_worker_whose_task_left_a_thread_running_still_exits():
    """The exit waits for every thread that is not a daemon, in a lock no signal handler interrupts: a worker
    orphaned by its rank's death lived on forever (ppid 1, its own process group: torchrun's kill misses it)."""
    proc = subprocess.run([sys.executable, "-c", LINGERING], capture_output=True, text=True, timeout=30)
    assert proc.returncode == -signal.SIGALRM, proc
