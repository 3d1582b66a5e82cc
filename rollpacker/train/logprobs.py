"""Per-token log-probabilities of the sampled tokens, without the full ``[T, V]`` logits.

The trainer's one call, :func:`token_logprobs`, picks an implementation of
:mod:`rollpacker_kernels`: the chunked torch path (:mod:`rollpacker_kernels.reference`, one
``[chunk_size, V]`` logits block at a time) or the vocab-tiled Triton kernel
(:mod:`rollpacker_kernels.logprobs`: no logits block, no weight copy; fp32 grad accumulators only).
``train.logprobs_impl`` chooses; ``auto`` picks the kernel on CUDA when Triton is installed, the
torch path elsewhere; the torch path also caps logits (Gemma-2's ``final_logit_softcapping``).
:func:`token_logprobs_entropy` also returns each token's entropy, from the same chunks or kernel,
differentiable (for an entropy bonus). This is numerics plumbing, not part of the paper's method.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollpacker_kernels.reference import chunked_token_logprobs_entropy


def resolve_impl(impl: str, device: torch.device, softcap: float | None = None) -> str:
    """``auto`` -> triton on CUDA when Triton is installed (and no ``softcap``), else torch; triton is
    checked to be runnable."""
    from rollpacker_kernels import interpreting, triton_available

    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"train.logprobs_impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() and softcap is None else "torch"
    if impl == "triton" and softcap is not None:
        raise ValueError(f"train.logprobs_impl=triton: the model caps its logits (final_logit_softcapping={softcap}), "
                         "which the fused kernel does not; use torch or auto")
    if impl == "triton" and not triton_available():
        raise ValueError("train.logprobs_impl=triton: Triton is not installed (pip install triton), or use torch")
    if impl == "triton" and device.type != "cuda" and not interpreting():
        raise ValueError(f"train.logprobs_impl=triton: tensors are on {device}; Triton needs CUDA "
                         "(or TRITON_INTERPRET=1, the slow interpreter) -- use torch or auto")
    return impl


def token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024,
    impl: str = "torch", softcap: float | None = None,
) -> Tensor:
    """hidden [T, D], weight [V, D] (the LM head), targets [T] (int64) -> log p(target) [T] in fp32.

    Same values and grads as :func:`~rollpacker_kernels.reference.reference_token_logprobs`: ``impl``
    torch, ``chunk_size`` rows at a time; triton, the fused kernel; auto, see :func:`resolve_impl`.
    ``softcap``: logits capped as ``softcap * tanh(logits / softcap)`` before the temperature.
    """
    return token_logprobs_entropy(hidden, weight, targets, temperature, chunk_size, impl, softcap)[0]


def token_logprobs_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024,
    impl: str = "torch", softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and each token's entropy ``lse(z) - E_p[z]`` [T], both fp32, both
    differentiable (an entropy bonus back-propagates through the same chunks or kernel)."""
    if resolve_impl(impl, hidden.device, softcap) == "triton":
        from rollpacker_kernels.logprobs import fused_token_logprobs

        return fused_token_logprobs(hidden, weight, targets, temperature)
    return chunked_token_logprobs_entropy(hidden, weight, targets, temperature, chunk_size, softcap)
