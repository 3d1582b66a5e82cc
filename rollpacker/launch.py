"""``rollpacker [TORCHRUN OPTIONS] [RUN FLAGS]``: torchrun's launch of :mod:`rollpacker.run`, quiet.

    rollpacker --nproc-per-node 2 --num-steps 50
    # is: torchrun --standalone --nproc-per-node 2 -m rollpacker.run --num-steps 50

The leading arguments that are torchrun's options go to torchrun (``--`` ends them), the rest to
``rollpacker.run``. ``python -m rollpacker.launch`` is the same command.

Invariants:

- torchrun keeps working as it does; this only adds what a user at a terminal wants.
- A rank's error is printed once, last, without torchrun's trailer.
- A signal goes to the ranks, which stop after the step in progress with a checkpoint and exit 0.
  A second Ctrl-C stops at once.

Why: a terminal user needs one readable error and a clean stop. The details (one node by default,
the rendezvous store, sessions): ``docs/cluster-and-faults.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from rollpacker.preempt import STOP_FILE
from rollpacker.watchdog import ERROR_FILE

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
RENDEZVOUS = ("--rdzv-endpoint", "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--master-addr",
              "--master_addr", "--master-port", "--master_port", "--standalone", "--nnodes")
"""torchrun's options that choose the rendezvous: without one, the launcher adds ``--standalone`` (which would
ignore a ``--master-port``)."""
AGENT = "--agent"
"""First argument of ``python -m rollpacker.launch`` when it runs torchrun's agent (the launcher's child)."""


def split(argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (torchrun's options, rollpacker.run's flags): torchrun's are the leading ones its
    parser knows, each with its value; ``--`` ends them. One of them among the flags is a ValueError."""
    from torch.distributed.run import get_args_parser

    actions = get_args_parser()._option_string_actions
    i = 0
    while i < len(argv) and argv[i] != "--":
        name = argv[i].split("=", 1)[0]
        if name not in actions or name in ("-h", "--help", "-m", "--module"):
            break
        takes_value = actions[name].nargs != 0 and "=" not in argv[i]
        if takes_value and i + 1 == len(argv):
            raise ValueError(f"{name} needs a value")
        i += 2 if takes_value else 1
    own = argv[:i]
    rest = argv[i + 1:] if i < len(argv) and argv[i] == "--" else argv[i:]
    late = next((name for a in rest if (name := a.split("=", 1)[0]) in actions and name.startswith("--")
                 and name not in ("--help", "--module")), None)
    if late:  # rollpacker.run's parser would say only that it does not know it
        raise ValueError(f"{late} is torchrun's option: put torchrun's options first, before rollpacker.run's flags")
    if not any(a.split("=", 1)[0] in RENDEZVOUS for a in own):
        own = ["--standalone", *own]
    return own, rest


def option(torchrun: list[str], name: str, default: str) -> str:
    """The value of torchrun's option ``name`` (either spelling: ``--max-restarts``, ``--max_restarts``); given twice,
    the last, as torchrun takes it."""
    for i in reversed(range(len(torchrun))):
        flag, equals, value = torchrun[i].partition("=")
        if flag.replace("_", "-") == name:
            return (value or default) if equals else torchrun[i + 1] if i + 1 < len(torchrun) else default
    return default


def ranks(agent: int) -> list[int]:
    """The pids of the ranks: the agent's child processes."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == agent:
                    found.append(int(entry.name))
    return found


def installed(pid: int) -> bool:
    """Whether rank ``pid`` has its stop handlers in: it catches SIGUSR1, which :func:`rollpacker.preempt.install`
    catches last (before, a stop signal kills the rank; Python catches SIGINT from its start)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGUSR1 - 1) & 1)
    return False


class Launch:
    """The launcher's side: the agent's process, and the stop signals it passes on. ``stop_file``: where the first
    is written, for the ranks still starting (``rollpacker.preempt.STOP_FILE``)."""

    def __init__(self, command: list[str], env: dict[str, str], stop_file: Path):
        self.interrupts, self.stop_file = 0, stop_file
        self.unstarted: int | None = None
        """The stop signal that found no rank (the agent starting, or between torchrun's attempts): it stopped the
        agent, and the run with it."""
        self.agent = subprocess.Popen(command, env={**env, STOP_FILE: str(stop_file)}, start_new_session=True,
                                      preexec_fn=_die_with_parent)
        for sig in FORWARDED:
            signal.signal(sig, self.forward)

    def forward(self, signum: int, frame) -> None:
        """A stop signal to the ranks (those still starting read it from the stop file once their handlers are in,
        as do the ranks of an attempt torchrun starts later); a second Ctrl-C also to torchrun's agent, which then
        stops for good."""
        self.interrupts += signum == signal.SIGINT
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)  # another signal's handler, run inside this one, would
        try:  # wait for the lock this one holds: it runs after
            with open(self.stop_file, "a+") as f:
                fcntl.flock(f, fcntl.LOCK_EX)  # a starting rank reads the file under it once its handlers are in
                pids = ranks(self.agent.pid)
                signalled = [pid for pid in pids if installed(pid)]
                if f.tell() == 0:  # the first stop: its signal, and the ranks that get it from here
                    f.write(" ".join(map(str, [int(signum), *signalled])))
                    f.flush()
                for pid in signalled:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signum)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
        if not pids and self.unstarted is None:
            self.unstarted = signum
        if not pids or self.interrupts > 1:  # no rank to stop after a step (starting, restarting), or at once
            with contextlib.suppress(ProcessLookupError):
                self.agent.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        return self.agent.wait()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [AGENT]:
        return agent(argv[1:])
    early: list[int] = []  # a stop before the agent starts (torch's import takes seconds): a KeyboardInterrupt
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: early.append(signum))
    try:
        torchrun, flags = split(argv)
    except ValueError as e:
        print(f"rollpacker: {e} (rollpacker [torchrun's options] [rollpacker.run's flags])", file=sys.stderr)
        return 2
    env = {**os.environ, "ROLLPACKER_PROG": "rollpacker"}
    if any(f in ("-h", "--help") for f in flags):
        print("rollpacker [torchrun's options: --nproc-per-node N, --max-restarts K, ...] [rollpacker.run's "
              "flags, below]\n")
        return subprocess.call([sys.executable, "-m", "rollpacker.run", "--help"], env=env)
    restarts = option(torchrun, "--max-restarts", "0")
    if not restarts.isdigit():
        print(f"rollpacker: --max-restarts needs a whole number, got {restarts!r}", file=sys.stderr)
        return 2
    if int(restarts):  # pytorch#135712; else torchrun's agent keeps the store
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    nproc = option(torchrun, "--nproc-per-node", "1")
    if not nproc.isdigit() and nproc not in ("auto", "cpu", "gpu", "xpu"):  # torchrun's: two tracebacks
        print(f"rollpacker: --nproc-per-node needs a number of ranks (or auto, cpu, gpu), got {nproc!r}",
              file=sys.stderr)
        return 2
    if nproc not in ("1", "auto", "cpu", "gpu", "xpu"):
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets for several ranks, without its banner
    if early:
        return _stopped(early[0])
    with tempfile.TemporaryDirectory(prefix="rollpacker-") as tmp:
        error = Path(tmp) / "error"
        env[ERROR_FILE] = str(error)
        launch = Launch([sys.executable, "-m", "rollpacker.launch", AGENT, *torchrun, "-m", "rollpacker.run",
                         *flags], env, Path(tmp) / "stop")
        for signum in early:  # since the check above
            launch.forward(signum, None)
        code = launch.wait()
        if launch.interrupts > 1:  # stopped at once by a second Ctrl-C: the ranks said so
            return 130
        said = {int(p.suffix[1:]): p.read_text().rstrip() for p in Path(tmp).glob(f"{error.name}.*")}
        for attempt in sorted(said)[:-1] if code else sorted(said):  # attempts torchrun restarted
            print(f"(torchrun's attempt {attempt}, restarted) {said[attempt]}", file=sys.stderr, flush=True)
        if code and said:  # the last error said, last (of which attempt, where torchrun may have restarted)
            last = max(said)
            print(f"(torchrun's attempt {last}) " * bool(int(restarts)) + said[last], file=sys.stderr, flush=True)
            return code
    if code and launch.unstarted is not None:  # the agent stopped as asked, with no rank to stop after a step
        return _stopped(launch.unstarted)
    if code < 0:  # the agent killed by a signal it could not handle: as it started, or from outside (SIGKILL, OOM)
        print(f"rollpacker: torchrun's agent was killed by {signal.Signals(-code).name}; its ranks, if any started, "
              "exit as they see it gone", file=sys.stderr)
        return 128 - code
    return code


def _stopped(signum: int) -> int:
    """A stop that came while no rank ran: said, and a clean exit (0), as a stop after a step is."""
    print(f"rollpacker: stopped on {signal.Signals(signum).name} while no rank ran (starting, or between torchrun's "
          "attempts): nothing to save", file=sys.stderr)
    return 0


def agent(argv: list[str]) -> int:
    """torchrun's agent, without the ``@record`` wrapper that prints the failed ranks' trailer: its
    exit code is the first failed rank's (or 128 + the signal that stopped it)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        exitcode = e.get_first_failure()[1].exitcode
        return exitcode if exitcode > 0 else 128 - exitcode
    except SignalException as e:
        return 128 + int(e.sigval)
    return 0


def _die_with_parent() -> None:
    """In the agent's process: SIGKILL when the launcher dies (its ranks then see torchrun gone and exit)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    sys.exit(main())
