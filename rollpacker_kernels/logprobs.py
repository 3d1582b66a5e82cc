"""Fused log-probs and entropy of the sampled tokens, from the final hidden states and the output head.

``z = hidden @ weight.T / temperature``; per token ``logp = z[target] - logsumexp(z)`` and
``entropy = logsumexp(z) - sum(softmax(z) * z)``. The ``[T, V]`` logits never exist: each program
owns a block of tokens (forward, grad of hidden) or of vocab rows (grad of weight), builds
``[BLOCK_T, BLOCK_V]`` logit tiles from ``BLOCK_D`` slices of both operands, and keeps online
max / sum-exp statistics (flash-attention style). Backward recomputes the tiles (three logit
passes in all: forward, grad of hidden, grad of weight), so nothing ``[T, V]``-sized is saved.
Extra memory: fp32 per-token statistics, an fp32 ``[T, D]`` hidden-grad accumulator, and for a
bf16/fp16 head an fp32 scratch of ``grad_weight_rows`` vocab rows (an fp32 head's grad is its own
accumulator): no fp32 copy of the weight, no ``[V, D]`` fp32 grad.
The gradient of a tile is ``d/dz = g_logp * (onehot - p) - g_entropy * p * (z - E_p[z])``.

Vocab-parallel: with ``group``, ``weight`` is this rank's contiguous slice of the vocab rows
(ranks in order; slices may differ in size, found by one all-gather) and ``targets`` are global
ids. Each rank's partial max, sum-exp, ``sum p * (z - max)`` and target logit are reduced across
the group (a MAX all-reduce of ``[T]``, a SUM of ``[3, T]``); backward all-reduces the hidden
grad, whose vocab sum is split over ranks. ``hidden`` must be the same on every rank of the group.

How it differs from Liger-Kernel 0.8.5 (read, not copied): its fused linear cross-entropy chunks
tokens only and materializes a ``[chunk, V]`` logits block in the input dtype (bf16 logits on GPU,
~0.1-nat errors the trainer's importance ratios cannot afford), with no temperature, entropy or
vocab-parallel head; its vocab-parallel cross-entropy starts from materialized logits; its fused
GRPO loss (torch, seq x vocab chunks) owns the whole loss and its normalization. Here operands are
read in their own dtype and every logit is an fp32 sum of exact products (TF32 tensor cores for
16-bit operands, :func:`default_precision`). Targets equal to ``ignore_index`` give 0 and no gradient.

:func:`compiled` compiles the three kernels ahead of time for a CUDA architecture with no GPU (Triton ships
ptxas and cuobjdump) and reads their registers, local memory (spills) and shared memory: what the interpreter
that runs them in CI cannot say.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w, inv_temp,
                 BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """z[rows, cols] = hidden[rows] @ weight[cols].T * inv_temp, fp32 [BLOCK_T, BLOCK_V]."""
    acc = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        dd = d0 + tl.arange(0, BLOCK_D)
        d_ok = dd < D
        h = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_w + dd[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        # TF32 holds a bf16 or fp16 value exactly, so its tensor-core products are exact. Native bf16 dots
        # would be twice as fast, but Triton's interpreter computes them wrongly: that path cannot be tested.
        acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision=PRECISION)
    return acc * inv_temp


@triton.jit
def _grad_tile(z, rows, cols, row_ok, col_ok, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, target_offset,
               inv_temp):
    """d loss / d (hidden @ weight.T) for one tile, fp32; zero outside the valid rows and columns."""
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1) - target_offset
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)  # E_p[z]
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
    p = tl.exp(z - lse[:, None])
    onehot = cols[None, :] == y[:, None]
    g = tl.where(onehot, glp[:, None], 0.0) - p * (glp[:, None] + gent[:, None] * (z - mean[:, None]))
    return tl.where(row_ok[:, None] & col_ok[None, :], g * inv_temp, 0.0)


@triton.jit
def _forward_kernel(h_ptr, w_ptr, y_ptr, max_ptr, sumexp_ptr, plogit_ptr, target_ptr,
                    T, V, D, stride_h, stride_w, target_offset, inv_temp,
                    BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """Per token over this weight's rows: max z, sum exp(z - max), sum exp(z - max) * (z - max), z[target]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    y = tl.load(y_ptr + rows, mask=row_ok, other=-1) - target_offset
    m = tl.full((BLOCK_T,), -1.0e30, dtype=tl.float32)  # finite: rescaling an empty row never makes 0 * inf
    s = tl.zeros((BLOCK_T,), dtype=tl.float32)
    ps = tl.zeros((BLOCK_T,), dtype=tl.float32)
    tgt = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w, inv_temp,
                         BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
        z = tl.where(col_ok[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=1))
        alpha = tl.exp(m - m_new)
        shifted = tl.where(col_ok[None, :], z - m_new[:, None], 0.0)
        e = tl.where(col_ok[None, :], tl.exp(shifted), 0.0)
        ps = alpha * (ps + (m - m_new) * s) + tl.sum(e * shifted, axis=1)
        s = alpha * s + tl.sum(e, axis=1)
        tgt += tl.sum(tl.where((cols[None, :] == y[:, None]) & col_ok[None, :], z, 0.0), axis=1)
        m = m_new
    tl.store(max_ptr + rows, m, mask=row_ok)
    tl.store(sumexp_ptr + rows, s, mask=row_ok)
    tl.store(plogit_ptr + rows, ps, mask=row_ok)
    tl.store(target_ptr + rows, tgt, mask=row_ok)


