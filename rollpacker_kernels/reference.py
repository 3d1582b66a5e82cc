"""Token log-probs in torch: chunked (the trainer's path off CUDA) and plain (full logits).

``log p(target) = logit[target] - logsumexp(logits)`` with ``logits = hidden @ weight.T / temperature``.
Materializing the fp32 logits of a whole micro-batch does not fit: a 152k vocabulary (Qwen) times
16k packed tokens times 4 bytes is 9.7 GB, and autograd keeps it, plus the softmax, for backward.
:func:`chunked_token_logprobs` is a custom autograd function that works ``chunk_size`` rows at a
time in forward (logits -> logsumexp and target logit, then discard) and in backward (recompute the
chunk's logits, ``grad_logits = (onehot - softmax) * grad_out / temperature``, accumulate the
hidden and weight grads). It also returns each token's entropy ``logsumexp(z) - E_p[z]`` from the
same chunks (one more ``[chunk_size, V]`` block in forward), with its gradient
``-p * (z - E_p[z])`` for an entropy bonus. Its peak extra memory is one ``[chunk_size, V]`` block plus one
compute-dtype copy of ``weight`` and its grad accumulator (``[V, D]`` each). The Triton kernel
(:mod:`rollpacker_kernels.logprobs`) needs neither. :func:`reference_token_logprobs` is the plain,
full-materializing version both are tested against.

``softcap`` (Gemma-2's ``final_logit_softcapping``) caps the logits as ``softcap * tanh(logits /
softcap)`` before the temperature, as Hugging Face and vLLM do.

Logits are computed in fp32 (fp64 if the inputs are fp64, for gradcheck) whatever the input
dtype: bf16 logits would put errors of ~0.1 nats into importance ratios. Grads come back in the
inputs' dtypes.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    return torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32


def _capped(raw: Tensor, softcap: float | None) -> tuple[Tensor, Tensor | None]:
    """``raw`` logits capped in place (``softcap * tanh(raw / softcap)``), and ``tanh`` for the backward
    (None without a cap)."""
    if softcap is None:
        return raw, None
    t = raw.div_(softcap).tanh_()
    return t * softcap, t


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                softcap: float | None):
        dtype = _compute_dtype(hidden, weight)
        w = weight.to(dtype)  # [V, D]
        num_tokens = hidden.shape[0]
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)  # [T]
        target_logit = torch.empty_like(lse)  # [T]
        entropy = torch.empty_like(lse)  # [T]
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            logits = _capped(hidden[start:end].to(dtype) @ w.T, softcap)[0].div_(temperature)  # [C, V]
            lse[start:end] = torch.logsumexp(logits, dim=-1)
            target_logit[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1)
            logp = logits.sub_(lse[start:end, None])  # [C, V], in place
            # -E_p[log p]: lse - E_p[z] cancels two near numbers in fp32 (a peaked distribution's read negative)
            entropy[start:end] = logp.exp().mul_(logp).sum(dim=-1).neg_()
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.temperature, ctx.chunk_size, ctx.softcap = temperature, chunk_size, softcap
        ctx.set_materialize_grads(False)
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_out: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = lse.dtype
        w = weight.to(dtype)  # [V, D]
        grad_out = (torch.zeros_like(lse) if grad_out is None else grad_out.to(dtype)) / temperature  # [T]
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(dtype) / temperature  # [T]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None  # [T, D], input dtype
        grad_weight = torch.zeros_like(w) if need_weight else None  # [V, D], compute dtype
        num_tokens = hidden.shape[0]
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            h = hidden[start:end].to(dtype)  # [C, D]
            logits, tanh = _capped(h @ w.T, ctx.softcap)
            logits = logits.div_(temperature)  # [C, V]
            if grad_entropy is not None:  # d entropy / d logits = -p * (z - E_p[z]) = -p * (log p + entropy)
                logp = logits - lse[start:end, None]
                entropy_grad = logp.exp().mul_(logp.add_(entropy[start:end, None])).mul_(grad_entropy[start:end, None])
            # d logp / d logits = onehot - softmax, built in place in the logits buffer.
            grad_logits = logits.sub_(lse[start:end, None]).exp_().neg_()
            rows = torch.arange(end - start, device=h.device)
            grad_logits[rows, targets[start:end]] += 1
            grad_logits.mul_(grad_out[start:end, None])  # [C, V]
            if grad_entropy is not None:
                grad_logits.sub_(entropy_grad)
            if tanh is not None:  # through the cap: d(cap * tanh(x / cap)) / dx = 1 - tanh^2
                grad_logits.mul_(tanh.square_().neg_().add_(1))
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ w
            if need_weight:
                grad_weight.addmm_(grad_logits.T, h)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024, softcap: float | None = None) -> Tensor:
    """hidden [T, D], weight [V, D] (the LM head), targets [T] (int64) -> log p(target) [T] in fp32,
    ``chunk_size`` rows at a time; same values and grads as :func:`reference_token_logprobs`."""
    return chunked_token_logprobs_entropy(hidden, weight, targets, temperature, chunk_size, softcap)[0]


def chunked_token_logprobs_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                                   chunk_size: int = 1024, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """:func:`chunked_token_logprobs` and each token's entropy [T], both differentiable (an entropy
    bonus back-propagates through the same chunks)."""
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, D] and weight [V, D], got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected targets [{hidden.shape[0]}], got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
    return _ChunkedTokenLogprobs.apply(hidden, weight, targets.long(), temperature, chunk_size, softcap)


def _reference_logits(hidden: Tensor, weight: Tensor, temperature: float, softcap: float | None) -> Tensor:
    dtype = _compute_dtype(hidden, weight)
    logits = hidden.to(dtype) @ weight.to(dtype).T  # [T, V]
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def reference_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                             softcap: float | None = None) -> Tensor:
    """The plain version: materializes all ``[T, V]`` logits. Same shapes and dtypes as
    :func:`token_logprobs`."""
    logits = _reference_logits(hidden, weight, temperature, softcap)
    return torch.log_softmax(logits, dim=-1).gather(1, targets.long()[:, None]).squeeze(1)


def reference_token_logprobs_entropy(hidden: Tensor, weight: Tensor, targets: Tensor,
                                     temperature: float = 1.0, softcap: float | None = None) -> tuple[Tensor, Tensor]:
    """The plain version of :func:`chunked_token_logprobs_entropy`."""
    logits = _reference_logits(hidden, weight, temperature, softcap)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return logp.gather(1, targets.long()[:, None]).squeeze(1), entropy
