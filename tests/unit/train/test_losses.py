"""Policy losses, aggregations, KL estimators and rollout corrections against values computed by
hand from their papers' formulas, their edge cases, and the chunked token log-probabilities and
entropy against the full-materializing reference (values, grads, gradcheck)."""

from __future__ import annotations

import math

import pytest
import torch

from rollpacker.train.config import TrainConfig
from rollpacker.train.logprobs import token_logprobs, token_logprobs_entropy
from rollpacker.train.losses import (
    AGGREGATIONS,
    CORRECTIONS,
    KL_ESTIMATORS,
    LOSSES,
    STATS,
    KLController,
    cispo,
    normalizer,
    policy_objective,
    ppo,
    sapo,
)
from rollpacker_kernels.reference import reference_token_logprobs, reference_token_logprobs_entropy

RATIOS = [1.5, 0.5, 1.1, 0.7]


def clip_example():
    """Two responses with ratios RATIOS, A = +1 and -1, the last token of row 0 off the mask and
    holding garbage (a log-prob of 50, i.e. a ratio of e^51)."""
    old = torch.full((2, 4), -1.0)
    logprobs = old + torch.tensor([RATIOS, RATIOS]).log()
    logprobs[0, 3] = 50.0
    logprobs.requires_grad_(True)
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return logprobs, old, adv, mask


def objective(logp, old, adv, mask, behavior=None, **cfg):
    behavior = old if behavior is None else behavior
    return policy_objective(logp, old, behavior, adv, mask, TrainConfig(**cfg))


# --- ppo ----------------------------------------------------------------------------------------


def test_ppo_clip_hand_computed():
    logprobs, old, adv, mask = clip_example()
    # clip_low 0.2, clip_high 0.28 -> clip range [0.8, 1.28]. Token loss -min(r*A, clip(r)*A):
    #   row 0 (A=+1): r=1.5 -> -1.28 (clipped high), r=0.5 -> -0.5, r=1.1 -> -1.1; sum -2.88
    #   row 1 (A=-1): r=1.5 -> 1.5, r=0.5 -> 0.8 (clipped low), r=1.1 -> 1.1, r=0.7 -> 0.8 (clipped low); sum 4.2
    loss, stats = objective(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    torch.testing.assert_close(loss, torch.tensor(1.32))  # token-mean: a sum; / 7 tokens by the trainer
    assert stats["clipped"].item() == 3 and stats["tokens"].item() == 7
    torch.testing.assert_close(stats["ratio_dev"], torch.tensor(0.5 + 0.5 + 0.1 + 0.5 + 0.5 + 0.1 + 0.3))
    assert stats["kl"].item() == 0 and set(stats) == set(STATS)
    assert not any(v.requires_grad for v in stats.values())
    # d loss / d logp = -A * r where the unclipped term is active, 0 where clipped or masked.
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5, -1.1, 0.0], [1.5, 0.0, 1.1, 0.0]]))


def test_ppo_at_the_clip_bounds_and_dual_clip():
    # A ratio exactly at a bound is not clipped: its gradient stays -A * r.
    cfg = TrainConfig(clip_low=0.0, clip_high=0.0)  # both bounds at 1, the ratio's value at the first update
    logp = torch.zeros(2, 1, requires_grad=True)
    adv = torch.tensor([[1.0], [-1.0]])
    loss, ratio, clipped = ppo(logp, logp.detach(), adv, torch.ones(2, 1, dtype=torch.bool), cfg)
    assert ratio.tolist() == [[1.0], [1.0]] and not clipped.any()
    loss.sum().backward()
    assert logp.grad.tolist() == [[-1.0], [1.0]]
    # Dual clip: A = -1, r = 5 -> max(5, 1.28) = 5, capped at 3 * |A| = 3 (no gradient); r = 2 -> 2 (gradient r = 2).
    cfg = TrainConfig(dual_clip=3.0)
    logp = torch.tensor([[math.log(5.0), math.log(2.0)]], requires_grad=True)
    loss, _, clipped = ppo(logp, torch.zeros(1, 2), torch.tensor([[-1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
                           cfg)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 2.0]]))
    assert clipped.tolist() == [[True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0]]))
    with pytest.raises(ValueError, match="train.dual_clip must be > 1"):
        TrainConfig(dual_clip=0.5)


# --- gspo ---------------------------------------------------------------------------------------