@triton.jit
def _grad_hidden_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, gh_ptr,
                        T, V, D, stride_h, stride_w, target_offset, inv_temp,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """grad_hidden[rows] (fp32, zero-initialized) += grad_z @ weight, this program's rows only."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w, inv_temp,
                         BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
        g = _grad_tile(z, rows, cols, row_ok, col_ok, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, target_offset,
                       inv_temp)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            d_ok = dd < D
            w = tl.load(w_ptr + cols[:, None] * stride_w + dd[None, :], mask=col_ok[:, None] & d_ok[None, :],
                        other=0.0)
            out = gh_ptr + rows[:, None] * D + dd[None, :]
            ok = row_ok[:, None] & d_ok[None, :]
            acc = tl.load(out, mask=ok, other=0.0)
            acc = tl.dot(g, w.to(tl.float32), acc, input_precision=PRECISION)
            tl.store(out, acc, mask=ok)


@triton.jit
def _grad_weight_kernel(h_ptr, w_ptr, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, gw_ptr,
                        T, V, D, stride_h, stride_w, target_offset, inv_temp,
                        BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """grad_weight[cols] (fp32, zero-initialized) += grad_z.T @ hidden, this program's vocab rows only."""
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    for t0 in range(0, T, BLOCK_T):
        rows = t0 + tl.arange(0, BLOCK_T)
        row_ok = rows < T
        z = _logits_tile(h_ptr, w_ptr, rows, cols, row_ok, col_ok, D, stride_h, stride_w, inv_temp,
                         BLOCK_T, BLOCK_V, BLOCK_D, PRECISION)
        g = _grad_tile(z, rows, cols, row_ok, col_ok, y_ptr, lse_ptr, mean_ptr, glp_ptr, gent_ptr, target_offset,
                       inv_temp)
        for d0 in range(0, D, BLOCK_D):
            dd = d0 + tl.arange(0, BLOCK_D)
            d_ok = dd < D
            h = tl.load(h_ptr + rows[:, None] * stride_h + dd[None, :], mask=row_ok[:, None] & d_ok[None, :],
                        other=0.0)
            out = gw_ptr + cols[:, None] * D + dd[None, :]
            ok = col_ok[:, None] & d_ok[None, :]
            acc = tl.load(out, mask=ok, other=0.0)
            acc = tl.dot(tl.trans(g), h.to(tl.float32), acc, input_precision=PRECISION)
            tl.store(out, acc, mask=ok)


