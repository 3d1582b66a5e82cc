"""The decoder model, its Hugging Face load/save and its parallelization.

Its names are imported on first use, so the torch-free settings (:mod:`rollpacker.model.config`)
parse without torch.
"""

import importlib

_WHERE = {"ModelArgs": "args", "AttentionBackend": "attention", "CausalAttention": "attention", "INDEX": "hf",
          "checkpoint_dtype": "hf", "empty_model": "hf", "engine_dtype": "hf", "load_model": "hf", "read_args": "hf",
          "save_model": "hf", "Transformer": "transformer"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'rollpacker.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"rollpacker.model.{_WHERE[name]}"), name)
