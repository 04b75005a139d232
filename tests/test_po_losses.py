"""The preference losses against hand computations: value and gradient of each on one fixed batch.

The batch (two pairs), written out once:

    log π(y_w) = [−1.0, −3.0]   |y_w| = [1, 2]     log π_ref(y_w) = [−1.5, −2.0]
    log π(y_l) = [−2.0, −2.5]   |y_l| = [2, 1]     log π_ref(y_l) = [−1.5, −3.0]
    ρ_w = [0.5, −1.0], ρ_l = [−0.5, 0.5], z = ρ_w − ρ_l = [1.0, −1.5]

The trainer takes the mean over pairs, so each gradient below is d(mean loss)/d log π = (per-pair derivative) / 2.
σ(0.1) = 0.5249791875, σ(−0.15) = 0.4625701546.
"""

import math

import pytest
import torch

from assay.errors import AssayError
from assay.po.losses import PREFERENCE_LOSSES, Pairs, Singles, loss_args


def batch():
    pc = torch.tensor([-1.0, -3.0], requires_grad=True)
    pr = torch.tensor([-2.0, -2.5], requires_grad=True)
    lw, ll = torch.tensor([1.0, 2.0]), torch.tensor([2.0, 1.0])
    return Pairs(pc, pr, lw, ll), Pairs(torch.tensor([-1.5, -2.0]), torch.tensor([-1.5, -3.0]), lw, ll)


def run(name, **hp):
    pol, ref = batch()
    out = PREFERENCE_LOSSES.get(name)(pol, ref, **hp)
    out.loss.mean().backward()
    return out, pol.chosen.grad.tolist(), pol.rejected.grad.tolist()


def approx(x):
    return pytest.approx(x, abs=1e-6)


def test_dpo_by_hand():
    out, gc, gr = run("dpo", beta=0.1)
    # −log σ(βz) = log(1 + e^{−βz}): log(1 + e^{−0.1}) = 0.6443966601, log(1 + e^{0.15}) = 0.7709570478
    assert out.loss.tolist() == approx([0.6443966601, 0.7709570478])
    # d/dlog π(y_w) = −β σ(−βz) / 2: −0.1·0.4750208125/2, −0.1·0.5374298454/2; y_l: the opposite
    assert gc == approx([-0.0237510406, -0.0268714923]) and gr == approx([0.0237510406, 0.0268714923])
    assert out.chosen_reward.tolist() == approx([0.05, -0.1]) and out.rejected_reward.tolist() == approx([-0.05, 0.05])  # β ρ


def test_conservative_and_robust_dpo_by_hand():
    out, gc, _ = run("cdpo", beta=0.1, label_smoothing=0.1)
    # −0.9 log σ(βz) − 0.1 log σ(−βz): 0.9·0.6443966601 + 0.1·0.7443966601 ; 0.9·0.7709570478 + 0.1·0.6209570478
    assert out.loss.tolist() == approx([0.6543966601, 0.7559570478])
    # −β (0.9 σ(−βz) − 0.1 σ(βz)) / 2
    assert gc == approx([-0.0187510406, -0.0218714923])
    out, gc, _ = run("robust", beta=0.1, label_smoothing=0.1)
    # (0.9 (−log σ(βz)) − 0.1 (−log σ(−βz))) / 0.8: (0.5799569941 − 0.0744396660)/0.8, (0.6938613430 − 0.0620957048)/0.8
    assert out.loss.tolist() == approx([0.6318966601, 0.7897070478])
    # −β (0.9 σ(−βz) + 0.1 σ(βz)) / 0.8 / 2
    assert gc == approx([-0.0300010406, -0.0331214923])


def test_ipo_by_hand():
    out, gc, gr = run("ipo", beta=0.1)
    # per-token ratios (TRL's form): z̄ = ρ_w/|y_w| − ρ_l/|y_l| = [0.5 + 0.25, −0.5 − 0.5] = [0.75, −1.0]; (z̄ − 1/(2β))² = (z̄ − 5)²
    assert out.loss.tolist() == approx([18.0625, 36.0])
    # d/dlog π(y_w) = 2(z̄ − 5)/|y_w| / 2 = [−4.25, −3.0]; d/dlog π(y_l) = −2(z̄ − 5)/|y_l| / 2 = [2.125, 6.0]
    assert gc == approx([-4.25, -3.0]) and gr == approx([2.125, 6.0])
    out, _, _ = run("ipo", beta=0.1, length_normalize=False)
    assert out.loss.tolist() == approx([16.0, 42.25])  # the paper's sums: (z − 5)² with z = [1, −1.5]


