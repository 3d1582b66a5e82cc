"""``python -m rollpacker.bench logprobs``: the memory of the trainer's token log-probs, three ways
(also ``python -m rollpacker_kernels.bench``).

For an output head of ``--hidden`` x ``--vocab`` (default Qwen2.5-7B: 3584 x 152064) and ``--tokens``
tokens (8k), forward + backward of: ``reference`` (full ``[T, V]`` logits and autograd),
``torch`` (the trainer's chunked torch path, ``--chunk-size`` tokens at a time) and ``kernel``
(:mod:`rollpacker_kernels.logprobs`, vocab-tiled Triton). Bytes beyond the inputs are

- computed from the shapes at the full size: the buffers each path allocates by design, in the
  inputs' ``--dtype`` (bf16, as FSDP2 trains on GPU; the torch paths upcast to fp32);
- measured on CPU at ``--measure-*`` sizes with torch's ``MemTracker`` (every tensor allocated
  inside; peak of the live total). The kernel runs under Triton's interpreter there, which holds a
  host copy of the launch's hidden and weight storages during each launch, so its CPU number is
  the computed one plus those copies (``interpreter_copy_bytes``); a GPU launch copies nothing;
- on CUDA, measured at the full size with ``torch.cuda.max_memory_allocated``, with the time of
  forward + backward.

The last line is JSON: ``peak_bytes_torch`` and ``peak_bytes_kernel`` at the full size (measured on
CUDA, computed elsewhere), plus the rest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Literal

import tyro

PATHS = ("reference", "torch", "kernel")


@dataclass
class Args:
    tokens: int = 8192
    """Tokens of one micro-batch (T)."""
    hidden: int = 3584
    """Hidden size (D)."""
    vocab: int = 152064
    """Vocabulary rows of the output head (V)."""
    chunk_size: int = 1024
    """Tokens per chunk of the torch path (the trainer's default)."""
    grad_weight_rows: int = 8192
    """Vocab rows of the kernel's fp32 scratch for a bf16 head's grad (its default)."""
    dtype: Literal["bf16", "fp32"] = "bf16"
    """Dtype of hidden and weight in the computed (and CUDA-measured) figures: bf16 or fp32."""
    measure_tokens: int = 128
    """T of the CPU measurement (the kernel runs under the slow interpreter there)."""
    measure_hidden: int = 64
    """D of the CPU measurement."""
    measure_vocab: int = 2048
    """V of the CPU measurement."""
    measure_chunk_size: int = 32
    """Torch-path chunk of the CPU measurement."""


def computed_bytes(path: str, tokens: int, hidden: int, vocab: int, chunk_size: int, grad_weight_rows: int,
                   elem: int) -> int:
    """Bytes a path allocates by design beyond its inputs, at its peak (backward), ``elem``-byte inputs."""
    t, d, v = tokens, hidden, vocab
    upcast = elem != 4  # the torch paths compute in fp32: copies of the inputs, a cast of the grads
    grads = t * d * elem + v * d * elem  # the returned grads, every path
    if path == "reference":
        # logits, log_softmax (saved), and the grad of the logits: three [T, V] fp32
        return 3 * t * v * 4 + upcast * (t * d + v * d) * 4 + grads
    if path == "torch":
        # bf16 inputs: an fp32 weight copy and an fp32 grad accumulator; one [C, V] fp32 logits block
        return upcast * 2 * v * d * 4 + min(chunk_size, t) * v * 4 + grads
    # kernel: 4 fp32 statistics per token, an fp32 hidden-grad accumulator, the weight-grad scratch
    return 4 * t * 4 + upcast * t * d * 4 + upcast * min(grad_weight_rows, v) * d * 4 + grads


def run_path(path: str, tokens: int, hidden: int, vocab: int, chunk_size: int, dtype: str, device: str) -> dict:
    """Forward + backward of one path; peak bytes beyond the inputs (and CUDA ms)."""
    import torch

    from rollpacker_kernels.reference import chunked_token_logprobs, reference_token_logprobs

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(tokens, hidden, device=device, generator=g).to(dt).requires_grad_()
    w = (torch.randn(vocab, hidden, device=device, generator=g) * 0.02).to(dt).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device, generator=g)

    def step() -> None:
        if path == "reference":
            out = reference_token_logprobs(h, w, y)
        elif path == "torch":
            out = chunked_token_logprobs(h, w, y, chunk_size=chunk_size)
        else:
            from rollpacker_kernels.logprobs import fused_token_logprobs

            out = fused_token_logprobs(h, w, y)[0]
        out.sum().backward()
        h.grad = w.grad = None

    if device == "cuda":
        step()  # compile and warm up
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return {"peak_bytes": torch.cuda.max_memory_allocated() - base, "ms": start.elapsed_time(end)}
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        step()
    return {"peak_bytes": tracker.get_tracker_snapshot("peak")[torch.device(device)]["Total"]}


