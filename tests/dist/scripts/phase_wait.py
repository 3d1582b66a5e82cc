"""Run on 2 gloo ranks by tests/dist/test_faults.py (issue 37): the NCCL settings every rank exported
before its process group are the same, and a collective in a :func:`rollpacker.watchdog.waiting` phase
whose peer stopped ends with the diagnosis once the peer's heartbeat is stale, long before the
collective's own timeout (a day).

Rank 1 SIGSTOPs itself; rank 0 waits for it in phase ``handoff`` (a heartbeat goes stale in 5 s, and the
wait reads them every 5 s). Rank 1's torchrun attempt count is another's: the heartbeats are read all the same."""

import logging
import os
import signal
import subprocess
import time

from rollpacker import watchdog
from rollpacker.dist import build_meshes

logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
meshes = build_meshes(1, 0)
if meshes.rank == 1:  # a node whose agent counted a restart the other's did not (torchrun counts the failed one's)
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
watchdog.start(watchdog.DistConfig(timeout_s=2.0, first_step_timeout_s=2.0))
env = meshes.gather({k: v for k, v in os.environ.items() if k.startswith("NCCL_")})
if meshes.rank == 0:
    assert env[0] == env[1] and env[0]["NCCL_CUMEM_ENABLE"] == "0" and env[0]["NCCL_NVLS_ENABLE"] == "0", env
    print(f"NCCL settings equal on both ranks: {env[0]}", flush=True)
meshes.broadcast(None)  # both beat and hold the settings before rank 1 stops
time.sleep(2 * watchdog.BEAT_S)
if meshes.rank == 1:  # stopped until well after rank 0's deadline (then torchrun's SIGTERM ends it at once)
    subprocess.Popen(["sh", "-c", f"sleep 30; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)
with watchdog.waiting("handoff"):
    meshes.broadcast("never answered")
print("the broadcast returned", flush=True)