def test_gspo_sequence_ratio_hand_computed():
    # Row 0: log-ratios (0.3, -0.1) -> mean 0.1 -> s = e^0.1 = 1.1051709, inside [0.8, 1.28]: each token -s.
    # Row 1: log-ratios 0.6 x 3 -> s = e^0.6 = 1.8221188 > 1.28, A = +1: clipped, each token -1.28, no gradient.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, -0.1, float("nan")], [0.6, 0.6, 0.6]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    adv = torch.ones(2, 3)
    s = math.exp(0.1)
    loss, stats = objective(logp, old, adv, mask, loss="gspo", aggregation="seq-mean-token-mean")
    torch.testing.assert_close(loss, torch.tensor(-s - 1.28))
    assert stats["clipped"].item() == 3
    loss.backward()  # GSPO's gradient: -A * s * grad(mean_t logp_t) = -s / 2 per token of row 0
    torch.testing.assert_close(logp.grad, torch.tensor([[-s / 2, -s / 2, 0.0], [0.0, 0.0, 0.0]]))
    token_mean, _ = objective(logp, old, adv, mask, loss="gspo")
    torch.testing.assert_close(token_mean, torch.tensor(-2 * s - 3 * 1.28))


def test_gspo_token_form_is_the_papers_sequence_objective():
    g = torch.Generator().manual_seed(1)
    logp = (-torch.rand(4, 6, generator=g)).requires_grad_(True)
    old = logp.detach() + 0.2 * torch.randn(4, 6, generator=g)
    mask = torch.arange(6)[None, :] < torch.tensor([6, 2, 4, 5])[:, None]
    a = torch.randn(4, generator=g)
    loss, _ = objective(logp, old, a[:, None].expand(4, 6), mask, loss="gspo", aggregation="seq-mean-token-mean")
    (got,) = torch.autograd.grad(loss, logp)
    # GSPO's eq. 5-7: s_i = (pi / pi_old)^(1/|y_i|), J = sum_i min(s_i A_i, clip(s_i) A_i).
    s = torch.exp(torch.where(mask, logp - old, 0.0).sum(1) / mask.sum(1))
    want_loss = -torch.minimum(s * a, torch.clamp(s, 0.8, 1.28) * a).sum()
    (want,) = torch.autograd.grad(want_loss, logp)
    torch.testing.assert_close(loss, want_loss)
    torch.testing.assert_close(got, want)


# --- cispo --------------------------------------------------------------------------------------


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient():
    # r = (1.5, 0.5, 1.1), A = +1: weights clip(r, 0.8, 1.28) = (1.28, 0.8, 1.1), detached.
    # Token loss -w A logp with logp = (-1, -2, -0.5): (1.28, 1.6, 0.55); gradient -w A on every token,
    # where PPO gives the clipped token r = 1.5 none.
    logp = torch.tensor([[-1.0, -2.0, -0.5, float("inf")]], requires_grad=True)
    old = logp.detach() - torch.tensor([[1.5, 0.5, 1.1, 1.0]]).log()
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    loss, _, clipped = cispo(logp, old, torch.ones(1, 4), mask, TrainConfig())
    torch.testing.assert_close(loss[:, :3], torch.tensor([[1.28, 1.6, 0.55]]))
    assert clipped.tolist() == [[True, True, False, False]]
    total, _ = objective(logp, old, torch.ones(1, 4), mask, loss="cispo")
    total.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.28, -0.8, -1.1, 0.0]]))


# --- sapo ---------------------------------------------------------------------------------------


def test_sapo_soft_gate_hand_computed():
    """Gate g = sigmoid(tau (r - 1)), loss -(4 / tau) g A, gradient -4 g (1 - g) r A per token (tau_pos 1, tau_neg 2).
    Row 0 (A = +1), r = (1.5, 0.5, 1): g = (0.6224593, 0.3775407, 0.5): losses (-2.4898373, -1.5101627, -2), gradients
    -4 x 0.2350037 x (1.5, 0.5) and -1, the plain policy gradient at r = 1. Row 1 (A = -1), r = (1.5, 3, 1), tau 2:
    g = (0.7310586, 0.9820138, 0.5): losses (1.4621172, 1.9640276, 1), gradients 4 g (1 - g) r = (1.1796716,
    0.2119525, 1); r = 3's weight 4 g (1 - g) = 0.07 is under half: it counts as clipped. The last token of row 0 is
    off the mask (a log-prob of 50): no loss, no gradient."""
    r = torch.tensor([[1.5, 0.5, 1.0, 1.0], [1.5, 3.0, 1.0, 1.0]])
    logp = torch.zeros(2, 4)
    logp[0, 3] = 50.0
    logp.requires_grad_(True)
    old = torch.zeros(2, 4) - r.log()
    adv, mask = torch.tensor([[1.0] * 4, [-1.0] * 4]), torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
    loss, _, clipped = sapo(logp, old, adv, mask, TrainConfig(loss="sapo", tau_pos=1.0, tau_neg=2.0))
    torch.testing.assert_close(loss[:, :3], torch.tensor([[-2.4898373, -1.5101627, -2.0], [1.4621172, 1.9640276, 1.0]]))
    assert clipped.tolist() == [[False, False, False, False], [False, True, False, False]]
    total, stats = objective(logp, old, adv, mask, loss="sapo", tau_pos=1.0, tau_neg=2.0)
    total.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.4100223, -0.4700074, -1.0, 0.0],
                                                        [1.1796716, 0.2119525, 1.0, 0.0]]))
    assert stats["clipped"].item() == 1


