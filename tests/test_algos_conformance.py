"""One conformance suite over every registered estimator, loss, aggregation and KL estimator.

Like optax's `_common_test.py`: a new entry in a registry is picked up here automatically and
must pass every check. Losses and aggregations must also bring their closed-form gradient to
`LOSS_GRADS` / `AGG_WEIGHTS`, which the suite compares with autograd.
"""

import inspect
import math

import pytest
import torch

from assay.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES, aggregate, hyperparameters, loss_reads, requirements
from assay.training.extras import EXTRAS

N_GROUPS, G, T = 4, 4, 7
B = N_GROUPS * G
PER_TOKEN = {"values", "logprobs", "ref_logprobs"}  # extras with a T axis


def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (B,), generator=g).float() / 2  # {0, .5, 1}
    rewards[3] = math.nan
    rewards[4:8] = torch.tensor([0.0, 1.0, 1.0, 0.5])  # group 1 has signal for sure
    lengths = torch.randint(2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    S = 3
    step_rewards = torch.full((B, S), math.nan)
    step_ends = torch.full((B, S), -1, dtype=torch.long)
    for i in range(B):
        n = min(S, int(lengths[i]))
        step_ends[i, :n] = torch.sort(torch.randperm(int(lengths[i]), generator=g)[:n]).values
        step_rewards[i, :n] = torch.rand(n, generator=g)
    logprobs = -torch.rand(B, T, generator=g) * 3
    K = 3  # episodes of 1 to 3 turns: a model turn, then one environment token (mask 0) between turns
    turn_rewards = torch.full((B, K), math.nan)
    turn_progress = torch.full((B, K), math.nan)
    turn_index = torch.full((B, T), -1, dtype=torch.long)
    for i in range(B):
        n = int(torch.randint(1, K + 1, (1,), generator=g))
        turn_rewards[i, :n] = torch.rand(n, generator=g).round(decimals=1)
        turn_progress[i, :n] = torch.rand(n, generator=g).round(decimals=1)
        turn_index[i] = torch.clamp(torch.arange(T) * n // T, max=n - 1)
        for b in (torch.arange(1, n) * T // n).tolist():
            mask[i, b] = 0  # the environment's token at the turn boundary
        turn_index[i][mask[i] == 0] = -1
    return {
        "rewards": rewards,
        "group": torch.arange(N_GROUPS).repeat_interleave(G),
        "mask": mask,
        "values": torch.rand(B, T, generator=g),
        "greedy_rewards": torch.rand(B, generator=g),
        "components": torch.rand(B, 3, generator=g).round(decimals=1),
        "step_rewards": step_rewards,
        "step_ends": step_ends,
        "correct": rewards >= 1.0,
        "logprobs": logprobs,
        "ref_logprobs": logprobs + 0.3 * torch.randn(B, T, generator=g),
        "kl_coef": 0.05,
        "turn_rewards": turn_rewards,
        "turn_index": turn_index,
        "turn_progress": turn_progress,
    }


EXTRA_NAMES = {"values", "greedy_rewards", "components", "step_rewards", "step_ends", "correct", "logprobs", "ref_logprobs", "kl_coef",
               "turn_rewards", "turn_index", "turn_progress"}


def call(name, batch: dict, only_needed: bool = True) -> torch.Tensor:
    """Run estimator `name` (or a function) with the extras it declares (or all of them)."""
    fn = ADVANTAGES.get(name) if isinstance(name, str) else name
    keys = getattr(fn, "needs", frozenset()) if only_needed else EXTRA_NAMES
    return fn(batch["rewards"], batch["group"], batch["mask"], **{k: batch[k] for k in keys})


def take_rows(batch: dict, idx: torch.Tensor) -> dict:
    return {k: v[idx] if torch.is_tensor(v) else v for k, v in batch.items()}


ESTIMATORS = ADVANTAGES.names()


def test_registries_are_populated():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "remax", "gae", "gdpo", "passk",
            "tailrl", "evpo", "papo", "pure", "grpo_process", "frpo", "turn_grpo", "turn_progress"} <= set(ESTIMATORS)
    assert {"ppo_clip", "gspo", "cispo", "sapo", "reinforce"} <= set(POLICY_LOSSES.names())


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_contract(name):
    batch = make_batch()
    fn = ADVANTAGES.get(name)
    assert isinstance(fn.needs, frozenset) and requirements(name) == fn.needs
    assert fn.needs <= set(EXTRAS.names()), f"{name} needs an extra the trainer cannot provide"
    assert set(EXTRAS.names()) == EXTRA_NAMES  # every extra has test data above
    # every hyperparameter has a default and a type the config can check
    assert all(v is not inspect.Parameter.empty for v in hyperparameters(fn, ("rewards", "group", "mask")).values())
    assert isinstance(fn.mixes_groups, bool) and isinstance(fn.groups, bool)
    out = call(name, batch)
    assert out.shape == (B, T) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert (out[batch["mask"] == 0] == 0).all(), "padding must get 0"
    assert (out[batch["rewards"].isnan()] == 0).all(), "unscored samples must get 0"
    assert out.abs().sum() > 0, "a batch with signal must give some advantage"
    # extras it did not ask for are ignored
    torch.testing.assert_close(call(name, batch, only_needed=False), out)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_padding_invariance(name):
    batch = make_batch(1)
    out = call(name, batch)
    padded = dict(batch)
    garbage = torch.full((B, 3), 123.0)
    padded["mask"] = torch.cat([batch["mask"], torch.zeros(B, 3)], 1)
    for k in PER_TOKEN:
        padded[k] = torch.cat([batch[k], garbage], 1)
    # garbage on the existing padding too
    for k in PER_TOKEN:
        padded[k] = torch.where(padded["mask"].bool(), padded[k], torch.full_like(padded[k], -77.0))
    # a turn index on padding names a real turn: the mask alone must keep it out
    padded["turn_index"] = torch.cat([batch["turn_index"], torch.zeros(B, 3, dtype=torch.long)], 1)
    out_p = call(name, padded)
    torch.testing.assert_close(out_p[:, :T], out, atol=1e-5, rtol=1e-5)
    assert (out_p[:, T:] == 0).all()


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_permutation_equivariance(name):
    batch = make_batch(2)
    out = call(name, batch)
    g = torch.Generator().manual_seed(0)
    # within each group
    within = torch.cat([k * G + torch.randperm(G, generator=g) for k in range(N_GROUPS)])
    torch.testing.assert_close(call(name, take_rows(batch, within)), out[within], atol=1e-5, rtol=1e-5)
    # any reordering of the batch, and any renaming of the groups
    perm = torch.randperm(B, generator=g)
    shuffled = take_rows(batch, perm)
    torch.testing.assert_close(call(name, shuffled), out[perm], atol=1e-5, rtol=1e-5)
    shuffled["group"] = torch.tensor([2, 0, 3, 1])[shuffled["group"]]
    torch.testing.assert_close(call(name, shuffled), out[perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_estimator_declares_whether_it_needs_groups(name):
    """`groups=True` exactly when one sample per group (`rollout.group_size=1`) leaves every advantage 0 (with no KL to
    the reference, FRPO's other term), so the config can refuse that pairing and name the estimators that need groups."""
    batch = make_batch(4)
    batch["group"] = torch.arange(B)
    batch["ref_logprobs"] = batch["logprobs"]
    silent = bool((call(name, batch) == 0).all())
    assert ADVANTAGES.get(name).groups == silent, f"{name}: declared groups={ADVANTAGES.get(name).groups}, but G=1 gives {'no' if silent else 'some'} signal"


@pytest.mark.parametrize("name", ESTIMATORS)
def test_a_wholly_unscored_group_gets_zero_advantage(name):
    """A group whose every reward is None (an unparseable reference, a reward that failed) is no crash: 0 advantage."""
    batch = make_batch(5)
    batch["rewards"][batch["group"] == 2] = math.nan
    out = call(name, batch)
    assert torch.isfinite(out).all() and (out[batch["group"] == 2] == 0).all()


def check_no_mixing(name):
    batch = make_batch(3)
    out = call(name, batch)
    changed = dict(batch)
    rows = batch["group"] == 0
    for k in ("rewards", "greedy_rewards"):
        changed[k] = torch.where(rows, torch.flip(batch[k], [0]) * 3 + 1, batch[k])
    for k in ("components", "step_rewards", "values", "logprobs", "turn_rewards", "turn_progress"):
        changed[k] = torch.where(rows[:, None], batch[k] * 2 - 1, batch[k])
    changed["correct"] = torch.where(rows, ~batch["correct"], batch["correct"])
    out_c = call(name, changed)
    assert not torch.allclose(out_c[rows], out[rows]), "the change must reach group 0"
    torch.testing.assert_close(out_c[~rows], out[~rows])
    # and one group alone gives the same advantages as inside the batch
    alone = take_rows(batch, torch.nonzero(batch["group"] == 1).flatten())
    alone["group"] = torch.zeros_like(alone["group"])
    torch.testing.assert_close(call(name, alone), out[batch["group"] == 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in ESTIMATORS if not ADVANTAGES.get(n).mixes_groups])
def test_estimator_does_not_mix_groups(name):
    check_no_mixing(name)


def test_suite_catches_a_mixing_estimator():
    def batch_mean(rewards, group, mask, **_):  # GRPO's mistake of a batch-wide baseline
        r = torch.nan_to_num(rewards)
        return (r - r.mean())[:, None] * mask

    with pytest.raises(AssertionError):
        check_no_mixing(batch_mean)


# ---------------------------------------------------------------- policy losses


def _sigmoid_weight(ratio, a, tau_pos=1.0, tau_neg=1.05):
    tau = torch.where(a > 0, torch.full_like(a, tau_pos), torch.full_like(a, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1))
    return 4 * s * (1 - s)


def _clip_grad(ratio, a, low, high, dual=None):
    """∂/∂log π of max(−ρA, −clip(ρ)A), possibly dual-clipped: −Aρ where the unclipped term is active."""
    unclipped, clipped = -a * ratio, -a * ratio.clamp(1 - low, 1 + high)
    g = torch.where(unclipped >= clipped, -a * ratio, torch.zeros_like(a))
    if dual is not None:
        g = torch.where((a < 0) & (torch.maximum(unclipped, clipped) > -dual * a), torch.zeros_like(a), g)
    return g


def _seq_ratio(lp, old, mask):
    m = mask.bool()
    return torch.exp(torch.where(m, lp - old, 0.0).sum(-1) / m.sum(-1).clamp(min=1))[:, None].expand_as(lp)


LOGPROB_LOSSES = [n for n in POLICY_LOSSES.names() if loss_reads(n) == "logprobs"]

# name -> (hparams, closed-form ∂(Σ_t L_t)/∂log π_t); every registered loss needs at least one entry
LOSS_GRADS = {
    "ppo_clip": [
        ({}, lambda lp, old, a, m: _clip_grad(torch.exp(lp - old), a, 0.2, 0.2)),
        ({"clip_high": 0.28, "dual_clip": 3.0}, lambda lp, old, a, m: _clip_grad(torch.exp(lp - old), a, 0.2, 0.28, 3.0)),
    ],
    "gspo": [
        ({}, lambda lp, old, a, m: _clip_grad(_seq_ratio(lp, old, m), a, 3e-4, 4e-4)),
        ({"clip_low": 0.2, "clip_high": 0.2}, lambda lp, old, a, m: _clip_grad(_seq_ratio(lp, old, m), a, 0.2, 0.2)),
    ],
    "cispo": [({}, lambda lp, old, a, m: -a * torch.exp(lp - old).clamp(0.0, 1.28))],
    "sapo": [({}, lambda lp, old, a, m: -a * torch.exp(lp - old) * _sigmoid_weight(torch.exp(lp - old), a))],
    "reinforce": [({}, lambda lp, old, a, m: -a)],
    "rwr": [({}, lambda lp, old, a, m: -torch.exp(a).clamp(max=20.0)),
            ({"beta": 0.25, "max_weight": 2.0}, lambda lp, old, a, m: -torch.exp(a / 0.25).clamp(max=2.0))],
}
LOSS_CASES = [(name, i) for name in LOGPROB_LOSSES for i in range(len(LOSS_GRADS.get(name, [None])))]


def loss_inputs(seed=0, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    b = make_batch(seed)
    old = b["logprobs"]
    lp = old + spread * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    return lp, old, adv, b["mask"]


def test_every_loss_has_a_stated_gradient():
    # a loss on the forward process (nft) has its closed-form gradient checked in tests/test_images.py
    assert set(LOGPROB_LOSSES) <= set(LOSS_GRADS), "add the closed-form gradient of the new loss to LOSS_GRADS"


@pytest.mark.parametrize("name,case", LOSS_CASES)
def test_loss_contract(name, case):
    hp = LOSS_GRADS[name][case][0]
    lp, old, adv, mask = loss_inputs()
    out, metrics = POLICY_LOSSES.get(name)(lp, old, adv, mask, **hp, unrelated_hparam=1)
    assert out.shape == (B, T) and torch.isfinite(out).all()
    assert (out[mask == 0] == 0).all()
    assert isinstance(metrics, dict) and all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name,case", LOSS_CASES)
def test_loss_gradient_matches_closed_form(name, case):
    hp, grad_fn = LOSS_GRADS[name][case]
    lp, old, adv, mask = loss_inputs(1)
    lp = lp.requires_grad_()
    out, _ = POLICY_LOSSES.get(name)(lp, old, adv, mask, **hp)
    out.sum().backward()
    expected = grad_fn(lp.detach(), old, adv, mask) * mask
    torch.testing.assert_close(lp.grad, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name,case", LOSS_CASES)
@pytest.mark.parametrize("agg", AGGREGATIONS.names())
def test_loss_gradients_finite_at_extreme_ratios(name, case, agg):
    hp = LOSS_GRADS[name][case][0]
    lp, old, adv, mask = loss_inputs(2, spread=6.0)  # ratios from e^-20 to e^20
    lp = lp.requires_grad_()
    out, metrics = POLICY_LOSSES.get(name)(lp, old, adv, mask, **hp)
    aggregate(out, mask, agg).backward()
    assert torch.isfinite(lp.grad).all()
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name,case", LOSS_CASES)
def test_loss_padding_and_permutation(name, case):
    hp = LOSS_GRADS[name][case][0]
    lp, old, adv, mask = loss_inputs(3)
    fn = POLICY_LOSSES.get(name)
    out, metrics = fn(lp, old, adv, mask, **hp)
    # garbage on padding, and three more padding columns
    pad = lambda x, v: torch.cat([torch.where(mask.bool(), x, torch.full_like(x, v)), torch.full((B, 3), v)], 1)
    mask_p = torch.cat([mask, torch.zeros(B, 3)], 1)
    out_p, metrics_p = fn(pad(lp, 9.0), pad(old, -9.0), pad(adv, 50.0), mask_p, **hp)
    torch.testing.assert_close(out_p[:, :T], out)
    assert metrics_p == pytest.approx(metrics)
    # reordering rows reorders the loss; no row depends on another
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fn(lp[perm], old[perm], adv[perm], mask[perm], **hp)[0], out[perm])
    lp2 = lp.clone()
    lp2[0] += 1.0
    torch.testing.assert_close(fn(lp2, old, adv, mask, **hp)[0][1:], out[1:])


def test_gspo_gradient_is_the_sequence_objective():
    """With one advantage per response, GSPO-token's gradient is that of the sequence-level objective."""
    lp, old, _, mask = loss_inputs(4, spread=0.2)
    a_seq = torch.randn(B)
    for clip in (0.05, 10.0):  # some sequences clipped, and none
        x = lp.clone().requires_grad_()
        out, _ = POLICY_LOSSES.get("gspo")(x, old, a_seq[:, None].expand(B, T), mask, clip_low=clip, clip_high=clip)
        aggregate(out, mask, "seq-mean-token-mean").backward()
        y = lp.clone().requires_grad_()
        m = mask.bool()
        s = torch.exp(torch.where(m, y - old, 0.0).sum(-1) / m.sum(-1))  # [B]
        objective = torch.minimum(s * a_seq, s.clamp(1 - clip, 1 + clip) * a_seq).mean()
        (-objective).backward()
        torch.testing.assert_close(x.grad, y.grad, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- aggregations


AGG_WEIGHTS = {  # ∂ aggregate / ∂ L[b, t]
    "token-mean": lambda m, kw: m / m.sum(),
    "seq-mean-token-mean": lambda m, kw: m / (m.shape[0] * m.sum(-1, keepdim=True)),
    "seq-mean-token-sum": lambda m, kw: m / m.shape[0],
    "seq-mean-token-sum-norm": lambda m, kw: m / (m.shape[0] * kw.get("norm", m.shape[1])),
}


@pytest.mark.parametrize("agg", AGGREGATIONS.names())
def test_aggregation_contract(agg):
    assert agg in AGG_WEIGHTS, "add the new aggregation's gradient to AGG_WEIGHTS"
    _, _, loss_mat, mask = loss_inputs(5)
    kw = {"norm": 16} if agg == "seq-mean-token-sum-norm" else {}
    x = loss_mat.clone().requires_grad_()
    value = aggregate(x, mask, agg, **kw)
    assert value.dim() == 0 and torch.isfinite(value)
    value.backward()
    torch.testing.assert_close(x.grad, AGG_WEIGHTS[agg](mask, kw))
    # padding (with garbage) changes nothing once the normaliser is a constant
    mask_p = torch.cat([mask, torch.zeros(B, 2)], 1)
    garbage = torch.cat([torch.where(mask.bool(), loss_mat, 99.0), torch.full((B, 2), 99.0)], 1)
    torch.testing.assert_close(aggregate(garbage, mask_p, agg, **kw), value.detach())
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(aggregate(loss_mat[perm], mask[perm], agg, **kw), value.detach())


# ---------------------------------------------------------------- KL estimators


KL_GRADS = {  # ∂k/∂log π with x = log π − log π_ref
    "k1": lambda x: torch.ones_like(x),
    "k2": lambda x: x,
    "k3": lambda x: 1 - torch.exp(-x),
}


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_kl_estimator_contract(name):
    assert name in KL_GRADS
    b = make_batch(6)
    lp = b["logprobs"].clone().requires_grad_()
    kl = KL_ESTIMATORS.get(name)(lp, b["ref_logprobs"])
    assert kl.shape == (B, T) and torch.isfinite(kl).all()
    assert (KL_ESTIMATORS.get(name)(b["logprobs"], b["logprobs"]) == 0).all()
    if name != "k1":
        assert (kl >= 0).all()
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, KL_GRADS[name](b["logprobs"] - b["ref_logprobs"]), atol=1e-6, rtol=1e-5)
