"""Every process group and device mesh of the job, built once, in one place.

:class:`Meshes` holds them: the world, the gloo control plane, the rollout (replica, tp) mesh,
the trainer's HSDP mesh, and the groups stream training and disaggregated pools add. Which ranks
are which is a :class:`~rollpacker.topology.Topology` (``Meshes.topology``), pure data.

Invariants:

- Nobody else creates process groups.
- World size 1 is not special: one rank gets a gloo group like any other run.
- Every rank exports the same NCCL settings (:data:`NCCL_ENV`) before the default group exists.
- A rollout TP's groups are built the first time it is used, then reused.

Why one place: communicators built differently on different ranks fail or hang, and one builder
keeps them alike. Each group and what travels over it: ``docs/architecture.md`` (Process groups).
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rollpacker.topology import Topology

logger = logging.getLogger("rollpacker")

NCCL_ENV = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
"""What SGLang's in-process ``Engine`` (and vLLM at import) sets unless already set, in its own process
only: exported on every rank first (SkyRL does the same), so every communicator agrees. A value the
user exported wins (the engines keep it too)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend(device: str = "auto", cpu_collectives: bool = False) -> tuple[str, str]:
    """(device type, default group backend) for ``dist.device``: CUDA when visible unless it or
    ``ROLLPACKER_DEVICE`` says cpu, with gloo beside NCCL when ``cpu_collectives``."""
    forced = os.environ.get("ROLLPACKER_DEVICE", "auto") or "auto"
    for where, value in (("dist.device", device), ("ROLLPACKER_DEVICE", forced)):
        if value not in ("auto", "cpu"):
            raise ValueError(f"{where} must be auto or cpu, got {value!r}")
    if "cpu" in (device, forced) or not torch.cuda.is_available():
        return "cpu", "gloo"
    return "cuda", "cuda:nccl,cpu:gloo" if cpu_collectives else "nccl"


def export_nccl_env(forced: dict[str, str] | None = None) -> dict[str, str]:
    """Set :data:`NCCL_ENV` (unless set) and ``forced`` (the engine's, set unconditionally) in this
    process; returns every ``NCCL_*`` variable, as logged."""
    for name, value in NCCL_ENV.items():
        os.environ.setdefault(name, value)
    os.environ.update(forced or {})
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}


