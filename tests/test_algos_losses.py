"""Policy losses, aggregations, KL, mismatch correction and entropy against hand-worked values."""

import math

import pytest
import torch

from assay.algos import (
    AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, aggregate, entropy_from_logits, entropy_stats, future_kl,
    kl_reward_penalty, loss_reads, mismatch_correction, value_loss,
)


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual.float(), t(expected), atol=atol, rtol=0)


def loss(name, lp, old, a, mask=None, **kw):
    lp, old, a = t(lp), t(old), t(a)
    mask = torch.ones_like(lp) if mask is None else t(mask)
    return POLICY_LOSSES.get(name)(lp, old, a, mask, **kw)


L15, L05 = math.log(1.5), math.log(0.5)


# ---------------------------------------------------------------- policy losses


def test_ppo_clip_by_hand():
    # ρ = 1.5, A = 1: −min(1.5, 1.2) = −1.2 | ρ = .5, A = 1: −min(.5, .8) = −.5 | ρ = 1.5, A = −1: −min(−1.5, −1.2) = 1.5
    out, m = loss("ppo_clip", [[L15, L05, L15]], [[0.0, 0.0, 0.0]], [[1.0, 1.0, -1.0]])
    close(out, [[-1.2, -0.5, 1.5]])
    assert m["clip_frac"] == pytest.approx(1 / 3)  # only the first token is clipped
    # clip-higher: ε_high = .28 → −1.28
    close(loss("ppo_clip", [[L15]], [[0.0]], [[1.0]], clip_high=0.28)[0], [[-1.28]])
    # dual clip c = 3, A = −1, ρ = 4: min(max(4, 1.2), 3) = 3
    close(loss("ppo_clip", [[math.log(4.0)]], [[0.0]], [[-1.0]], dual_clip=3.0)[0], [[3.0]])


def test_gspo_by_hand():
    # one response, log-ratios (.1, .3) → s = exp(.2) = 1.2214 for both tokens
    out, m = loss("gspo", [[0.1, 0.3]], [[0.0, 0.0]], [[1.0, 1.0]], clip_low=0.2, clip_high=0.2)
    close(out, [[-1.2, -1.2]])  # clipped at 1.2
    assert m["clip_frac"] == 1.0
    lp = t([[0.1, 0.3]]).requires_grad_()
    out, m = POLICY_LOSSES.get("gspo")(lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.ones(1, 2), clip_high=0.3)
    close(out.detach(), [[-1.2214, -1.2214]])
    assert m["seq_ratio_mean"] == pytest.approx(math.exp(0.2), rel=1e-5)
    # ∇ of seq-mean-token-mean: −A s / |y| per token
    aggregate(out, torch.ones(1, 2), "seq-mean-token-mean").backward()
    close(lp.grad, [[-1.2214 / 2, -1.2214 / 2]])


def test_cispo_by_hand():
    # ρ = 1.5 capped at 1.28; L = −1.28 · A · log π = −1.28 · 1 · (log 1.5) = −.5190
    lp = t([[L15, L05]]).requires_grad_()
    out, m = POLICY_LOSSES.get("cispo")(lp, t([[0.0, 0.0]]), t([[1.0, -2.0]]), torch.ones(1, 2))
    # second token: ρ = .5 kept (no lower bound by default); L = −.5 · (−2) · log .5 = −.6931
    close(out.detach(), [[-1.28 * L15, -0.5 * -2.0 * L05]])
    assert m["clip_frac"] == pytest.approx(0.5)
    out.sum().backward()
    close(lp.grad, [[-1.28, 1.0]])  # ∂L/∂log π = −w A, even where PPO would be clipped


def test_sapo_by_hand():
    # ρ = 1: gate σ(0) = .5 → L = −(4/τ)·.5·A = −2 for A = 1, τ_pos = 1; ∇ = −A ρ 4σ(1−σ) = −1
    lp = t([[0.0, math.log(2.0)]]).requires_grad_()
    out, m = POLICY_LOSSES.get("sapo")(lp, t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.ones(1, 2))
    # ρ = 2: σ(1) = .73106 → L = −4 · .73106 = −2.9242; ∇ = −2 · 4 · .73106 · .26894 = −1.5729
    close(out.detach(), [[-2.0, -2.9242]])
    out.sum().backward()
    close(lp.grad, [[-1.0, -1.5729]])
    # a negative advantage uses τ_neg: ρ = 1 → L = +(4/1.05)·.5 = 1.9048
    close(loss("sapo", [[0.0]], [[0.0]], [[-1.0]])[0], [[1.9048]])


def test_reinforce_by_hand():
    out, m = loss("reinforce", [[-0.5, -1.0]], [[-0.5, -1.0]], [[2.0, -1.0]])
    close(out, [[1.0, -1.0]])  # −A log π
    assert m["ratio_mean"] == pytest.approx(1.0)


def test_losses_zero_padding():
    for name in [n for n in POLICY_LOSSES.names() if loss_reads(n) == "logprobs"]:
        out, _ = loss(name, [[0.1, 5.0]], [[0.0, -3.0]], [[1.0, 7.0]], mask=[[1.0, 0.0]])
        assert out[0, 1] == 0.0, name


def test_value_loss_by_hand():
    # V = 1, V_old = .5, R = 0: (1)² vs clipped V = .7 → .49; max → ½ · 1 = .5
    # V = .2, V_old = .5, R = 1: .64 vs clipped .3 → .49; max → .32
    out, m = value_loss(t([[1.0, 0.2]]), t([[0.5, 0.5]]), t([[0.0, 1.0]]), torch.ones(1, 2), clip=0.2)
    close(out, [[0.5, 0.32]])
    assert m["vf_clip_frac"] == 0.0
    close(value_loss(t([[1.0]]), t([[0.5]]), t([[0.0]]), torch.ones(1, 1), clip=None)[0], [[0.5]])


