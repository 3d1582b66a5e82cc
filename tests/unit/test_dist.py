"""The process group's backend and NCCL settings, the device switch, the phase timeouts (issue 37) and
the heartbeat's threads: their logic, on CPU. The multi-rank behaviour runs in tests/dist/test_faults.py."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from rollpacker import dist as rdist
from rollpacker import watchdog


@pytest.fixture
def gpu_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("ROLLPACKER_DEVICE", raising=False)


def test_backend_is_nccl_on_gpu_with_gloo_beside_it_when_cpu_tensors_meet(gpu_visible):
    assert rdist.backend("auto") == ("cuda", "nccl")
    assert rdist.backend("auto", cpu_collectives=True) == ("cuda", "cuda:nccl,cpu:gloo")  # train.offload


def test_cpu_and_gloo_can_be_forced_while_a_gpu_is_visible(gpu_visible, monkeypatch):
    assert rdist.backend("cpu", cpu_collectives=True) == ("cpu", "gloo")
    monkeypatch.setenv("ROLLPACKER_DEVICE", "cpu")  # the test suite's setting (tests/conftest.py): every job
    assert rdist.backend("auto") == ("cpu", "gloo")
    with pytest.raises(ValueError, match="dist.device must be auto or cpu, got 'gpu'"):
        rdist.backend("gpu")
    monkeypatch.setenv("ROLLPACKER_DEVICE", "gpu")
    with pytest.raises(ValueError, match="ROLLPACKER_DEVICE must be auto or cpu, got 'gpu'"):
        rdist.backend("auto")


def test_without_a_gpu_the_backend_is_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rdist.backend("auto", cpu_collectives=True) == ("cpu", "gloo")


def test_the_nccl_settings_are_exported_before_the_process_group_and_logged(gpu_visible, monkeypatch, caplog):
    for name in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_DEBUG"):
        monkeypatch.setenv(name, "")  # recorded as it was (unset too): what init_distributed exports is undone
        monkeypatch.delenv(name)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # the user's own settings stay
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    seen = {}

    def init_process_group(name):  # what the real one would see: the backend and the environment
        seen.update(backend=name, env={k: v for k, v in os.environ.items() if k.startswith("NCCL_")})

    monkeypatch.setattr(rdist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(rdist.dist, "init_process_group", init_process_group)
    monkeypatch.setattr(rdist.dist, "get_backend", lambda: seen["backend"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with caplog.at_level("INFO", logger="rollpacker"):
        device = rdist.init_distributed("auto", cpu_collectives=True, nccl_env={"NCCL_ALGO": "allreduce:tree"})
    assert device == torch.device("cuda", 0) and seen["backend"] == "cuda:nccl,cpu:gloo"
    assert seen["env"] == {"NCCL_ALGO": "allreduce:tree", "NCCL_CUMEM_ENABLE": "0", "NCCL_DEBUG": "WARN",
                           "NCCL_NVLS_ENABLE": "1"}
    assert ("NCCL environment NCCL_ALGO=allreduce:tree NCCL_CUMEM_ENABLE=0 NCCL_DEBUG=WARN NCCL_NVLS_ENABLE=1"
            in caplog.text)


def test_a_checkpoint_phase_timeout_must_be_positive():
    assert watchdog.DistConfig().checkpoint_timeout_s == 1800.0
    with pytest.raises(ValueError, match="dist.checkpoint_timeout_s=0 must be positive"):
        watchdog.DistConfig(checkpoint_timeout_s=0)


def test_a_waiting_phase_restores_what_it_found():
    before = dict(watchdog._state)
    with watchdog.waiting("handoff"):
        assert watchdog._state["phase"] == "handoff" and watchdog._state["deadline"] == 0
        assert watchdog._state["waits"] > 0
        with watchdog.waiting("checkpoint", 5.0):
            assert watchdog._state["phase"] == "checkpoint" and watchdog._state["deadline"] > 0
            assert watchdog._state["waits"] == 0
        assert watchdog._state["phase"] == "handoff" and watchdog._state["deadline"] == 0
    after = dict(watchdog._state)
    assert after.pop("moved") >= before.pop("moved") and after.pop("checked") > 0
    before.pop("checked")
    assert after == before
    # a collective that failed inside it: the diagnosis names its phase (it named the one before: a rank killed in
    # a save read "phase weight_sync"); its deadline is still dropped
    with pytest.raises(RuntimeError), watchdog.waiting("handoff"), watchdog.waiting("checkpoint", 5.0):
        raise RuntimeError("a peer exited")
    assert watchdog._state["phase"] == "checkpoint" and watchdog._state["deadline"] == 0
    watchdog._state["phase"] = before["phase"]


def test_a_waiting_phase_in_which_the_first_step_ended_restores_the_later_steps_timeout(monkeypatch):
    """one_step_off's hand-off once restored the first step's timeout (15 min) for good: a stall after the
    first step waited that long to be named."""
    monkeypatch.setattr(watchdog, "_config", watchdog.DistConfig(timeout_s=2.0, first_step_timeout_s=900.0))
    monkeypatch.setattr(watchdog, "_state", dict(watchdog._state))
    watchdog.at_step(0)
    assert watchdog._state["timeout"] == 900.0
    with watchdog.waiting("handoff"):
        assert watchdog._state["timeout"] == watchdog.LIVE_WAIT_S
        with watchdog.waiting("checkpoint", 60.0):  # the first step's timeout, not the live wait's
            assert watchdog._state["timeout"] == 900.0
        watchdog.at_step(1)
        with watchdog.waiting("checkpoint", 60.0):
            assert watchdog._state["timeout"] == 60.0
        assert watchdog._state["timeout"] == 2.0  # what at_step set: the outer phase's collectives are done
    assert watchdog._state["timeout"] == 2.0


def beat(now: float, moved: float, waits: bool = False, phase: str = "rollout", t: float | None = None) -> dict:
    return {"t": now if t is None else t, "step": 3, "phase": phase, "moved": moved, "waits": waits}


def test_a_wait_on_working_ranks_lasts_while_they_beat_and_move(monkeypatch):
    now = time.time()
    monkeypatch.setattr(watchdog, "_state", dict(watchdog._state, step=3, phase="handoff", waits=now - 100))
    stalled = watchdog.stalled
    # rank 0 waits (its own heartbeat is older than what it knows); rank 1 works, moved 10 s ago
    assert stalled(0, {0: None, 1: beat(now, now - 10)}, now, 120) is None
    # rank 1 beats, but its main thread has not moved for 200 s: a hang in its phase
    why = stalled(0, {0: beat(now, now, True), 1: beat(now, now - 200, phase="train")}, now, 120)
    assert why.startswith("rank 0 waited 100s at step 3, phase handoff: rank(s) [1] beat but did not move for over "
                          "120s (rank 1: step 3, phase train, last moved 200s ago): a hang. Exiting non-zero"), why
    # rank 1 stopped beating: named as any stalled rank
    why = stalled(0, {0: None, 1: beat(now, now, t=now - 9)}, now, 120)
    assert "rank(s) [1] did not answer (rank 1: last heartbeat 9s ago, at step 3, phase rollout)" in why, why
    # the others wait too: one of them moved lately (a freed rank training), so not a hang yet
    assert stalled(0, {1: beat(now, now - 200, True), 2: beat(now, now - 5, True)}, now, 120) is None
    why = stalled(0, {1: beat(now, now - 200, True), 2: beat(now, now - 130, True)}, now, 120)
    assert ": every rank waits on another (rank 1: " in why, why


def test_a_second_job_in_one_process_keeps_one_heartbeat_and_stop_joins_it(monkeypatch):
    """Two jobs built in one process (tests/dist/scripts/tp_switch.py) once started a heartbeat each; the
    second dropped the first from the threads that stop() joins, and a sender of the first, still in a
    store call at interpreter exit, aborted the process ("terminate called without an active exception")."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.setattr(watchdog, "BEAT_S", 0.01)
    for name, value in (("_config", None), ("_state", dict(watchdog._state))):  # what start() sets: restored
        monkeypatch.setattr(watchdog, name, value)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    xfsz = signal.getsignal(signal.SIGXFSZ)

    def ours():
        return [t for t in threading.enumerate() if t.name.startswith("rollpacker-")]

    try:
        watchdog.start(watchdog.DistConfig())
        watchdog.start(watchdog.DistConfig())
        deadline = time.monotonic() + 10
        while not store.check([watchdog._key(0)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.check([watchdog._key(0)]), "no heartbeat reached the store"
        assert [t.name for t in ours()].count("rollpacker-heartbeat") == 1
    finally:
        watchdog.stop()
        atexit.unregister(watchdog.stop)
        signal.signal(signal.SIGXFSZ, xfsz)
    assert ours() == []


def test_exit_process_finishes_threads_and_exit_handlers_then_exits_with_the_code():
    """A rank's end without the interpreter's teardown still ends as any exit does: the default group
    destroyed, a non-daemon thread finished, the exit handlers run, the output flushed."""
    code = ("import atexit, sys, threading, time, torch.distributed as dist\n"
            "from rollpacker.dist import exit_process\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "atexit.register(lambda: print('handler ran', dist.is_initialized()))\n"
            "threading.Thread(target=lambda: (time.sleep(0.3), print('thread finished'))).start()\n"
            "print('unflushed', end='')\n"
            "exit_process(3)\n")
    proc = run_buffered(code)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "unflushedthread finished\nhandler ran False\n", proc.stdout


def test_an_exit_at_once_runs_the_cleanups_for_every_exit_and_no_other_handler():
    """The watchdog's exit after a peer failed runs what must not outlive the process (SGLang's files in /dev/shm),
    from its own thread, flushes the output, and runs no other exit handler (one may wait on the dead peer)."""
    code = ("import atexit, threading\n"
            "from rollpacker.watchdog import at_every_exit, exit_at_once\n"
            "atexit.register(lambda: print('other handler ran'))\n"
            "at_every_exit(lambda: print('cleanup ran', end=' '))\n"
            "print('unflushed', end=' ')\n"
            "threading.Thread(target=exit_at_once, args=(5,)).start()\n"
            "threading.Event().wait()\n")
    proc = run_buffered(code)
    assert proc.returncode == 5, proc.stderr
    assert proc.stdout == "unflushed cleanup ran ", proc.stdout
    gone = code.replace("threading.Thread", "import os; r, w = os.pipe(); os.close(r); os.dup2(w, 1)\n"
                                            "threading.Thread")  # stdout a pipe whose reader (a launcher) is gone
    assert run_buffered(gone, timeout=60).returncode == 5


def run_buffered(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter whose output is buffered, as a rank's whose output goes to a pipe or a
    file (a shell may set PYTHONUNBUFFERED): what an exit leaves unflushed is lost."""
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=buffered)


def test_only_a_collectives_error_is_diagnosed_as_a_fault():
    """c10d's errors (and a plain C++ RuntimeError) are the job's faults; an error of ours that says itself (a reward
    worker that did not start within reward.start_timeout) is printed as it is, not as a collective timeout."""
    import torch.distributed as dist

    from rollpacker.watchdog import _fault
    from rollpacker.workers import PoolError

    assert _fault(dist.DistBackendError("[pair.cc:534] Timed out waiting 6000ms for recv")).startswith("timed out")
    assert _fault(RuntimeError("Connection reset by peer")) == "lost its connection to another rank"
    assert _fault(PoolError("a reward worker did not start within 3 s (reward.start_timeout)")) is None
    assert _fault(ValueError("timeout")) is None


def test_an_error_before_the_store_is_said_by_each_nodes_first_rank(monkeypatch):
    """Before the job's store is up (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as train.sbatch sets), only rank 0 said
    a config error: one that only another node meets (its own model.path, its disk for --resume auto) was unsaid."""
    from rollpacker import watchdog

    monkeypatch.setattr(watchdog, "_config", None)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    for rank, local_rank, says in ((0, 0, True), (8, 0, True), (9, 1, False), (1, 1, False)):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        assert watchdog.claim_report(rank) is says, (rank, local_rank)