def init_distributed(device: str = "auto", cpu_collectives: bool = False,
                     nccl_env: dict[str, str] | None = None) -> torch.device:
    """Join the job's process group (a one-rank group outside torchrun), with the NCCL settings of
    :func:`export_nccl_env` (``nccl_env``: the engine's) exported and logged first; returns this rank's
    device. Once joined, later calls return the device it chose."""
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        kind, name = backend(device, cpu_collectives)
        env = export_nccl_env(nccl_env)
        logger.info("rank %s: NCCL environment %s", os.environ["RANK"], " ".join(f"{k}={v}" for k, v in env.items()))
        if kind == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(name)
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def exit_process(code: int) -> NoReturn:
    """End a process that closed what it opened: its default group destroyed, its other threads finished and
    its exit handlers run (logging's, wandb's), as at any exit; then out without the interpreter's teardown,
    which spends a second of CPU per process unloading torch and transformers, and which, after a device
    mesh's collectives, aborted one rank of two in about half of the runs on torch 2.13 ("terminate called
    without an active exception", from C++ while Python finalized)."""
    if dist.is_initialized():  # vLLM's shutdown destroys it
        dist.destroy_process_group()
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def broadcast(obj: Any, group: dist.ProcessGroup | None, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable), on every rank of ``group`` (None: the default group); what code
    that holds a group but no :class:`Meshes` calls (checkpoints)."""
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@dataclass
class Meshes:
    device: torch.device
    world: DeviceMesh
    control: dist.ProcessGroup
    rollout: DeviceMesh
    train: DeviceMesh
    topology: Topology
    """Who rolls out, who trains, which ranks a scale-down frees (at the current rollout TP)."""
    stream_group: dist.ProcessGroup | None = None
    """With stream training: rank 0's point-to-point sends to the ranks it frees (gloo, all ranks)."""
    kept_control: dist.ProcessGroup | None = None
    rollout_ranks: list[int] = field(default_factory=list)
    """The ranks that roll out (all of them unless the pools are disaggregated); rank 0 is one."""
    train_ranks: list[int] = field(default_factory=list)
    """The ranks that train (all of them unless the pools are disaggregated)."""
    rollout_control: dist.ProcessGroup | None = None
    train_group: dist.ProcessGroup | None = None
    handoff: dist.ProcessGroup | None = None
    weights: dist.ProcessGroup | None = None
    _by_tp: dict[int, tuple[DeviceMesh, dist.ProcessGroup | None]] = field(default_factory=dict, repr=False)

    def set_rollout_tp(self, tp: int) -> None:
        """Make ``tp`` the rollout TP: the (replica, tp) mesh and, with stream training, the control
        plane of the replicas kept after a scale-down. Collective over all ranks."""
        size = len(self.rollout_ranks)
        if size % tp:
            raise ValueError(f"rollout TP={tp} does not divide the {size} rollout ranks")
        self.topology = self.topology.with_tp(tp)
        if tp not in self._by_tp:
            kept = (dist.new_group(self.topology.kept_ranks, backend="gloo")
                    if self.stream_group is not None else None)
            mesh = DeviceMesh(self.device.type, torch.arange(size).view(size // tp, tp),
                              mesh_dim_names=("replica", "tp"))
            self._by_tp[tp] = mesh, kept
        self.rollout, self.kept_control = self._by_tp[tp]

    @property
    def disaggregated(self) -> bool:
        return len(self.rollout_ranks) < self.world_size

    @property
    def freed(self) -> bool:
        """This rank leaves rollout to train when a round scales down (stream training, RolloutPipe)."""
        return self.rank in self.topology.freed_ranks

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    @property
    def rollout_tp(self) -> DeviceMesh:
        return self.rollout["tp"]

    @property
    def replica(self) -> int:
        """Index of the engine replica this rank belongs to."""
        return self.rollout.get_local_rank("replica")

    @property
    def num_replicas(self) -> int:
        return self.rollout.size(0)

    @property
    def is_replica_leader(self) -> bool:
        """TP rank 0 of its replica: the one that reports the replica's outputs."""
        return self.rollout.get_local_rank("tp") == 0

    def broadcast(self, obj: Any = None, group: dist.ProcessGroup | None = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj``, on every rank of ``group`` (default: the control plane)."""
        return broadcast(obj, group or self.control, src)

    def scatter(self, objs: list[Any] | None, group: dist.ProcessGroup | None = None) -> Any:
        """Rank 0's ``objs[i]`` on the i-th rank of ``group`` (default: the control plane, gloo; rank 0 is in it).
        An object given to several ranks (a replica's command, to each of its TP ranks) is pickled once, and
        each rank receives its own bytes alone (``scatter_object_list`` pads every part to the largest)."""
        group = group or self.control
        size = torch.zeros(1, dtype=torch.long)
        if objs is None:
            dist.scatter(size, src=0, group=group)
            blob = torch.empty(int(size), dtype=torch.uint8)
            dist.recv(blob, src=0, group=group)
            return pickle.loads(blob.numpy().tobytes())
        pickled: dict[int, torch.Tensor] = {}
        for obj in objs:
            if id(obj) not in pickled:
                pickled[id(obj)] = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        blobs = [pickled[id(obj)] for obj in objs]
        dist.scatter(size, [torch.tensor([len(b)]) for b in blobs], src=0, group=group)
        ranks = dist.get_process_group_ranks(group)
        for work in [dist.isend(blob, dst=rank, group=group) for rank, blob in zip(ranks, blobs) if rank != 0]:
            work.wait()
        return pickle.loads(blobs[ranks.index(0)].numpy().tobytes())  # a copy, as the other ranks get

    def replicas(self, group: dist.ProcessGroup | None = None) -> list[int]:
        """The replica of each rank of ``group`` (default: the control plane; rolling out), in group order."""
        replica = {rank: i for i, ranks in enumerate(self.rollout.mesh.tolist()) for rank in ranks}
        return [replica[rank] for rank in dist.get_process_group_ranks(group or self.control)]

    def gather(self, obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
        """Every rank's ``obj`` of ``group`` (default: the control plane), in rank order, on rank 0 (None elsewhere)."""
        group = group or self.control
        out = [None] * dist.get_world_size(group) if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=group)
        return out


def build_meshes(rollout_tp: int = 1, train_shard_size: int = 0, stream: bool = False,
                 topology: Topology | None = None) -> Meshes:
    """The job's groups, on its ``topology`` (default: every rank rolls out at ``rollout_tp`` and
    trains in shard groups of ``train_shard_size``, 0 = all). With pools (``one_step_off``), the first
    ``topology.rollout_ranks`` ranks roll out and the others train. ``stream``: the groups of stream
    training and RolloutPipe."""
    device = init_distributed()
    world = dist.get_world_size()
    topology = topology or Topology(world, tp=rollout_tp, train_shard_size=train_shard_size)
    pools, rollout, train = topology.pools, topology.rollout, topology.train
    kind = device.type
    control = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
    # new_group is collective over all ranks: built here, used only by some
    meshes = Meshes(
        device=device,
        world=init_device_mesh(kind, (world,), mesh_dim_names=("world",)),
        control=control,
        rollout=None,
        train=DeviceMesh(kind, torch.tensor(train).view(-1, topology.shard), mesh_dim_names=("replicate", "shard")),
        topology=topology,
        stream_group=dist.new_group(backend="gloo") if stream else None,
        rollout_ranks=rollout,
        train_ranks=train,
        rollout_control=dist.new_group(rollout, backend="gloo") if pools else control,
        train_group=dist.new_group(train) if pools else dist.group.WORLD,
        handoff=dist.new_group([0, *train], backend="gloo") if pools else None,
        weights=dist.new_group([train[0], *rollout]) if pools else None,
    )
    meshes.set_rollout_tp(topology.tp)
    return meshes
