"""TorchEngine: continuous batching over rollpacker's own decoder, on CPU or GPU.

It implements the engine contract (:mod:`rollpacker.rollout.engine`). One idea per file:

- :mod:`.engine`: the scheduler (admission by priority, preemption by recomputation, prefill and
  decode steps, weight updates, memory release);
- :mod:`.kv`: the paged KV pool and the decode workspace, grouped by context length;
- :mod:`.layout`: the model's forward with fused, transposed weights (no copy on update);
- :mod:`.sampling`: batched sampling, each draw seeded by (request seed, position);
- :mod:`.verify`: speculative decoding, whose tokens are exactly plain decoding's;
- :mod:`.seq`: a request's state inside the engine.

Invariant: a request's tokens depend on its own seed and prompt only, never on the batch, the
replica, preemption, TP or speculation.
"""

from rollpacker.rollout.torch_engine.engine import TorchEngine

__all__ = ["TorchEngine", "empty", "load"]


def load(config, model_path, device, dtype, tp_mesh) -> TorchEngine:
    """The registry's loader: this rank's engine over the model at ``model_path``."""
    from rollpacker.model import load_model

    return TorchEngine(load_model(model_path, device, dtype), config, tp_mesh)


def empty(args, config, device, dtype, tp_mesh) -> TorchEngine:
    """The registry's rebuilder: an engine with no weights yet (a TP switch loads them from the trainer)."""
    from rollpacker.model import empty_model

    return TorchEngine(empty_model(args, device, dtype), config, tp_mesh)
