"""Run on 2 gloo ranks by tests/test_kernels.py: the vocab-parallel fused log-probs equal the full head's, a
rank holding no vocabulary row too."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors; before triton is imported (it jit-decorates its helpers then)

import torch
import torch.distributed as dist

from rollpacker.dist import exit_process
from rollpacker_kernels.logprobs import fused_token_logprobs


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)  # the same problem on both ranks
    num_tokens, dim, vocab, temperature = 29, 24, 211, 0.7
    hidden = torch.randn(num_tokens, dim, generator=g)
    weight = torch.randn(vocab, dim, generator=g) * 0.5
    targets = torch.randint(0, vocab, (num_tokens,), generator=g)
    targets[[2, 17]] = -100
    g_logp, g_ent = torch.randn(2, num_tokens, generator=g, dtype=torch.float64)
    # uneven: 120 and 91 rows, neither a multiple of the 32-row block; then a rank holding no row
    for bounds in ([0, 120, vocab], [0, 0, vocab]):
        check(rank, hidden, weight, targets, temperature, g_logp, g_ent, bounds)
    dist.barrier()
    if rank == 0:
        print("ok")
    exit_process(0)


def check(rank, hidden, weight, targets, temperature, g_logp, g_ent, bounds) -> None:
    h = hidden.clone().requires_grad_()
    w_local = weight[bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
    logp, entropy = fused_token_logprobs(h, w_local, targets, temperature, group=dist.group.WORLD,
                                         block_t=16, block_v=32, block_d=16)
    (logp.double() @ g_logp + entropy.double() @ g_ent).backward()

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp_all = torch.log_softmax(h64 @ w64.T / temperature, dim=-1)
    valid = targets != -100
    ref_logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1) * valid
    ref_entropy = -(logp_all.exp() * logp_all).sum(-1) * valid
    (ref_logp @ g_logp + ref_entropy @ g_ent).backward()
    checks = {"logp": (logp, ref_logp), "entropy": (entropy, ref_entropy), "grad hidden": (h.grad, h64.grad),
              "grad weight slice": (w_local.grad, w64.grad[bounds[rank]:bounds[rank + 1]])}
    for name, (actual, expected) in checks.items():
        assert actual.shape == expected.shape, f"rank {rank} {name} ({bounds}): {actual.shape} != {expected.shape}"
        if not expected.numel():
            continue
        err = (actual.double() - expected).abs().max().item()
        scale = expected.abs().max().item()
        assert err <= 1e-5 * scale, f"rank {rank} {name} ({bounds}): max abs error {err:.3g} > 1e-5 x {scale:.3g}"


if __name__ == "__main__":
    main()
