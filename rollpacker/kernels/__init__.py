"""Triton kernels for the trainer's hot spots (the design's ``kernels/``; it lives inside the package
because a top-level ``kernels`` would shadow Hugging Face's ``kernels`` package, which transformers
probes for by that name).

Importing this package does not import Triton; :mod:`rollpacker.kernels.logprobs` does.
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
