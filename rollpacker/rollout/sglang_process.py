"""SGLang's processes inside a torchrun rank: starting its ``Engine``, keeping it in step, stopping it.

SGLang runs its schedulers and detokenizer in processes of its own, with their own signal handling:
its tokenizer manager takes SIGTERM and SIGQUIT, its spawned schedulers inherit torchrun's
environment, and on CPU they bind cores and fetch pushed weights by file descriptor. This module
keeps those processes alive inside a rank and in step with the controller;
:mod:`~rollpacker.rollout.sglang_engine` maps the engine contract onto SGLang's calls. Each fix:
``docs/sglang.md``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from rollpacker.watchdog import at_every_exit

SGLANG_VERSION = "0.5.23"


class EngineDied(RuntimeError):
    """SGLang's scheduler or detokenizer process failed; the engine is gone."""


_STARTED: dict[int, str] = {}
"""pid -> title of every SGLang process this one started (SGLang reaps a dead one before SIGQUIT)."""
_SHARED: dict[str, int] = {}
"""path -> inode of the /dev/shm files those processes mapped: SGLang kills them, so none unlinks its own."""


def import_sglang(on_cpu: bool):
    """SGLang, its CPU platform selected first on a machine without CUDA (its modules read it at import)."""
    if on_cpu:
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sglang
    except ImportError as e:
        raise ImportError(f"engine.kind=sglang needs SGLang ({e}): `bash launch/install.sh sglang` (CPU), or "
                          f"pip install sglang=={SGLANG_VERSION} on a GPU machine") from None
    if sglang.__version__ != SGLANG_VERSION:
        raise ImportError(f"engine.kind=sglang is written against SGLang {SGLANG_VERSION}, found "
                          f"{sglang.__version__}: pip install sglang=={SGLANG_VERSION}")
    try:
        import sglang.srt.entrypoints.engine  # noqa: F401
    except ImportError as e:
        stubs = " (on CPU: SGLang's CPU path imports torchvision and sgl_kernel without calling them; the tests put "
        stubs += "tests/support/sglang_stubs on PYTHONPATH, see docs/sglang.md)" if on_cpu else ""
        raise ImportError(f"SGLang {SGLANG_VERSION} is installed but its engine does not import: {e}{stubs}") from None
    return sglang


def share_with_schedulers(broadcast: Callable) -> None:
    """On CPU, before the Engine starts (every rank of the TP group): weight pushes share file descriptors,
    which the schedulers fetch from each rank's sharer, authenticated with the process's authkey that
    they inherit: the group's first rank's (``broadcast``). Each local rank's schedulers bind their own
    share of the cores (:func:`cpu_binding`) unless SGLANG_CPU_OMP_THREADS_BIND is set."""
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    me = multiprocessing.current_process()
    me.authkey = broadcast(bytes(me.authkey))
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_binding(
        sorted(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))))


