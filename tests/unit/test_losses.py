"""GRPO advantages and the PPO-clip loss against hand-computed values, and the chunked token
log-probabilities against the full-materializing reference (values, grads, gradcheck)."""

from __future__ import annotations

import math

import pytest
import torch

from rollpacker.train.logprobs import token_logprobs
from rollpacker.train.losses import group_advantages, k3_kl, policy_loss
from rollpacker_kernels.reference import reference_token_logprobs

# --- advantages ---------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    # Group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.5773503
    #   -> +-0.5 / 0.5773503 = +-0.8660254.
    # Group 1: mean 0.75, deviations (0.25, 0.25, 0.25, -0.75), var = (3 * 0.0625 + 0.5625) / 3
    #   = 0.25, std = 0.5 -> (0.5, 0.5, 0.5, -1.5).
    expected = torch.tensor([[0.8660254, -0.8660254, -0.8660254, 0.8660254], [0.5, 0.5, 0.5, -1.5]])
    torch.testing.assert_close(group_advantages(rewards), expected, atol=1e-5, rtol=0)
    # Dr.GRPO: mean-centering only.
    expected_centered = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]])
    torch.testing.assert_close(group_advantages(rewards, scale_by_std=False), expected_centered)


def test_group_advantages_flat_groups_are_exactly_zero():
    rewards = torch.tensor([[0.7, 0.7, 0.7], [1.0, 0.0, 1.0]])
    adv = group_advantages(rewards, eps=0.0)
    assert torch.isfinite(adv).all()
    assert (adv[0] == 0).all()
    assert (adv[1] != 0).all()
    assert (group_advantages(rewards, scale_by_std=False)[0] == 0).all()
    single = group_advantages(torch.tensor([[3.0], [1.0]]))  # groups of one: unbiased std is NaN
    assert (single == 0).all()


# --- policy loss --------------------------------------------------------------------------------

RATIOS = [1.5, 0.5, 1.1, 0.7]


def clip_example():
    """Two sequences with ratios RATIOS, A = +1 and -1, the last token of row 0 off the mask and
    holding garbage (a logprob of 50, i.e. a ratio of e^51)."""
    old = torch.full((2, 4), -1.0)
    logprobs = old + torch.tensor([RATIOS, RATIOS]).log()
    logprobs[0, 3] = 50.0
    logprobs.requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return logprobs, old, advantages, mask


def test_policy_loss_clip_hand_computed():
    logprobs, old, adv, mask = clip_example()
    # clip_low 0.2, clip_high 0.28 -> clip range [0.8, 1.28]. Token loss -min(r*A, clip(r)*A):
    #   row 0 (A=+1): r=1.5 -> -1.28 (clipped high), r=0.5 -> -0.5, r=1.1 -> -1.1; sum -2.88
    #   row 1 (A=-1): r=1.5 -> 1.5, r=0.5 -> 0.8 (clipped low), r=1.1 -> 1.1, r=0.7 -> 0.8 (clipped low); sum 4.2
    # Token level: (-2.88 + 4.2) / 7 tokens = 1.32 / 7.
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, normalizer=7)
    torch.testing.assert_close(loss, torch.tensor(1.32 / 7))
    assert stats["num_clipped_tokens"].item() == 3
    assert stats["num_tokens"].item() == 7
    torch.testing.assert_close(stats["ratio_sum"], torch.tensor(1.5 + 0.5 + 1.1 + 1.5 + 0.5 + 1.1 + 0.7))
    assert stats["kl_sum"].item() == 0
    assert not any(v.requires_grad for v in stats.values())
    # d loss / d logp = -A * r / 7 where the unclipped term is active, 0 where clipped or masked.
    loss.backward()
    expected_grad = torch.tensor([[0.0, -0.5, -1.1, 0.0], [1.5, 0.0, 1.1, 0.0]]) / 7
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_policy_loss_seq_mean_hand_computed():
    logprobs, old, adv, mask = clip_example()
    # Sequence means: -2.88 / 3 = -0.96 and 4.2 / 4 = 1.05; summed 0.09, over 2 sequences 0.045.
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28, aggregation="seq-mean", normalizer=2)
    torch.testing.assert_close(loss, torch.tensor(0.045))
    with pytest.raises(ValueError, match="aggregation='sum'"):
        policy_loss(logprobs, old, adv, mask, aggregation="sum", normalizer=2)