def vocab_start(weight: Tensor, group: dist.ProcessGroup | None) -> int:
    """Global id of this rank's first vocab row: the rows of the lower ranks of ``group``."""
    if group is None:
        return 0
    sizes = [torch.zeros(1, dtype=torch.long, device=weight.device) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([weight.shape[0]], device=weight.device), group=group)
    return int(sum(int(n) for n in sizes[: dist.get_rank(group)]))


class _FusedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, group, ignore_index, launch, grad_weight_rows):
        (num_tokens, dim), vocab = hidden.shape, weight.shape[0]
        offset = vocab_start(weight, group)
        stats = torch.empty(4, num_tokens, dtype=torch.float32, device=hidden.device)  # max, sumexp, plogit, target
        _forward_kernel[(triton.cdiv(num_tokens, launch["BLOCK_T"]),)](
            hidden, weight, targets, *stats, num_tokens, vocab, dim, hidden.stride(0), weight.stride(0), offset,
            1.0 / temperature, **launch)
        m, s, ps, tgt = stats
        if group is not None:
            m_all = m.clone()
            dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
            alpha = torch.exp(m - m_all)  # rebase this rank's sums on the global max
            parts = torch.stack([alpha * s, alpha * (ps + (m - m_all) * s), tgt])
            dist.all_reduce(parts, group=group)
            m, (s, ps, tgt) = m_all, parts
        valid = targets != ignore_index
        lse = m + torch.log(s)
        entropy = torch.log(s) - ps / s
        mean = lse - entropy  # E_p[z]
        ctx.save_for_backward(hidden, weight, targets, lse, mean, valid)
        ctx.temperature, ctx.group, ctx.offset = temperature, group, offset
        ctx.launch, ctx.grad_weight_rows = launch, grad_weight_rows
        zero = torch.zeros_like(lse)
        return torch.where(valid, tgt - lse, zero), torch.where(valid, entropy, zero)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, mean, valid = ctx.saved_tensors
        (num_tokens, dim), vocab = hidden.shape, weight.shape[0]
        zero = torch.zeros_like(lse)
        glp = zero if grad_logp is None else torch.where(valid, grad_logp.float(), zero).contiguous()
        gent = zero if grad_entropy is None else torch.where(valid, grad_entropy.float(), zero).contiguous()
        args = (targets, lse, mean, glp, gent)
        inv_temp = 1.0 / ctx.temperature
        scalars = (hidden.stride(0), weight.stride(0), ctx.offset, inv_temp)
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.zeros(num_tokens, dim, dtype=torch.float32, device=hidden.device)
            _grad_hidden_kernel[(triton.cdiv(num_tokens, ctx.launch["BLOCK_T"]),)](
                hidden, weight, *args, grad_hidden, num_tokens, vocab, dim, *scalars, **ctx.launch)
            if ctx.group is not None:
                dist.all_reduce(grad_hidden, group=ctx.group)
            grad_hidden = grad_hidden.to(hidden.dtype)
        if ctx.needs_input_grad[1]:  # fp32 accumulation; a non-fp32 weight's grad goes through a row-chunk scratch
            fp32 = weight.dtype == torch.float32
            grad_weight = torch.zeros_like(weight) if fp32 else torch.empty_like(weight)
            step = max(vocab, 1) if fp32 else ctx.grad_weight_rows  # a vocab-parallel rank may hold no row
            scratch = grad_weight if fp32 else torch.empty(min(step, vocab), dim, dtype=torch.float32,
                                                            device=weight.device)
            for start in range(0, vocab, step):
                rows = min(step, vocab - start)
                out = scratch[:rows].zero_()
                _grad_weight_kernel[(triton.cdiv(rows, ctx.launch["BLOCK_V"]),)](
                    hidden, weight[start:start + rows], *args, out, num_tokens, rows, dim, hidden.stride(0),
                    weight.stride(0), ctx.offset + start, inv_temp, **ctx.launch)
                if not fp32:
                    grad_weight[start:start + rows] = out
        return grad_hidden, grad_weight, None, None, None, None, None, None