def cpu_binding(cpus: list[int], num_local_ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for CPU engines: the cores split into one contiguous share per
    local rank, ``|``-separated (a scheduler binds the share at its device index, the rank's
    LOCAL_RANK + its TP rank); a core is shared when ranks outnumber cores."""
    n = len(cpus)
    if num_local_ranks >= n:
        return "|".join(str(cpus[i % n]) for i in range(num_local_ranks))
    return "|".join(",".join(map(str, cpus[i * n // num_local_ranks:(i + 1) * n // num_local_ranks]))
                    for i in range(num_local_ranks))


def start(sgl, server_args: dict):
    """``sgl.Engine(**server_args)`` started inside this rank, and its KV capacity in tokens; its
    processes are remembered for :func:`engine_died`."""
    from rollpacker.workers import stops_blocked

    # SGLang's processes keep the stop signals blocked: a Ctrl-C at torchrun (passed on to each rank's process
    # group) or a Slurm stop (to every process) is the rank's, which stops after the step with a checkpoint; they
    # died of it, and their SIGQUIT ended the job as an engine failure, unsaved
    with _without_agent_store(), _keeping_signal_handlers() as restore, stops_blocked():
        engine = sgl.Engine(**server_args)
        num_tokens = engine.get_server_info()["max_total_num_tokens"]  # before the loop's thread
        restore(engine.loop)
    procs = _sglang_processes()
    _STARTED.update((pid, _title(p)) for pid, p in procs.items())
    _SHARED.update(_mapped_shared_memory(procs.values()))
    return engine, num_tokens


def stop(engine) -> None:
    """Shut ``engine`` down, forget its processes and remove what they left in /dev/shm."""
    _SHARED.update(_mapped_shared_memory(_sglang_processes().values()))
    engine.shutdown()
    _STARTED.clear()
    _unlink_shared_memory()


def engine_died(signum, frame) -> None:
    """SIGQUIT, sent by an SGLang process that failed (SGLang's own handler would SIGKILL this
    process, leaving no message): stop SGLang's processes and raise one error naming them."""
    import psutil

    procs = _sglang_processes()
    gone = [f"{name} (pid {pid})" for pid, name in _STARTED.items()
            if pid not in procs or procs[pid].status() == psutil.STATUS_ZOMBIE]
    _SHARED.update(_mapped_shared_memory(procs.values()))
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    _unlink_shared_memory()
    what = f"{', '.join(gone)} exited" if gone else "one of its processes reported an error"
    raise EngineDied(f"SGLang's engine failed: {what}; its traceback, if it printed one, is above. Its processes "
                     "were stopped. Under torchrun --max-restarts with --resume auto the job restarts from its newest "
                     "checkpoint")


def _sglang_processes() -> dict:
    """This process's live SGLang descendants (``sglang::...``), by pid."""
    import psutil

    return {p.pid: p for p in psutil.Process().children(recursive=True) if _title(p).startswith("sglang::")}


def _mapped_shared_memory(procs) -> dict[str, int]:
    """The /dev/shm files ``procs`` map, by path, with their inode: the schedulers' message queue
    (TP > 1), their load snapshot, the named semaphores of tqdm's lock. SGLang's shutdown SIGKILLs
    its processes (and this process's resource tracker, a child too), so each would stay in /dev/shm
    run after run. Matched by inode: a named semaphore is mapped under the temporary name it was made as."""
    inodes = set()
    for p in procs:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p.pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                    inodes.add(int(fields[4]))
    if not inodes:
        return {}
    with os.scandir("/dev/shm") as entries:
        return {e.path: e.inode() for e in entries if e.inode() in inodes}


@at_every_exit  # a rank that fails without stopping its engine too, or that the watchdog ends at once
def _unlink_shared_memory() -> None:
    """Unlink :data:`_SHARED`'s files that are still the ones found (a process that maps one keeps it)."""
    for path, inode in _SHARED.items():
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == inode:
                os.unlink(path)
    _SHARED.clear()


def _title(process) -> str:
    """A process's title (SGLang names its own ``sglang::...``); empty once it is gone."""
    try:
        return process.name()
    except Exception:
        return ""


@contextlib.contextmanager
def _keeping_signal_handlers():
    """SGLang's tokenizer manager takes SIGTERM (to drain and exit) and SIGQUIT (to SIGKILL this
    process when a child fails) on its event loop. Yields ``restore(loop)``, which gives SIGTERM
    back to its handler from before (a Slurm stop asks the job to save) and SIGQUIT to
    :func:`engine_died` (in the main thread only: elsewhere nothing was taken)."""
    main = threading.current_thread() is threading.main_thread()
    saved = signal.getsignal(signal.SIGTERM) if main else None

    def restore(loop) -> None:
        if main and saved is not None:
            for sig in (signal.SIGTERM, signal.SIGQUIT):
                loop.remove_signal_handler(sig)
            signal.signal(signal.SIGTERM, saved)
            signal.signal(signal.SIGQUIT, engine_died)

    yield restore


@contextlib.contextmanager
def _without_agent_store():
    """torchrun tells its ranks to reach its agent's store (TORCHELASTIC_USE_AGENT_STORE); SGLang's
    spawned schedulers would inherit that and wait forever for a store nobody hosts at their own
    rendezvous address. Hidden while the Engine spawns them."""
    saved = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved
