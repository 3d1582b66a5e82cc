"""How the trainer's new weights reach the rollout engines: one small protocol, two transports.

- :class:`InProcess` (colocated loop, TP switch, resume): each rank's engine slice and trainer
  shard share a process, and the engine reads the FSDP2 parameters it needs.
- :class:`Broadcast` (one_step_off's disaggregated pools): the training pool gathers each
  parameter whole and its first rank broadcasts it to the rollout pool over ``Meshes.weights``
  (NCCL on GPU, gloo on CPU), in the engines' dtype. Each engine keeps its TP slice.

Both push every weight, every step, by name and in the model's order: the model's parameters, or
with LoRA the base weights with the adapters merged in (:func:`~rollpacker.model.lora.merged_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rollpacker.dist import Meshes
    from rollpacker.rollout.engine import Engine


class WeightSync(Protocol):
    def push(self, engine: Engine | None, model: torch.nn.Module | None) -> None:
        """The trainer's current weights into the engines (collective over the ranks that hold either).
        ``engine`` is None on ranks without one, ``model`` on ranks without a trainer."""
        ...


class InProcess:
    """The engine on this rank loads the trainer's parameters in place (no transfer between ranks)."""

    def push(self, engine: Engine | None, model: torch.nn.Module | None) -> None:
        from rollpacker.model.lora import merged_weights

        engine.update_weights(merged_weights(model))


class Broadcast:
    """The training pool's first rank broadcasts each parameter, whole, to the rollout pool.

    Parameters go by position, so :meth:`connect` first checks that both sides name the same ones."""

    def __init__(self, meshes: Meshes, dtype: torch.dtype, shapes: list[tuple[str, tuple[int, ...]]]):
        self.meshes, self.dtype, self.shapes = meshes, dtype, shapes
        self.lead = meshes.train_ranks[0]

    @classmethod
    def connect(cls, meshes: Meshes, dtype: torch.dtype, model: torch.nn.Module | None, model_dir: Path) -> Broadcast:
        """Collective, once: the transport, after checking that the training pool's parameters
        (names and shapes, in order) are the engines'."""
        shapes = parameter_shapes(model, model_dir)
        theirs = meshes.broadcast(shapes, src=meshes.train_ranks[0])
        if theirs != shapes:
            raise RuntimeError(f"one_step_off: the trainer's parameters {theirs} are not the engine's {shapes}")
        return cls(meshes, dtype, shapes)

    def push(self, engine: Engine | None, model: torch.nn.Module | None) -> None:
        """Collective over all ranks. The training pool gathers each parameter from its FSDP2
        shards (``full_tensor``); the rollout pool streams them into the engine, layer by layer."""
        if model is not None:
            from rollpacker.model.lora import merged_weights

            for _, param in merged_weights(model):
                full = param.full_tensor()
                if self.meshes.rank == self.lead:
                    dist.broadcast(full.to(self.dtype).contiguous(), self.lead, group=self.meshes.weights)
        else:  # one stream into the engine: vLLM reloads layer by layer, all of a layer's tensors at once
            engine.update_weights(self._received())

    def _received(self):
        for name, shape in self.shapes:
            buffer = torch.empty(shape, dtype=self.dtype, device=self.meshes.device)
            dist.broadcast(buffer, self.lead, group=self.meshes.weights)
            yield name, buffer


def parameter_shapes(model: torch.nn.Module | None, model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The model's parameter names and shapes, in order: the trainer's, or without one those of
    the model directory's architecture (any engine)."""
    from rollpacker.model import empty_model, read_args
    from rollpacker.model.lora import engine_shapes

    return engine_shapes(model if model is not None else empty_model(read_args(model_dir), "meta", torch.float32))