# ---------------------------------------------------------------- aggregation


def test_aggregations_by_hand():
    lm, mask = t([[1, 2, 3], [4, 0, 0]]), t([[1, 1, 1], [1, 0, 0]])
    assert aggregate(lm, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(lm, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(lm, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(lm, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert aggregate(lm, mask, "seq-mean-token-sum-norm", norm=5).item() == pytest.approx(10 / (2 * 5))
    assert set(AGGREGATIONS.names()) == {"token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"}


# ---------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    lp, ref = t([[-1.0, -1.0]]), t([[-2.0, -1.0]])
    # x = log π − log π_ref = (1, 0): k1 = x, k2 = x²/2, k3 = e^{−x} − 1 + x
    close(KL_ESTIMATORS.get("k1")(lp, ref), [[1.0, 0.0]])
    close(KL_ESTIMATORS.get("k2")(lp, ref), [[0.5, 0.0]])
    close(KL_ESTIMATORS.get("k3")(lp, ref), [[math.exp(-1), 0.0]])


def test_kl_reward_penalty_and_future_kl():
    lp, ref, mask = t([[-1.0, -1.0, -1.0]]), t([[-2.0, -1.0, -3.0]]), t([[1, 1, 0]])
    # k1 = (1, 0, [2 masked]) → penalty 1; k2 → .5
    close(kl_reward_penalty(lp, ref, mask), [1.0])
    close(kl_reward_penalty(lp, ref, mask, estimator="k2"), [0.5])
    # future KL (reverse cumulative sum over response tokens): (1, 0) → (1, 0), padding 0
    close(future_kl(lp, ref, mask), [[1.0, 0.0, 0.0]])


# ---------------------------------------------------------------- mismatch correction


def test_mismatch_correction_by_hand():
    trainer, sampler = t([[-1.0, -1.0, -1.0, -1.0]]), t([[-1.0, -2.0, -0.5, 0.0]])
    mask = t([[1, 1, 1, 0]])
    # ρ = π_trainer/π_sampler = (1, e, e^{−.5} = .6065); cap 2
    w, m = mismatch_correction(trainer, sampler, mask, mode="tis", cap=2.0)
    close(w, [[1.0, 2.0, 0.6065, 0.0]])
    assert m["mismatch/corrected_frac"] == pytest.approx(1 / 3)
    # log(sampler/trainer) = (0, −1, .5): k1 = −1/6; k3 = mean(0, e − 2, e^{−.5} − .5) = .27494
    assert m["mismatch/k1"] == pytest.approx(-1 / 6, abs=1e-6)
    assert m["mismatch/k3"] == pytest.approx((math.e - 2 + math.exp(-0.5) - 0.5) / 3, abs=1e-5)
    assert m["mismatch/ratio_max"] == pytest.approx(math.e, rel=1e-5)
    assert m["mismatch/weight_mean"] == pytest.approx((1 + 2 + math.exp(-0.5)) / 3, rel=1e-5)
    assert m["mismatch/abs_diff_max"] == pytest.approx(1.0)  # the second token: |−1 − (−2)|
    w, _ = mismatch_correction(trainer, sampler, mask, mode="mis", cap=2.0)
    close(w, [[1.0, 0.0, 0.6065, 0.0]])  # the token with ρ = e > 2 leaves the loss
    w, _ = mismatch_correction(trainer, sampler, mask, mode="mis", cap=2.0, floor=0.7)
    close(w, [[1.0, 0.0, 0.0, 0.0]])
    # sequence level: Σ log ρ = 0 + 1 − .5 = .5 → ρ = e^{.5} = 1.6487 < 2 for every token
    w, _ = mismatch_correction(trainer, sampler, mask, mode="tis", cap=2.0, level="sequence")
    close(w, [[1.6487, 1.6487, 1.6487, 0.0]])
    with pytest.raises(ValueError):
        mismatch_correction(trainer, sampler, mask, mode="bogus")


def test_mismatch_weights_are_detached():
    trainer = t([[-1.0, -2.0]]).requires_grad_()
    w, _ = mismatch_correction(trainer, t([[-1.0, -1.0]]), torch.ones(1, 2))
    assert not w.requires_grad


# ---------------------------------------------------------------- entropy


def test_entropy_by_hand():
    # uniform over 4: log 4; probabilities (.25, .75): −(.25 ln .25 + .75 ln .75) = .5623
    logits = t([[[0.0, 0.0, 0.0, 0.0], [0.0, math.log(3.0), -math.inf, -math.inf]]])
    close(entropy_from_logits(logits), [[math.log(4), 0.5623]])
    stats = entropy_stats(entropy_from_logits(logits), t([[1, 0]]))
    assert stats["entropy"] == pytest.approx(math.log(4), rel=1e-5)


def test_entropy_chunked_and_grad():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=4), h)
    # ∂H/∂z_v = −p_v (z_v − Σ p z) for the softmax entropy
    h.sum().backward()
    p = torch.softmax(logits.detach(), -1)
    expected = -p * (logits.detach() - (p * logits.detach()).sum(-1, keepdim=True))
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=1e-5)


def test_entropy_grad_finite_with_masked_vocab():
    logits = t([[[0.0, 1.0, -math.inf]]]).requires_grad_()
    entropy_from_logits(logits).sum().backward()
    assert torch.isfinite(logits.grad).all()