def measure(path: str, args: Args, *, full: bool, device: str) -> dict:
    """:func:`run_path` in a fresh process (kernel off CUDA: under TRITON_INTERPRET=1)."""
    sizes = ((args.tokens, args.hidden, args.vocab, args.chunk_size, args.dtype) if full else
             (args.measure_tokens, args.measure_hidden, args.measure_vocab, args.measure_chunk_size, args.dtype))
    code = ("import json, sys; from rollpacker_kernels.bench import run_path; "
            f"print(json.dumps(run_path({path!r}, *{sizes!r}, {device!r})))")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpreter_copy_bytes(tokens: int, hidden: int, vocab: int, elem: int) -> int:
    """What Triton's interpreter adds to the kernel path on CPU: host copies of hidden and weight."""
    return (tokens + vocab) * hidden * elem


def gib(n: float) -> str:
    return f"{n / 2**30:8.3f} GiB"


def main(argv: list[str] | None = None) -> None:
    args = tyro.cli(Args, args=sys.argv[1:] if argv is None else argv, prog="python -m rollpacker.bench logprobs")
    import torch

    from rollpacker_kernels import triton_available

    elem = 2 if args.dtype == "bf16" else 4
    full = {p: computed_bytes(p, args.tokens, args.hidden, args.vocab, args.chunk_size, args.grad_weight_rows, elem)
            for p in PATHS}
    print(f"output head {args.hidden} x {args.vocab}, {args.tokens} tokens, {args.dtype} inputs; "
          f"bytes beyond the inputs, forward + backward")
    for p in PATHS:
        print(f"  computed  {p:9s} {gib(full[p])}")
    result = {"peak_bytes_torch": full["torch"], "peak_bytes_kernel": full["kernel"],
              "peak_bytes_reference": full["reference"], "source": "computed", **asdict(args)}

    small = (args.measure_tokens, args.measure_hidden, args.measure_vocab, args.measure_chunk_size)
    print(f"measured on CPU (MemTracker), {args.dtype}, {small[0]} tokens, head {small[1]} x {small[2]}, "
          f"chunk {small[3]}:")
    measured_cpu = {}
    for p in PATHS:
        if p == "kernel" and not triton_available():
            print("  kernel: skipped (triton is not installed)")
            continue
        measured_cpu[p] = measure(p, args, full=False, device="cpu")
        computed = computed_bytes(p, *small, args.grad_weight_rows, elem)
        note = f" + interpreter copies {interpreter_copy_bytes(*small[:3], elem)}" if p == "kernel" else ""
        got = measured_cpu[p].get("peak_bytes")
        print(f"  {p:9s} measured {got if got is not None else measured_cpu[p]} bytes, "
              f"computed {computed} bytes{note}")
    result["measured_cpu"] = measured_cpu

    if torch.cuda.is_available():
        print("measured on CUDA at the full size:")
        for p in PATHS:
            r = measure(p, args, full=True, device="cuda")
            result[f"cuda_{p}"] = r
            print(f"  {p:9s} {r}")
        for p in ("torch", "kernel"):
            if "peak_bytes" in result[f"cuda_{p}"]:
                result[f"peak_bytes_{p}"] = result[f"cuda_{p}"]["peak_bytes"]
                result["source"] = "cuda"
    else:
        print("no CUDA device: no full-size measurement, no time")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
