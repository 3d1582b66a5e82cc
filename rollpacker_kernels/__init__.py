"""rollpacker_kernels: the trainer's fused Triton kernels, their torch implementations, and their benchmark.

The design's top-level ``kernels/``, under a name of its own: a package named ``kernels`` would
shadow Hugging Face's kernel hub package, which transformers probes for by that name. It imports
nothing from rollpacker; rollpacker's trainer calls it (:mod:`rollpacker.train.logprobs`).

- :mod:`rollpacker_kernels.logprobs`: fused log-probs and entropy of the sampled tokens (Triton);
- :mod:`rollpacker_kernels.reference`: the log-probs in torch, chunked (the trainer's path off CUDA)
  and plain (full logits, what both are tested against);
- :mod:`rollpacker_kernels.bench`: their memory, side by side (``python -m rollpacker.bench logprobs``).

Importing this package does not import Triton; :mod:`rollpacker_kernels.logprobs` does. The tests
are ``tests/dist/test_kernels.py`` (on CPU under Triton's interpreter).
"""

from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """Triton is installed (it runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """``TRITON_INTERPRET=1`` is set: kernels run on CPU tensors, slowly, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
