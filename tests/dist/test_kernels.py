"""rollpacker_kernels: the fused log-prob/entropy kernel equals the plain torch computation.

Off CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set here before the
kernels are defined), so these run in CI on CPU; shapes are small and deliberately not multiples
of the blocks. The 2-rank vocab-parallel case runs on real gloo ranks (``tests/dist/kernels_tp.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from rollpacker_kernels import triton_available

if not triton_available():
    pytest.skip("triton is not installed (launch/install.sh dev installs it)", allow_module_level=True)
if not torch.cuda.is_available():
    # Triton decorates its own jit helpers (tl.sum, tl.max) when imported: it must see this first.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("tests/test_kernels.py: triton was imported before TRITON_INTERPRET=1 could be set; "
                           "set TRITON_INTERPRET=1 in the environment, or find the earlier import of triton")
    os.environ["TRITON_INTERPRET"] = "1"
from support.jobs import torchrun

from rollpacker.train.logprobs import resolve_impl, token_logprobs
from rollpacker_kernels.logprobs import compiled, default_precision, fused_token_logprobs, launch_settings, tf32_allowed

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="runs CPU tensors through Triton's interpreter")
BLOCKS = {"block_t": 16, "block_v": 64, "block_d": 16}  # T=37, V=333, D=40 leave partial blocks on every axis


def reference(hidden, weight, targets, temperature, ignore_index=-100):
    """fp64, full [T, V] logits: (log p(target), entropy), 0 at ignored targets."""
    logp_all = torch.log_softmax(hidden.double() @ weight.double().T / temperature, dim=-1)
    valid = targets != ignore_index
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp * valid, entropy * valid


def close(actual, expected, name):
    """Within 1e-5 of the expected tensor's largest magnitude, elementwise."""
    scale = expected.abs().max().item()
    err = (actual.double().cpu() - expected.double().cpu()).abs().max().item()
    assert err <= 1e-5 * scale, f"{name}: max abs error {err:.3g} > 1e-5 x {scale:.3g}"


def problem(seed=0, num_tokens=37, dim=40, vocab=333, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=g)
    weight = torch.randn(vocab, dim, generator=g) * 0.5
    targets = torch.randint(0, vocab, (num_tokens,), generator=g)
    targets[[0, 5, num_tokens - 1]] = -100  # masked tokens, at both ends of a block
    grads = torch.randn(2, num_tokens, generator=g, dtype=torch.float64)
    return hidden.to(DEVICE, dtype), weight.to(DEVICE, dtype), targets.to(DEVICE), grads


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_values_and_grads_match_torch(temperature):
    hidden, weight, targets, (g_logp, g_ent) = problem()
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, entropy = fused_token_logprobs(h, w, targets, temperature, **BLOCKS)
    (logp.double().cpu() @ g_logp + entropy.double().cpu() @ g_ent).backward()

    h64, w64 = hidden.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
    ref_logp, ref_entropy = reference(h64, w64, targets.cpu(), temperature)
    (ref_logp @ g_logp + ref_entropy @ g_ent).backward()
    assert logp.dtype == entropy.dtype == torch.float32
    close(logp, ref_logp, "logp")
    close(entropy, ref_entropy, "entropy")
    close(h.grad, h64.grad, "grad hidden")
    close(w.grad, w64.grad, "grad weight")
    assert (logp[[0, 5, 36]] == 0).all() and (h.grad[[0, 5, 36]] == 0).all()


def test_logprobs_only_frozen_head_and_one_block():
    """No entropy grad, no weight grad (a frozen head), and a whole vocab in one block."""
    hidden, weight, targets, (g_logp, _) = problem(seed=1, vocab=50)
    h = hidden.clone().requires_grad_()
    logp, _ = fused_token_logprobs(h, weight, targets, 0.8, block_t=16, block_v=64, block_d=64)
    (logp.double().cpu() @ g_logp).backward()
    h64 = hidden.double().cpu().requires_grad_()
    ref_logp, _ = reference(h64, weight.cpu(), targets.cpu(), 0.8)
    (ref_logp @ g_logp).backward()
    close(logp, ref_logp, "logp")
    close(h.grad, h64.grad, "grad hidden")