def test_hinge_by_hand():
    out, gc, gr = run("hinge", beta=0.1)
    assert out.loss.tolist() == approx([0.9, 1.15]) and gc == approx([-0.05, -0.05]) and gr == approx([0.05, 0.05])  # 1 − βz; ∓β/2
    out, gc, _ = run("hinge", beta=2.0)
    assert out.loss.tolist() == approx([0.0, 4.0]) and gc == approx([0.0, -1.0])  # max(0, 1 − 2z): the first pair is past the margin


def test_simpo_by_hand():
    pol, _ = batch()
    out = PREFERENCE_LOSSES.get("simpo")(pol, None, beta=2.0, gamma=0.5)  # reference-free: no reference at all
    out.loss.mean().backward()
    # β log π/|y|: chosen [−2, −3], rejected [−2, −5]; −log σ(chosen − rejected − γ) with arguments [−0.5, 1.5]
    assert out.loss.tolist() == approx([0.9740769842, 0.2014132780])
    assert out.chosen_reward.tolist() == approx([-2.0, -3.0]) and out.rejected_reward.tolist() == approx([-2.0, -5.0])
    # d/dlog π(y_w) = −σ(−arg) β/|y_w| / 2: −0.6224593312·2/1/2, −0.1824255238·2/2/2
    assert pol.chosen.grad.tolist() == approx([-0.6224593312, -0.0912127619])
    assert pol.rejected.grad.tolist() == approx([0.3112296656, 0.1824255238])


def test_orpo_by_hand():
    pol, _ = batch()
    out = PREFERENCE_LOSSES.get("orpo")(pol, None, beta=0.1)
    out.loss.mean().backward()
    # mean token log p: a_w = [−1, −1.5], a_l = [−1, −2.5]; log odds(a) = a − log(1 − e^a):
    # lo(−1) = −0.5413248546, lo(−1.5) = −1.2475175411, lo(−2.5) = −2.4143495163; differences d = [0, 1.1668319752]
    # loss = −a_w − β log σ(d) = 1 + 0.1·log 2, 1.5 + 0.1·log(1 + e^{−1.1668319752})
    assert out.loss.tolist() == approx([1.0693147181, 1.5271058476])
    assert out.metrics["nll"] == approx(1.25)
    # d/dlog π(y_w) = (−1/|y_w| − β σ(−d) / (1 − e^{a_w}) / |y_w|) / 2; y_l: β σ(−d) / (1 − e^{a_l}) / |y_l| / 2
    assert pol.chosen.grad.tolist() == approx([-0.5395494177, -0.2576405366])
    assert pol.rejected.grad.tolist() == approx([0.0197747088, 0.0129330110])


def test_kto_by_hand():
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    kl = torch.tensor([-4.0, -5.0], requires_grad=True)
    good = torch.tensor([True, False, True])
    n = torch.ones(3)
    pol = Singles(lp, n, good, kl)
    ref = Singles(torch.tensor([-1.5, -1.5, -2.5]), n, good, torch.tensor([-4.5, -5.5]))
    out = PREFERENCE_LOSSES.get("kto")(pol, ref, beta=0.1, desirable_weight=1.0, undesirable_weight=2.0)
    out.loss.mean().backward()
    # z₀ = max(0, mean([0.5, 0.5])) = 0.5; ρ = [0.5, −0.5, −0.5]
    # desirable: 1 − σ(0.1(ρ − 0.5)) = [0.5, ·, 1 − σ(−0.1) = 0.5249791875]; undesirable: 2(1 − σ(0.1(0.5 + 0.5))) = 2·0.4750208125
    assert out.metrics["kl"] == approx(0.5)
    assert out.loss.tolist() == approx([0.5, 0.9500416250, 0.5249791875])
    # d/dρ: desirable −λ_D β σ(x)(1 − σ(x)), undesirable +λ_U β σ(x)(1 − σ(x)), each / 3 (the mean over the rows)
    assert lp.grad.tolist() == approx([-0.0083333333, 0.0166250693, -0.0083125347])
    assert kl.grad is None  # the reference point z₀ carries no gradient
    assert out.chosen_reward.tolist() == approx([0.05, -0.05]) and out.rejected_reward.tolist() == approx([-0.05])
    # z₀ is clamped at 0: mismatched responses the policy likes less than the reference does give z₀ = 0, not a negative point
    low = PREFERENCE_LOSSES.get("kto")(Singles(lp.detach(), n, good, torch.tensor([-6.0, -6.0])), ref, beta=0.1)
    assert low.metrics["kl"] == 0.0