def fused_token_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, *,
    group: dist.ProcessGroup | None = None, ignore_index: int = -100,
    block_t: int = 64, block_v: int = 128, block_d: int = 32, grad_weight_rows: int = 8192, num_warps: int = 8,
    precision: str | None = None,
) -> tuple[Tensor, Tensor]:
    """hidden [T, D], weight [V, D] (the output head, or this rank's vocab slice of it with ``group``),
    targets [T] (global ids) -> (log p(target) [T], entropy [T]), fp32; 0 where target == ignore_index.

    Blocks are powers of two >= 16 (``tl.dot``'s minimum); any T, V, D work. A bf16/fp16 weight's
    grad is accumulated in fp32 ``grad_weight_rows`` vocab rows at a time (that much fp32 scratch).
    ``num_warps`` per program (CUDA; the interpreter ignores it). ``precision``, the dots'
    ``input_precision``, defaults to :func:`default_precision` (on AMD GPUs but MI300's, fp32 FMA). With the
    default blocks and warps, ptxas fits all three kernels in registers for 16-bit operands on sm_80, sm_89
    and sm_90 (no local memory, Triton 3.6; docs/results.md), which 64 x 128 x 64 with 4 warps did not;
    ``block_d`` 32 keeps fp32 operands within the 101376 bytes of shared memory of sm_86 and sm_89 cards (114688 at 64).
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_token_logprobs: expected hidden [T, D] and weight [V, D], "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"fused_token_logprobs: expected targets [{hidden.shape[0]}], got {tuple(targets.shape)}")
    for t, name in ((hidden, "hidden"), (weight, "weight")):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"fused_token_logprobs: {name} is {t.dtype}; the kernel takes fp32, bf16 or fp16 "
                             "(use rollpacker_kernels.reference.reference_token_logprobs for fp64)")
    launch = launch_settings((hidden.dtype, weight.dtype), block_t, block_v, block_d, num_warps, precision,
                             amd_arch(hidden.device))
    if grad_weight_rows < 1:
        raise ValueError(f"fused_token_logprobs: grad_weight_rows={grad_weight_rows} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"fused_token_logprobs: temperature={temperature} must be > 0")
    return _FusedTokenLogprobs.apply(hidden.contiguous(), weight.contiguous(), targets.long().contiguous(),
                                     float(temperature), group, ignore_index, launch, grad_weight_rows)


PRECISIONS = ("tf32", "ieee")
"""The dots' ``input_precision``: TF32 tensor cores, or fp32 FMA."""


def default_precision(*dtypes: torch.dtype, arch: str = "") -> str:
    """TF32 for 16-bit operands, fp32 FMA where one is fp32. TF32 keeps 10 mantissa bits, which hold any bf16 or
    fp16 value exactly: the logit tiles' products are exact and accumulate in fp32, on tensor cores (about 7x fp32
    FMA's throughput on an H100, by NVIDIA's datasheet). Only the grad tiles, computed in fp32, are rounded to TF32
    (2^-11 relative) where they meet a 16-bit operand: finer than the bf16 gradients they make. An fp32 operand
    would be rounded, so fp32 stays exact, as torch's matmul is by default. ``arch``, an AMD GPU's (:func:`amd_arch`):
    Triton takes TF32 there on gfx942 (MI300) alone, so fp32 FMA elsewhere."""
    return "ieee" if torch.float32 in dtypes or not tf32_allowed(arch) else "tf32"


def amd_arch(device: torch.device) -> str:
    """The architecture of ``device`` when it is an AMD GPU (``gfx90a``, ``gfx942``...), else empty."""
    if device.type != "cuda" or not torch.version.hip:
        return ""
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]


def tf32_allowed(arch: str) -> bool:
    """Whether Triton compiles a TF32 dot for ``arch`` (:func:`amd_arch`; empty: NVIDIA, or the interpreter)."""
    return not arch or arch == "gfx942"