def test_bf16_inputs_give_fp32_logprobs_and_bf16_grads():
    hidden, weight, targets, (g_logp, _) = problem(seed=2, dtype=torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, _ = fused_token_logprobs(h, w, targets, 1.0, **BLOCKS, grad_weight_rows=100)  # 3 chunks and a part
    (logp.double().cpu() @ g_logp).backward()
    assert logp.dtype == torch.float32 and h.grad.dtype == w.grad.dtype == torch.bfloat16
    h64, w64 = hidden.double().cpu().requires_grad_(), weight.double().cpu().requires_grad_()
    ref_logp, _ = reference(h64, w64, targets.cpu(), 1.0)
    (ref_logp @ g_logp).backward()
    close(logp, ref_logp, "logp (fp32 logits of bf16 operands)")
    torch.testing.assert_close(h.grad.double().cpu(), h64.grad, rtol=1e-2, atol=1e-2 * h64.grad.abs().max().item())
    torch.testing.assert_close(w.grad.double().cpu(), w64.grad, rtol=1e-2, atol=1e-2 * w64.grad.abs().max().item())


def test_trainer_hook_triton_equals_torch():
    hidden, weight, targets, (g_logp, _) = problem(seed=3)
    targets = targets.clamp(min=0)  # the trainer never masks: it picks response positions
    out = {}
    for impl in ("torch", "triton"):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logp = token_logprobs(h, w, targets, 0.7, chunk_size=16, impl=impl)
        (logp.double().cpu() @ g_logp).backward()
        out[impl] = (logp, h.grad, w.grad)
    for name, a, b in zip(("logp", "grad hidden", "grad weight"), out["triton"], out["torch"]):
        close(a, b, name)


def test_impl_choice_and_errors(monkeypatch):
    from rollpacker.train.config import TrainConfig

    assert resolve_impl("auto", torch.device("cpu")) == "torch"
    assert resolve_impl("auto", torch.device("cuda")) == "triton"  # triton is installed here
    with pytest.raises(ValueError, match="logprobs_impl"):
        resolve_impl("cuda", torch.device("cpu"))
    with pytest.raises(ValueError, match="train.logprobs_impl"):
        TrainConfig(logprobs_impl="cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton needs CUDA"):
        resolve_impl("triton", torch.device("cpu"))
    hidden, weight, targets, _ = problem()
    with pytest.raises(ValueError, match="block_v=48"):
        fused_token_logprobs(hidden, weight, targets, block_v=48)
    with pytest.raises(ValueError, match="num_warps=6"):
        fused_token_logprobs(hidden, weight, targets, num_warps=6)
    with pytest.raises(ValueError, match="precision='tf64' must be one of tf32, ieee"):
        fused_token_logprobs(hidden, weight, targets, precision="tf64")
    # TF32 holds 16-bit operands exactly, not fp32 ones
    assert default_precision(torch.bfloat16, torch.float16) == "tf32"
    assert default_precision(torch.bfloat16, torch.float32) == default_precision(torch.float32) == "ieee"
    if not torch.cuda.is_available():  # the interpreter's kernels: gpu_check's stage (d) compiles them elsewhere
        with pytest.raises(RuntimeError, match="in a process without it"):
            compiled()
    with pytest.raises(ValueError, match="float64"):
        fused_token_logprobs(hidden.double(), weight, targets)


@pytest.mark.parametrize("arch", ["gfx90a", "gfx942", "gfx950", "gfx1100"])
def test_on_an_amd_gpu_tf32_is_chosen_where_tritons_compiler_takes_it_and_refused_elsewhere(arch):
    """MI250, MI300, MI355, RX 7900: the rule against the options Triton's AMD backend gives that architecture."""
    from triton.backends.amd.compiler import HIPBackend
    from triton.backends.compiler import GPUTarget

    options = HIPBackend(GPUTarget("hip", arch, 64)).parse_options({"enable_fp_fusion": True})  # as the launch's
    taken = "tf32" in options.allowed_dot_input_precisions
    assert tf32_allowed(arch) == taken
    assert default_precision(torch.bfloat16, arch=arch) == ("tf32" if taken else "ieee")
    assert default_precision(torch.float32, arch=arch) == "ieee"
    if not taken:
        with pytest.raises(ValueError, match=f"precision='tf32' does not compile on {arch}"):
            launch_settings((torch.bfloat16,), 64, 128, 32, 8, "tf32", arch)


def test_the_launch_options_are_tritons_and_pin_fma_contraction():
    """Left to Triton's default, FMA contraction warns at a run's first compile on Triton 3.9 and is off from 3.10
    (other numerics, slower kernels): the options are ones Triton's CUDA and AMD backends take, without a warning."""
    from triton.backends.amd.compiler import HIPBackend
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    launch = launch_settings((torch.bfloat16,), 64, 128, 32, 8, None)
    options = {name: value for name, value in launch.items() if not name.isupper()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backend in CUDABackend(GPUTarget("cuda", 90, 32)), HIPBackend(GPUTarget("hip", "gfx942", 64)):
            parsed = backend.parse_options(options)
            assert parsed.enable_fp_fusion and parsed.num_warps == 8


@pytest.mark.slow
def test_fp32_operands_fit_the_shared_memory_of_an_sm89_card():
    """Compiled for sm_89 (L40S, RTX 4090: 101376 bytes of shared memory a program) by Triton's compiler with no
    GPU, in a process without the interpreter: fp32 operands at their default blocks fit; bf16 ones too."""
    script = ("import json, torch; from rollpacker_kernels.logprobs import compiled; "
              "print(json.dumps({str(t): compiled(89, t) for t in (torch.float32, torch.bfloat16)}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    shared = {(dtype, name): k["shared_bytes"] for dtype, kernels in found.items() for name, k in kernels.items()}
    assert len(shared) == 6 and max(shared.values()) <= 101376, shared


def test_vocab_parallel_two_ranks():
    """The head split unevenly over 2 gloo ranks, then all on one: same values and grads as the unsplit head."""
    assert "ok" in torchrun("kernels_tp.py", 2, timeout=240)


@CPU_ONLY
def test_trainer_grads_with_the_kernel_equal_torch(toy_random_dir):
    """The real trainer's gradients (toy model, tied head, temperature 0.8) with each impl."""
    from rollpacker.dist import build_meshes
    from rollpacker.model import load_model
    from rollpacker.train.config import TrainConfig
    from rollpacker.train.trainer import Sample, Trainer, spread

    meshes = build_meshes(1, 0)
    g = torch.Generator().manual_seed(0)
    def ids(n: int) -> list[int]:
        return torch.randint(2, 250, (n,), generator=g).tolist()

    samples = [Sample(ids(p), ids(r), adv, [-1.0] * r) for p, r, adv in ((5, 9, 1.0), (3, 14, -0.5), (7, 4, 0.25))]
    grads = {}
    for impl in ("torch", "triton"):
        trainer = Trainer(load_model(toy_random_dir), TrainConfig(logprobs_impl=impl), meshes.train, temperature=0.8,
                          num_steps=1)
        plan = spread([s.num_tokens for s in samples], 1, trainer.config.micro_batch_tokens)
        trainer._backward(samples, trainer._prepare(samples), plan, trainer.ranks, sync_last=True)  # step() up to
        # its optimizer step
        grads[impl] = {k: p.grad.full_tensor() for k, p in trainer.model.named_parameters()}
    head = "embed_tokens.weight"  # tied: the head's grad comes from the kernel
    assert not torch.equal(grads["triton"][head], grads["torch"][head]), "the kernel did not run"
    for name, expected in grads["torch"].items():
        close(grads["triton"][name], expected, f"grad of {name}")


@CPU_ONLY
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_bench_formulas_match_measured_bytes(dtype):
    """The bench's bytes-from-shapes, against MemTracker on CPU: the kernel's within 1% (plus the
    interpreter's host copies), the torch paths' in bf16 within 10% (small temporaries the formulas
    leave out; in fp32 CPU matmuls add a transposed copy of the weight, which GPU ones do not)."""
    from rollpacker_kernels.bench import computed_bytes, interpreter_copy_bytes, run_path

    elem = 2 if dtype == "bf16" else 4
    sizes = (64, 32, 1024)  # tokens, hidden, vocab
    for path in ("kernel", "torch", "reference"):
        measured = run_path(path, *sizes, 16, dtype, "cpu")["peak_bytes"]
        computed = computed_bytes(path, *sizes, 16, 8192, elem)
        if path == "kernel":
            computed += interpreter_copy_bytes(*sizes, elem)
            assert abs(measured - computed) <= 0.01 * computed, (path, measured, computed)
        elif dtype == "bf16":
            assert abs(measured - computed) <= 0.1 * computed, (path, measured, computed)
