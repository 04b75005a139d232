"""The learned critic of gae/evpo: where its values sit, that it learns, that it saves and resumes."""

import math

import pytest
import torch

from assay.algos import explained_variance
from assay.config import CriticConfig
from assay.models import load_policy
from assay.training.critic import Critic
from assay.training.learner import collate
from assay.types import RewardResult, Sample, Trajectory


@pytest.fixture()
def policy(tiny_model_dir):
    torch.manual_seed(0)
    model, tok = load_policy(str(tiny_model_dir))
    return model, tok


def fixed_batch(tok, n=8):
    """n prompts `k+k=`, two completions each; prompts with even k score 1, odd k score 0."""
    trajs, results = [], []
    for k in range(n):
        prompt = tok(f"{k}+{k}=" + "1" * k, add_special_tokens=False)["input_ids"]  # prompt lengths differ: left padding
        for j, text in enumerate(("12", "345")):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            trajs.append(Trajectory(Sample(str(k), f"{k}+{k}="), text, prompt, ids, [0.0] * len(ids), True, group=k))
            results.append(RewardResult(float(k % 2 == 0)))
    return collate(trajs, results, tok.pad_token_id, torch.device("cpu"))


def test_values_sit_at_completion_positions_whatever_the_padding(policy):
    """V_t reads the state that predicts token t; a row gives the same values alone or padded in a batch."""
    model, tok = policy
    batch = fixed_batch(tok)
    critic = Critic(model, CriticConfig(), seed=0)
    v = critic.values(batch)  # [B, T]
    assert v.shape == batch.mask.shape and torch.all(v[batch.mask == 0] == 0)
    for i in (0, 5, 15):
        alone = critic.values(batch.select(torch.tensor([i])))  # no left padding, shorter T
        n = int(batch.mask[i].sum())
        torch.testing.assert_close(alone[0, :n], v[i, :n], rtol=1e-5, atol=1e-6)
    # the critic starts from the policy's backbone, not from random weights
    emb = model.get_input_embeddings().weight
    assert torch.equal(critic.model.backbone.get_input_embeddings().weight, emb)
    assert critic.model.backbone.get_input_embeddings().weight.data_ptr() != emb.data_ptr()


def test_critic_learns_a_fixed_batch(policy):
    """The value loss on one batch falls and the critic comes to explain the returns (EV near 1)."""
    model, tok = policy
    batch = fixed_batch(tok)
    critic = Critic(model, CriticConfig(lr=3e-3), seed=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # with γ = λ = 1 the return is the outcome reward on every token; the first loss is ½·mean((V − r)²) by hand
    v0 = critic.values(batch)
    r = batch.rewards[:, None].expand_as(v0)
    by_hand = (0.5 * (v0 - r) ** 2 * batch.mask).sum() / batch.mask.sum()
    first = critic.update(batch, v0, gamma=1.0, lam=1.0, epochs=1, minibatches=1)
    assert first["critic/loss"] == pytest.approx(float(by_hand), rel=1e-5)
    for _ in range(60):
        last = critic.update(batch, critic.values(batch), gamma=1.0, lam=1.0, epochs=1, minibatches=2)
    assert last["critic/loss"] < 0.1 * first["critic/loss"]
    v = critic.values(batch)
    returns = batch.rewards[:, None].expand_as(v) * batch.mask
    assert explained_variance(v, returns, batch.mask) > 0.9
    assert last["critic/explained_variance"] > 0.9
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # the policy is untouched


def test_value_clip_bounds_each_update(policy):
    """Value clipping is inactive at V = V_old and takes over once V has moved more than c from it."""
    model, tok = policy
    batch = fixed_batch(tok)
    critic = Critic(model, CriticConfig(lr=0.05, value_clip=0.01), seed=0)
    v0 = critic.values(batch)
    m = critic.update(batch, v0, gamma=1.0, lam=1.0, epochs=1, minibatches=1)
    assert m["critic/vf_clip_frac"] == 0.0  # the first minibatch starts at V_old: nothing clipped yet
    m = critic.update(batch, v0, gamma=1.0, lam=1.0, epochs=3, minibatches=1)  # targets still from v0
    assert 0.0 < m["critic/vf_clip_frac"] <= 1.0
    assert math.isfinite(m["critic/grad_norm"])


def test_critic_weights_and_optimizer_round_trip(policy):
    model, tok = policy
    batch = fixed_batch(tok)
    a = Critic(model, CriticConfig(lr=1e-3), seed=0)
    a.update(batch, a.values(batch), 1.0, 1.0, 1, 1)
    b = Critic(model, CriticConfig(lr=1e-3), seed=1)
    assert not torch.equal(a.values(batch), b.values(batch))
    b.load(a.tensors(), a.opt.state_dict())
    torch.testing.assert_close(a.values(batch), b.values(batch), rtol=0, atol=0)
    ma = a.update(batch, a.values(batch), 1.0, 1.0, 1, 1)
    mb = b.update(batch, b.values(batch), 1.0, 1.0, 1, 1)
    assert ma == mb


def test_resuming_a_run_without_a_critic_as_gae_is_refused_in_one_line(tiny_model_dir, tmp_path):
    from assay.errors import AssayError
    from assay.training.rl import Trainer
    from test_train_algos import cfg

    d = Trainer(cfg(tiny_model_dir, tmp_path, "plain", "train.steps=1")).fit(progress=False).run_dir
    with pytest.raises(AssayError, match="differs from the one the run was trained with in algo.advantage") as e:
        Trainer(cfg(tiny_model_dir, tmp_path, "plain", "train.steps=2", "algo.advantage=gae"), run_dir=d, resume=True)
    assert "\n" not in str(e.value)