def launch_settings(dtypes: tuple[torch.dtype, ...], block_t: int, block_v: int, block_d: int, num_warps: int,
                    precision: str | None, arch: str = "") -> dict:
    """The kernels' constexprs (upper-case) and compile options (warps, FMA contraction) for operands of ``dtypes``
    on ``arch`` (:func:`amd_arch`), checked; ``precision`` None: the default."""
    precision = precision or default_precision(*dtypes, arch=arch)
    if precision not in PRECISIONS:
        raise ValueError(f"fused_token_logprobs: precision={precision!r} must be one of {', '.join(PRECISIONS)}")
    if precision == "tf32" and not tf32_allowed(arch):
        raise ValueError(f"fused_token_logprobs: precision='tf32' does not compile on {arch} (Triton takes TF32 "
                         "dots on AMD's gfx942 alone); use precision='ieee', or leave it unset")
    for b, name in ((block_t, "block_t"), (block_v, "block_v"), (block_d, "block_d")):
        if b < 16 or b & (b - 1):
            raise ValueError(f"fused_token_logprobs: {name}={b} must be a power of two >= 16")
    if num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"fused_token_logprobs: num_warps={num_warps} must be a power of two")
    # FMA contraction pinned on: Triton 3.9 warns where it is left to its default, which 3.10 turns off
    return dict(BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_D=block_d, PRECISION=precision, num_warps=num_warps,
                enable_fp_fusion=True)


LAUNCH_ARGS = ("block_t", "block_v", "block_d", "num_warps", "precision")
"""The settings of :func:`fused_token_logprobs` that :func:`compiled` takes, with the same defaults."""

OPERAND_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def compiled(arch: int = 90, dtype: torch.dtype = torch.bfloat16, **config) -> dict[str, dict[str, int]]:
    """The three kernels compiled for CUDA ``sm_{arch}`` as :func:`fused_token_logprobs` with ``config`` (its
    :data:`LAUNCH_ARGS`, at its defaults) compiles them on ``dtype`` operands, by Triton's compiler and ptxas, with
    no GPU: per kernel, ``registers`` and ``local_bytes`` per thread (local memory: spilled registers, arrays not
    held in registers; 0 is best) and ``shared_bytes`` per program. Raises what the compiler raises: a kernel the
    interpreter runs may still not compile. Needs ``TRITON_INTERPRET`` unset when this module was imported (the
    interpreter's kernels cannot compile)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(_forward_kernel, triton.runtime.JITFunction):
        raise RuntimeError("rollpacker_kernels.logprobs.compiled: the kernels were defined under TRITON_INTERPRET=1 "
                           "and cannot compile; call it in a process without it")
    defaults = {k: p.default for k, p in inspect.signature(fused_token_logprobs).parameters.items() if k in LAUNCH_ARGS}
    constexprs = launch_settings((dtype,), **(defaults | config))
    options = {name: constexprs.pop(name) for name in ("num_warps", "enable_fp_fusion")}
    operand = OPERAND_TYPES[dtype]
    types = {"h_ptr": f"*{operand}", "w_ptr": f"*{operand}", "y_ptr": "*i64", "inv_temp": "fp32"}
    types |= {name: "constexpr" for name in constexprs}
    found = {}
    for kernel in (_forward_kernel, _grad_hidden_kernel, _grad_weight_kernel):
        signature = {name: types.get(name, "*fp32" if name.endswith("_ptr") else "i32") for name in kernel.arg_names}
        source = ASTSource(kernel, signature, constexprs=constexprs)
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.TemporaryDirectory() as tmp:
            cubin = Path(tmp, "kernel.cubin")
            cubin.write_bytes(binary.asm["cubin"])
            usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(cubin)],
                                   capture_output=True, text=True, check=True).stdout
        registers, local = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
        name = kernel.fn.__name__.strip("_").removesuffix("_kernel")
        found[name] = {"registers": int(registers), "local_bytes": int(local), "shared_bytes": binary.metadata.shared}
    return found