def test_kl_term_hand_computed():
    # d = ref - logp = +ln2: k3 = 2 - ln2 - 1 = 0.3068528; d = -ln2: k3 = 0.5 + ln2 - 1 = 0.1931472.
    logprobs = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2), -math.log(2)]])
    torch.testing.assert_close(k3_kl(logprobs, ref), torch.tensor([[0.3068528, 0.1931472]]))
    # With A = 0 the PPO term vanishes: loss = 0.1 * (0.3068528 + 0.1931472) / 2 tokens = 0.025.
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(logprobs, logprobs, torch.zeros(1), mask, ref_logprobs=ref, kl_coef=0.1, normalizer=2)
    torch.testing.assert_close(loss, torch.tensor(0.025))
    torch.testing.assert_close(stats["kl_sum"], torch.tensor(0.5))


@pytest.mark.parametrize("aggregation", ["token", "seq-mean"])
def test_micro_batches_sum_to_full_batch(aggregation):
    g = torch.Generator().manual_seed(0)
    n, t = 6, 5
    logprobs = (-torch.rand(n, t, generator=g) * 2).requires_grad_(True)
    old = logprobs.detach() + 0.3 * torch.randn(n, t, generator=g)
    ref = logprobs.detach() + 0.3 * torch.randn(n, t, generator=g)
    adv = torch.randn(n, generator=g)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()  # [N, T]
    normalizer = mask.sum() if aggregation == "token" else n
    kw = dict(ref_logprobs=ref, kl_coef=0.05, aggregation=aggregation, normalizer=normalizer)

    full, full_stats = policy_loss(logprobs, old, adv, mask, **kw)
    (full_grad,) = torch.autograd.grad(full, logprobs)
    parts = [policy_loss(logprobs[s], old[s], adv[s], mask[s], **{**kw, "ref_logprobs": ref[s]})
             for s in (slice(0, 2), slice(2, n))]
    summed = parts[0][0] + parts[1][0]
    (summed_grad,) = torch.autograd.grad(summed, logprobs)
    torch.testing.assert_close(summed, full)
    torch.testing.assert_close(summed_grad, full_grad)
    for key, value in full_stats.items():
        torch.testing.assert_close(parts[0][1][key] + parts[1][1][key], value)


# --- token log-probabilities --------------------------------------------------------------------


def logprob_case(num_tokens=37, dim=16, vocab=53, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, dim, generator=g).to(dtype).requires_grad_(True)
    weight = (0.5 * torch.randn(vocab, dim, generator=g)).to(dtype).requires_grad_(True)
    targets = torch.randint(vocab, (num_tokens,), generator=g)
    grad_out = torch.randn(num_tokens, generator=g)
    return hidden, weight, targets, grad_out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_reference(temperature):
    hidden, weight, targets, grad_out = logprob_case()
    out = token_logprobs(hidden, weight, targets, temperature, chunk_size=8)  # 8 does not divide 37
    ref = reference_token_logprobs(hidden, weight, targets, temperature)
    assert out.dtype == torch.float32 and out.shape == (37,)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    grads = torch.autograd.grad(out, (hidden, weight), grad_out)
    ref_grads = torch.autograd.grad(ref, (hidden, weight), grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_token_logprobs_never_keep_full_logits():
    hidden, weight, targets, grad_out = logprob_case(num_tokens=40, vocab=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x.shape) or x, lambda x: x):
        out = token_logprobs(hidden, weight, targets, chunk_size=16)
    assert all(math.prod(shape) < 40 * 64 for shape in saved), saved
    out.backward(grad_out)


def test_token_logprobs_bf16_inputs():
    hidden, weight, targets, grad_out = logprob_case(dtype=torch.bfloat16)
    out = token_logprobs(hidden, weight, targets, 0.9, chunk_size=10)
    ref = reference_token_logprobs(hidden, weight, targets, 0.9)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)  # same fp32 math on the same bf16 inputs
    grads = torch.autograd.grad(out, (hidden, weight), grad_out)
    ref_grads = torch.autograd.grad(ref, (hidden, weight), grad_out)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_token_logprobs_weight_only_grad():
    hidden, weight, targets, grad_out = logprob_case()
    hidden = hidden.detach()
    out = token_logprobs(hidden, weight, targets, chunk_size=5)
    (grad,) = torch.autograd.grad(out, weight, grad_out)
    (ref_grad,) = torch.autograd.grad(reference_token_logprobs(hidden, weight, targets), weight, grad_out)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=0)


def test_token_logprobs_gradcheck_float64():
    hidden, weight, targets, _ = logprob_case(num_tokens=5, dim=3, vocab=7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs(h, w, targets, 0.9, chunk_size=2), (hidden, weight))
