"""The advantage, loss, aggregation and KL maths the default run uses, against hand-worked values."""

import math

import torch

from assay.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from assay.eval.policy import pass_at_k

NAN = float("nan")


def test_grpo_by_hand():
    # group 0: mean 0.5, unbiased std sqrt(1/3) -> ±sqrt(3)/2; group 1: mean .75, std .5
    r = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 0])
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv = ADVANTAGES.get("grpo")(r, g, torch.ones(8, 3), eps=0.0)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv[:, 0], torch.tensor([h, -h, -h, h, 0.5, 0.5, 0.5, -1.5]))
    assert torch.equal(adv[:, 0], adv[:, 2])


def test_grpo_masks_padding_and_skips_unscored():
    r = torch.tensor([1.0, NAN, 0.0, 1.0])
    g = torch.tensor([0, 0, 0, 1])
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv = ADVANTAGES.get("grpo")(r, g, mask)
    # group 0 scored: [1, 0] -> mean .5, std sqrt(.5) -> ±0.7071; the NaN sample gets 0;
    # group 1 has a single sample -> std 0, advantage 0.
    s = 0.5 / math.sqrt(0.5)
    expect = torch.tensor([[s, s, 0], [0, 0, 0], [-s, -s, -s], [0, 0, 0]])
    torch.testing.assert_close(adv, expect, rtol=1e-5, atol=2e-6)


def test_ppo_clip_by_hand():
    # ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, -1, +1, -1 with eps 0.2:
    # losses max(-1.5, -1.2) = -1.2 (clipped), max(1.5, 1.2) = 1.5, max(-.5, -.8) = -.5, max(.5, .8) = .8 (clipped)
    old = torch.zeros(4, 1)
    lp = torch.log(torch.tensor([[1.5], [1.5], [0.5], [0.5]]))
    adv = torch.tensor([[1.0], [-1.0], [1.0], [-1.0]])
    loss, m = POLICY_LOSSES.get("ppo_clip")(lp, old, adv, torch.ones(4, 1), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss[:, 0], torch.tensor([-1.2, 1.5, -0.5, 0.8]))
    assert m["clip_frac"] == 0.5
    # clip-higher: with eps_high 0.6 the first token is no longer clipped
    loss, _ = POLICY_LOSSES.get("ppo_clip")(lp, old, adv, torch.ones(4, 1), clip_low=0.2, clip_high=0.6)
    torch.testing.assert_close(loss[0, 0], torch.tensor(-1.5))


def test_ppo_clip_gradient_on_policy_is_minus_advantage():
    # at ratio 1, d loss / d logprob = -A
    lp = torch.zeros(2, 2, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0], [-1.0, -1.0]])
    loss, _ = POLICY_LOSSES.get("ppo_clip")(lp, lp.detach(), adv, torch.ones(2, 2))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -adv)


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2, 3], [4, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    got = {k: AGGREGATIONS.get(k)(loss, mask).item() for k in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]}
    expect = {"token-mean": 2.5, "seq-mean-token-mean": 3.0, "seq-mean-token-sum": 5.0, "seq-mean-token-sum-norm": 10 / 6}
    assert got.keys() == expect.keys()
    for k in expect:
        assert math.isclose(got[k], expect[k], rel_tol=1e-6), k


def test_kl_estimators_by_hand():
    lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert math.isclose(KL_ESTIMATORS.get("k1")(lp, ref).item(), math.log(2), rel_tol=1e-6)
    assert math.isclose(KL_ESTIMATORS.get("k2")(lp, ref).item(), 0.5 * math.log(2) ** 2, rel_tol=1e-6)
    assert math.isclose(KL_ESTIMATORS.get("k3")(lp, ref).item(), 0.5 - 1 + math.log(2), rel_tol=1e-6)


def test_pass_at_k():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 1, 8) == 1.0
    assert math.isclose(pass_at_k(4, 1, 2), 0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
