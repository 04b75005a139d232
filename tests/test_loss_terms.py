"""The KL and entropy terms of the loss, with the policy moved away from its reference.

Each term is checked three ways against a formula written out here on the model's own
forward (no assay kernel): its value (sign and scale of the coefficient), its gradient,
and the direction of one gradient step (a KL penalty pulls the policy back toward the
reference; an entropy bonus spreads it out).
"""

import copy

import pytest
import torch

from assay.config import AlgoConfig
from assay.data.tasks import make_task
from assay.models import build_char_tokenizer, build_tiny_model, quiet_hf
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training import learner
from assay.types import RewardResult

quiet_hf()
TOK = build_char_tokenizer()


@pytest.fixture(scope="module")
def setup():
    """A policy, a reference 0.1·N(0,1) away from it, and a batch the policy sampled."""
    ref = build_tiny_model(TOK, hidden=32, layers=2, heads=2, intermediate=64, seed=0).eval()
    policy = copy.deepcopy(ref)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    prompts = [s for _, s in zip(range(4), make_task("arithmetic").stream("train", 0))]
    trajs = TorchSampler(policy, TOK).generate(prompts, 3, SamplingParams(8, 1.0), torch.Generator().manual_seed(1))
    batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), TOK.pad_token_id, torch.device("cpu"))
    return policy, ref.requires_grad_(False), batch


def plain_logprobs(model, batch, temperature=1.0):
    """log π of every completion token and the full log-distribution, from the model's own forward."""
    T = batch.response_len
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    logp = torch.log_softmax(logits[:, -T - 1 : -1].float() / temperature, dim=-1)  # [B, T, V]
    return logp.gather(-1, batch.input_ids[:, -T:, None])[..., 0], logp


def token_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def loss_and_grads(model, ref, batch, algo):
    model.zero_grad(set_to_none=True)
    loss, metrics = learner.policy_step(model, ref, batch, torch.zeros_like(batch.mask), algo, 1.0, 8, fast=False)
    loss.backward()
    return loss.item(), metrics, [p.grad.detach().clone() for p in model.parameters()]


def test_kl_penalty_value_gradient_and_direction(setup):
    policy, ref, batch = setup
    coef = 0.3
    with torch.no_grad():
        ref_lp, _ = plain_logprobs(ref, batch)
    # k3 by hand: r = log π_ref − log π;  k3 = e^r − 1 − r  (≥ 0, zero only where the two agree)
    lp, _ = plain_logprobs(policy, batch)
    r = ref_lp - lp
    k3 = token_mean(torch.exp(r) - 1 - r, batch.mask)
    policy.zero_grad(set_to_none=True)
    (coef * k3).backward()
    want_grads = [p.grad.detach().clone() for p in policy.parameters()]
    assert k3.item() > 1e-3  # the policy really is away from the reference

    # with zero advantages the policy term is 0: the loss is exactly +coef · k3
    loss, metrics, grads = loss_and_grads(policy, ref, batch, AlgoConfig(kl_coef=coef, kl_estimator="k3"))
    assert loss == pytest.approx(coef * k3.item(), rel=1e-5)
    assert metrics["actor/kl"] == pytest.approx(k3.item(), rel=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)

    # twice the coefficient, twice the loss; zero coefficient, no KL term at all
    assert loss_and_grads(policy, ref, batch, AlgoConfig(kl_coef=2 * coef))[0] == pytest.approx(2 * coef * k3.item(), rel=1e-5)
    zero_loss, zero_metrics, _ = loss_and_grads(policy, ref, batch, AlgoConfig(kl_coef=0.0))
    assert zero_loss == 0.0 and "actor/kl" not in zero_metrics

    # one small step down the gradient moves the policy toward the reference
    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p, g in zip(moved.parameters(), grads):
            p.sub_(0.5 * g)
        after = token_mean(torch.exp(ref_lp - plain_logprobs(moved, batch)[0]) - 1 - (ref_lp - plain_logprobs(moved, batch)[0]), batch.mask)
    assert after.item() < k3.item()


@pytest.mark.parametrize("estimator,formula", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (lp - ref) ** 2),
])
def test_other_kl_estimators_enter_the_loss_as_written(setup, estimator, formula):
    policy, ref, batch = setup
    with torch.no_grad():
        want = token_mean(formula(plain_logprobs(policy, batch)[0], plain_logprobs(ref, batch)[0]), batch.mask).item()
    loss, _, _ = loss_and_grads(policy, ref, batch, AlgoConfig(kl_coef=0.5, kl_estimator=estimator))
    assert loss == pytest.approx(0.5 * want, rel=1e-4, abs=1e-7)


def test_entropy_bonus_value_gradient_and_direction(setup):
    policy, _, batch = setup
    coef = 0.2
    _, logp = plain_logprobs(policy, batch)
    H = token_mean(-(logp.exp() * logp).sum(-1), batch.mask)  # mean entropy of the next-token distributions
    policy.zero_grad(set_to_none=True)
    (-coef * H).backward()
    want_grads = [p.grad.detach().clone() for p in policy.parameters()]

    # a bonus: the loss is −coef · H, so minimising it raises the entropy
    loss, metrics, grads = loss_and_grads(policy, None, batch, AlgoConfig(entropy_coef=coef))
    assert loss == pytest.approx(-coef * H.item(), rel=1e-5)
    assert metrics["actor/entropy"] == pytest.approx(H.item(), rel=1e-5)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    assert loss_and_grads(policy, None, batch, AlgoConfig(entropy_coef=0.0))[0] == 0.0  # reported, not in the loss

    moved = copy.deepcopy(policy)
    with torch.no_grad():
        for p, g in zip(moved.parameters(), grads):
            p.sub_(1.0 * g)
        _, logp2 = plain_logprobs(moved, batch)
        assert token_mean(-(logp2.exp() * logp2).sum(-1), batch.mask).item() > H.item()


def test_kl_and_entropy_add_to_the_policy_term(setup):
    """All three terms at once: loss = policy term + kl_coef·KL − entropy_coef·H, token-mean."""
    policy, ref, batch = setup
    adv = torch.linspace(-1, 1, batch.mask.shape[0])[:, None].expand_as(batch.mask).contiguous()
    with torch.no_grad():
        lp, logp = plain_logprobs(policy, batch)
        ref_lp, _ = plain_logprobs(ref, batch)
        r = ref_lp - lp
        # ppo_clip at ratio 1 is −A per token
        want = token_mean(-adv, batch.mask) + 0.1 * token_mean(torch.exp(r) - 1 - r, batch.mask) - 0.05 * token_mean(-(logp.exp() * logp).sum(-1), batch.mask)
    batch_on_policy = copy.copy(batch)
    batch_on_policy.old_logprobs = lp * batch.mask
    loss, _ = learner.policy_step(policy, ref, batch_on_policy, adv, AlgoConfig(kl_coef=0.1, entropy_coef=0.05), 1.0, 8, fast=False)
    assert loss.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