def test_every_loss_has_the_uniform_shape():
    """One conformance suite over the registry: per-pair (per-row) losses, finite, differentiable, rewards of the right size."""
    for name, fn in PREFERENCE_LOSSES.items():
        g = torch.Generator(device="cpu").manual_seed(0)
        lp = -torch.rand(8, generator=g, device="cpu") * 5 - 0.1
        lp.requires_grad_(True)
        n = torch.randint(1, 6, (8,), generator=g, device="cpu").float()
        ref_lp = -torch.rand(8, generator=g, device="cpu") * 5 - 0.1
        if fn.paired:
            pol, ref = Pairs(lp[:4], lp[4:], n[:4], n[4:]), Pairs(ref_lp[:4], ref_lp[4:], n[:4], n[4:])
            want = 4
        else:
            good = torch.tensor([True, False] * 4)
            pol, ref = Singles(lp, n, good, lp.detach()[:3]), Singles(ref_lp, n, good, ref_lp[:3])
            want = 8
        out = fn(pol, ref if fn.reference else None, **loss_args(name, {}))
        assert out.loss.shape == (want,) and torch.isfinite(out.loss).all(), name
        assert out.chosen_reward.numel() + out.rejected_reward.numel() == 8 and not out.chosen_reward.requires_grad, name
        out.loss.mean().backward()
        assert torch.isfinite(lp.grad).all() and lp.grad.abs().sum() > 0, name
        assert fn.__doc__ and "arXiv" in fn.__doc__ or name == "cdpo", f"{name} cites its paper"


@pytest.mark.parametrize("name, args, needle", [
    ("dpo", {"beta": 0.0}, "beta=0.0 for dpo must be > 0"),
    ("robust", {"label_smoothing": 0.5}, "label_smoothing=0.5 for robust must be in [0, 0.5)"),
    ("simpo", {"gamma": -1.0}, "gamma=-1.0 for simpo must be >= 0"),
    ("kto", {"undesirable_weight": 0}, "undesirable_weight=0 for kto must be > 0"),
    ("ipo", {"tau": 0.1}, "unknown argument 'tau' for ipo; accepted: beta, length_normalize"),
    ("dpo", {"beta": "big"}, "beta='big' is not a valid float"),
    ("dpp", {}, "unknown preference loss 'dpp'; known: cdpo, dpo, hinge, ipo, kto, orpo, robust, simpo"),
])
def test_bad_hyperparameters_are_one_line(name, args, needle):
    with pytest.raises(AssayError) as e:
        loss_args(name, args)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_conservative_dpo_stops_pushing_a_pair_far_past_its_margin():
    """cDPO's gradient changes sign at βz = log((1−ε)/ε): beyond it the loss pulls the margin back (noisy labels)."""
    turn = math.log(0.9 / 0.1) / 0.1  # z where (1−ε)σ(−βz) = εσ(βz)
    for z, sign in ((turn - 1, -1), (turn + 1, 1)):
        pc = torch.tensor([z], requires_grad=True)
        zero = torch.zeros(1)
        PREFERENCE_LOSSES.get("cdpo")(Pairs(pc, zero, zero + 1, zero + 1), Pairs(zero, zero, zero + 1, zero + 1)).loss.sum().backward()
        assert math.copysign(1, pc.grad.item()) == sign