# --- aggregation --------------------------------------------------------------------------------


def test_aggregations_and_their_global_counts_hand_computed():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    lengths, max_tokens = [3, 1], 8
    # token-mean: 10 / 4 tokens; seq-mean-token-mean: (6/3 + 4/1) / 2; seq-mean-token-sum: 10 / 2;
    # seq-mean-token-sum-norm (Dr. GRPO): 10 / (2 responses x 8, the longest allowed).
    want = {"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum": 5.0, "seq-mean-token-sum-norm": 0.625}
    for name, agg in AGGREGATIONS.items():
        got = agg.reduce(token_loss, mask) / normalizer(name, lengths, max_tokens)
        assert got.item() == pytest.approx(want[name]), name


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("aggregation", sorted(AGGREGATIONS))
def test_micro_batches_sum_to_full_batch(loss, aggregation):
    g = torch.Generator().manual_seed(0)
    n, t = 6, 5
    logprobs = (-torch.rand(n, t, generator=g) * 2).requires_grad_(True)
    old = logprobs.detach() + 0.3 * torch.randn(n, t, generator=g)
    behavior = old + 0.1 * torch.randn(n, t, generator=g)
    ref = logprobs.detach() + 0.3 * torch.randn(n, t, generator=g)
    entropy = torch.rand(n, t, generator=g).requires_grad_(True)
    adv = torch.randn(n, 1, generator=g).expand(n, t)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = torch.arange(t)[None, :] < lengths[:, None]  # [N, T]
    cfg = TrainConfig(loss=loss, aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01,
                      rollout_correction="token_tis")

    def part(s):
        return policy_objective(logprobs[s], old[s], behavior[s], adv[s], mask[s], cfg, entropy=entropy[s], ref=ref[s])

    full, full_stats = part(slice(0, n))
    full_grad = torch.autograd.grad(full, (logprobs, entropy))
    parts = [part(s) for s in (slice(0, 2), slice(2, n))]
    summed = parts[0][0] + parts[1][0]
    summed_grad = torch.autograd.grad(summed, (logprobs, entropy))
    torch.testing.assert_close(summed, full)
    for a, b in zip(summed_grad, full_grad):
        torch.testing.assert_close(a, b)
    for key, value in full_stats.items():
        torch.testing.assert_close(parts[0][1][key] + parts[1][1][key], value)


# --- edge cases ---------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("correction", sorted(CORRECTIONS))
def test_empty_masks_and_garbage_off_the_mask_give_finite_zero_contributions(loss, correction):
    """A response with no token on the mask (empty, or fully truncated and masked) adds nothing, and
    inf/NaN anywhere off the mask reaches neither the loss nor a gradient."""
    garbage = torch.tensor([[float("nan"), float("inf"), -float("inf")], [float("nan"), 1e30, -1e30]])
    mask = torch.tensor([[0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    logp = torch.where(mask, torch.tensor(-0.5), garbage).requires_grad_(True)
    entropy = torch.where(mask, torch.tensor(1.0), garbage).requires_grad_(True)
    old = torch.where(mask, torch.tensor(-0.5), garbage.flip(1))
    adv = torch.where(mask, torch.tensor(2.0), garbage)
    ref = torch.where(mask, torch.tensor(-0.7), garbage)
    for aggregation in AGGREGATIONS:
        total, stats = policy_objective(
            logp, old, old, adv, mask, TrainConfig(loss=loss, aggregation=aggregation, rollout_correction=correction,
                                                    kl_coef=0.1, entropy_coef=0.01, kl_estimator="low_var_kl"),
            entropy=entropy, ref=ref)
        grads = torch.autograd.grad(total, (logp, entropy))
        assert torch.isfinite(total) and all(torch.isfinite(g).all() for g in grads), (aggregation, total)
        assert all(torch.isfinite(v) for v in stats.values()), stats
        assert grads[0][0].abs().sum() == 0 and grads[1][0].abs().sum() == 0  # row 0 has no token
        assert stats["tokens"].item() == 1
    empty, _ = objective(logp[:1], old[:1], adv[:1], mask[:1], loss=loss, rollout_correction=correction)
    assert empty.item() == 0


@pytest.mark.parametrize("loss", ["ppo", "sapo"])
def test_a_ratio_past_float32s_range_on_the_mask_leaves_the_gradient_finite(loss):
    """A token whose log-ratio is 100 (its ratio overflows float32): the gradient of PPO's min and of SAPO's gate
    was NaN (inf * 0 through the branch not taken), and the whole step skipped. Clamped as verl does, the token's
    gradient is 0 and the others keep theirs."""
    logp = torch.tensor([[-1.0, -0.5], [-1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-101.0, -0.6], [-101.0, -0.4]])
    adv, mask = torch.tensor([[1.0, 1.0], [-1.0, -1.0]]), torch.ones(2, 2, dtype=torch.bool)
    total, _ = objective(logp, old, adv, mask, loss=loss)
    grad, = torch.autograd.grad(total, logp)
    assert torch.isfinite(total) and torch.isfinite(grad).all(), grad
    assert (grad[:, 0] == 0).all() and (grad[:, 1] != 0).all()


def test_a_gspo_sequence_ratio_past_float32s_range_leaves_the_gradient_finite():
    """GSPO's sequence ratio of a response whose mean log-ratio is 100 overflowed float32 and its gradient was NaN
    (the same ``inf * 0`` as PPO's); its log is clamped (above at 10, as verl's), and the other response keeps its
    gradient."""
    logp = torch.tensor([[-1.0, -0.5], [-1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-201.0, -0.5], [-1.1, -0.4]])
    adv, mask = torch.tensor([[1.0, 1.0], [1.0, 1.0]]), torch.ones(2, 2, dtype=torch.bool)
    total, _ = objective(logp, old, adv, mask, loss="gspo")
    grad, = torch.autograd.grad(total, logp)
    assert torch.isfinite(total) and torch.isfinite(grad).all(), grad
    assert (grad[0] == 0).all() and (grad[1] != 0).all()
    # clamped above at 10, as verl's: a mean log-ratio of 12 with A < 0 kept a gradient of e^12 per token under +-20
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    total, _ = objective(logp, torch.full((1, 2), -12.0), -torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool),
                         loss="gspo")
    grad, = torch.autograd.grad(total, logp)
    assert total.item() == pytest.approx(2 * math.exp(10), rel=1e-6) and (grad == 0).all()  # a sum over 2 tokens


# --- KL -----------------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    # logp = 0, ref = ln 2: d = ref - logp = ln 2. k1 = -ln 2; k2 = (ln 2)^2 / 2; k3 = 2 - ln 2 - 1.
    logp, ref = torch.zeros(1, 2), torch.tensor([[math.log(2), 30.0]])
    ln2 = math.log(2)
    want = {"k1": [-ln2, -30.0], "k2": [ln2 ** 2 / 2, 450.0], "k3": [1 - ln2, math.exp(30) - 31],
            "low_var_kl": [1 - ln2, 10.0]}  # d = 30 is clamped to 20, e^20 - 21 to 10
    for name, fn in KL_ESTIMATORS.items():
        torch.testing.assert_close(fn(logp, ref), torch.tensor([want[name]]), msg=name)
    # In the loss with A = 0: 0.1 * k3 per token, summed: 0.1 * (0.3068528 + 0.1931472) = 0.05.
    ref = torch.tensor([[ln2, -ln2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, stats = policy_objective(logp, logp, logp, torch.zeros(1, 2), mask, TrainConfig(kl_coef=0.1), ref=ref)
    torch.testing.assert_close(loss, torch.tensor(0.05))
    torch.testing.assert_close(stats["kl"], torch.tensor(0.5))
    # In the reward instead: the loss has no KL term, the metric still has it.
    loss, stats = policy_objective(logp, logp, logp, torch.zeros(1, 2), mask,
                                   TrainConfig(kl_coef=0.1, kl_in_reward=True), ref=ref)
    assert loss.item() == 0 and stats["kl"].item() == pytest.approx(0.5)

    # A coefficient given (an adaptive KL's) replaces the config's: 0.3 * 0.5.
    loss, _ = policy_objective(logp, logp, logp, torch.zeros(1, 2), mask, TrainConfig(kl_coef=0.1), ref=ref,
                               kl_coef=0.3)
    torch.testing.assert_close(loss, torch.tensor(0.15))


def test_adaptive_kl_moves_the_coefficient_as_verls_controller():
    """b *= 1 + clip(kl / target - 1, -0.2, 0.2) * n / horizon; no target keeps b."""
    kl = KLController(0.1, target=0.05, horizon=10000)
    kl.update(0.055, 256)  # error +0.1
    assert kl.value == pytest.approx(0.1 * (1 + 0.1 * 256 / 10000))
    kl.update(1.0, 5000)  # error clipped to +0.2
    assert kl.value == pytest.approx(0.1 * (1 + 0.1 * 256 / 10000) * 1.1)
    kl = KLController(0.1, target=0.05, horizon=100)
    kl.update(0.0, 100)  # no KL: -0.2, at most
    assert kl.value == pytest.approx(0.08)
    fixed = KLController(0.1)
    fixed.update(1.0, 10000)
    assert fixed.value == 0.1


def test_entropy_bonus_and_metric():
    # A = 0: the loss is -entropy_coef * sum of entropies over the mask; its gradient -entropy_coef.
    entropy = torch.tensor([[1.0, 2.0, float("nan")]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    zeros = torch.zeros(1, 3)
    loss, stats = policy_objective(zeros, zeros, zeros, zeros, mask, TrainConfig(entropy_coef=0.1), entropy=entropy)
    torch.testing.assert_close(loss, torch.tensor(-0.3))
    assert stats["entropy"].item() == 3.0
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1, -0.1, 0.0]]))


# --- rollout correction -------------------------------------------------------------------------


def test_rollout_corrections_hand_computed():
    # rho = exp(old - behavior): row 0 (3, 0.5, 1, 0.25), product 0.375; row 1 (1.5, 1, 1, 1), product 1.5.
    rho = torch.tensor([[3.0, 0.5, 1.0, 0.25], [1.5, 1.0, 1.0, 1.0]])
    mask = torch.ones(2, 4, dtype=torch.bool)
    want = {
        "token_tis": ([[2.0, 0.5, 1.0, 0.25], [1.5, 1.0, 1.0, 1.0]], mask.tolist()),
        "seq_tis": ([[0.375] * 4, [1.5] * 4], mask.tolist()),
        "token_mask": ([[0.0, 0.5, 1.0, 0.0], [1.5, 1.0, 1.0, 1.0]], [[False, True, True, False], [True] * 4]),
        "seq_mask": ([[0.0] * 4, [1.5] * 4], [[False] * 4, [True] * 4]),
    }
    for name, (weights, keep) in want.items():
        w, k = CORRECTIONS[name](rho.log(), mask, 0.5, 2.0)
        torch.testing.assert_close(w, torch.tensor(weights), msg=name)
        assert k.tolist() == keep, name
    assert CORRECTIONS["none"](rho.log(), mask, 0.5, 2.0) == (None, mask)


def test_rollout_correction_weights_the_policy_term_and_counts():
    # A = 1, ratio 1 (on-policy): the ppo term is -1 per token, weighted by min(rho, 2) = (2, 0.5, 1, 0.25).
    old = torch.zeros(1, 4, requires_grad=True)
    behavior = -torch.tensor([[3.0, 0.5, 1.0, 0.25]]).log()
    mask = torch.ones(1, 4, dtype=torch.bool)
    loss, stats = objective(old, old.detach(), torch.ones(1, 4), mask, behavior, rollout_correction="token_tis")
    torch.testing.assert_close(loss, torch.tensor(-3.75))
    assert stats["rollout_is_outside"].item() == 1  # rho = 3 was truncated
    torch.testing.assert_close(stats["rollout_is"], torch.tensor(3.75))
    torch.testing.assert_close(stats["rollout_ratio"], torch.tensor(4.75))
    torch.testing.assert_close(stats["logprob_diff"], torch.tensor(sum(abs(math.log(r)) for r in (3, 0.5, 1, 0.25))))
    loss, stats = objective(old, old.detach(), torch.ones(1, 4), mask, behavior, rollout_correction="token_mask")
    torch.testing.assert_close(loss, torch.tensor(-1.5))  # 0.5 and 1 kept; 3 and 0.25 contribute nothing
    assert stats["rollout_is_outside"].item() == 2
    # per response: prod rho = 0.375 is not truncated (each token's weight differs from its rho: it once
    # counted every token), a response of prod rho = 3 is, on each of its tokens
    loss, stats = objective(old, old.detach(), torch.ones(1, 4), mask, behavior, rollout_correction="seq_tis")
    assert stats["rollout_is_outside"].item() == 0
    _, stats = objective(old, old.detach(), torch.ones(1, 4), mask, -torch.tensor([[3.0, 1, 1, 1]]).log(),
                         rollout_correction="seq_tis")
    assert stats["rollout_is_outside"].item() == 4


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


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_entropy_matches_reference_with_its_gradient(temperature):
    hidden, weight, targets, grad_out = logprob_case()
    grad_entropy = torch.randn(37, generator=torch.Generator().manual_seed(1))
    logp, entropy = token_logprobs_entropy(hidden, weight, targets, temperature, chunk_size=8)
    ref_logp, ref_entropy = reference_token_logprobs_entropy(hidden, weight, targets, temperature)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=0)
    assert (entropy > 0).all()
    for outputs, ref_outputs, grads in (((entropy,), (ref_entropy,), (grad_entropy,)),
                                        ((logp, entropy), (ref_logp, ref_entropy), (grad_out, grad_entropy))):
        got = torch.autograd.grad(outputs, (hidden, weight), grads, retain_graph=True)
        want = torch.autograd.grad(ref_outputs, (hidden, weight), grads, retain_graph=True)
        for a, b in zip(got, want):  # grads of size ~5: float32 rounding
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_peaked_distributions_entropy_is_accurate_and_never_negative():
    """Entropy as lse - E_p[z] cancelled two near numbers in fp32: at a low temperature it read 0 or negative where
    it is ~1e-7, and its gradient carried the error."""
    hidden, weight, targets, grad_out = logprob_case(num_tokens=70, dim=33, vocab=130)
    weight = (weight * 4).detach().requires_grad_(True)  # logits of ~30: p of the top token ~1
    _, entropy = token_logprobs_entropy(hidden, weight, targets, 0.3, chunk_size=7)
    h64, w64 = hidden.double().detach().requires_grad_(True), weight.double().detach().requires_grad_(True)
    ref = torch.log_softmax(h64 @ w64.T / 0.3, -1)
    ref_entropy = -(ref.exp() * ref).sum(-1)
    assert (entropy >= 0).all() and ref_entropy.min() < 1e-6  # some are that peaked
    assert ((entropy.double() - ref_entropy).abs() <= 1e-5 * ref_entropy.abs().max()).all()
    got = torch.autograd.grad(entropy, (hidden, weight), grad_out)
    want = torch.autograd.grad(ref_entropy, (h64, w64), grad_out.double())
    for a, b in zip(got, want):
        assert (a.double() - b).abs().max() <= 5e-5 * b.abs().max()


def test_token_entropy_gradcheck_float64():
    hidden, weight, targets, _ = logprob_case(num_tokens=5, dim=3, vocab=7, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w: token_logprobs_entropy(h, w, targets, 0.9, chunk_size=2),
                                    (hidden, weight))


def test_focus_keeps_the_policy_term_of_its_tokens_and_every_other_term():
    """train.top_entropy_quantile's mask: the policy term of the tokens outside it is 0; the KL stays on every token."""
    logp, mask = torch.zeros(1, 3), torch.ones(1, 3, dtype=torch.bool)
    adv, ref = torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[math.log(2), 0.0, 0.0]])
    cfg = TrainConfig(kl_coef=0.1, aggregation="seq-mean-token-sum")
    full, _ = policy_objective(logp, logp, logp, adv, mask, cfg, ref=ref)
    focused, _ = policy_objective(logp, logp, logp, adv, mask, cfg, ref=ref,
                                  focus=torch.tensor([[False, True, False]]))
    kl = 0.1 * (1 - math.log(2))  # k3 at d = ln 2, on the first token
    torch.testing.assert_close(full, torch.tensor(-6.0 + kl))  # ratio 1: the policy term is -A per token
    torch.testing.assert_close(focused, torch.tensor(-2.0 + kl))
