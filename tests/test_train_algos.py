"""Every advantage estimator and policy loss trains through the real loop for 3 steps.

Runs are scored by `LEARNING_SIGNAL` (a 0/1 reward that varies within groups), so each one
really updates the model; the first update's loss is recomputed here directly from the
same batch (the estimator through `compute_advantages`, the loss function on the model's
own logprobs) and must equal what the trainer logged.
"""

import math

import pytest
import torch

from _train_helpers import LEARNING_SIGNAL, assert_learned, direct_first_loss
from assay.algos import ADVANTAGES, POLICY_LOSSES, loss_reads, requirements
from assay.config import AlgoConfig, load_config
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.training.learner import collate, compute_advantages
from assay.training.rl import Trainer
from assay.types import RewardResult, Sample, Trajectory

NEEDS_CRITIC = {name for name in ADVANTAGES.names() if "values" in requirements(name)}
CRITIC_KEYS = {"critic/loss", "critic/explained_variance", "critic/value_mean", "critic/grad_norm", "critic/vf_clip_frac"}


def cfg(model_dir, out, name, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=3", "train.eval_every=0",
        "train.eval_n=8", "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=3", "rollout.group_size=4", "train.threads=1",
        "optim.lr=1e-3", LEARNING_SIGNAL, *extra,
    ])


@pytest.fixture
def first_batch(monkeypatch):
    """Records the first step's batch and the advantages the trainer computed for it."""
    import assay.training.rl as rl

    seen = {}
    real = rl.compute_advantages

    def capture(batch, algo, extras=None, args=None):
        adv = real(batch, algo, extras, args)
        seen.setdefault("batch", batch)
        seen.setdefault("advantages", adv)
        seen.setdefault("again", lambda: real(batch, algo, extras))  # the config's own args, bound afresh
        return adv

    monkeypatch.setattr(rl, "compute_advantages", capture)
    return seen


def check_first_update(trainer_cfg, model_dir, seen, row):
    """The logged first loss is the loss function's on that batch; the advantages are compute_advantages'."""
    from assay.models import load_policy

    torch.testing.assert_close(seen["again"](), seen["advantages"])
    assert float(seen["advantages"].abs().max()) > 0  # the reward varied: there is something to learn
    model, _ = load_policy(str(model_dir))
    want = direct_first_loss(model, seen["batch"], seen["advantages"], trainer_cfg)
    assert row["actor/loss"] == pytest.approx(want, rel=1e-4, abs=1e-6)


def trained_steps(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "actor/loss" in r]


@pytest.mark.parametrize("advantage", sorted(ADVANTAGES.names()))
def test_every_estimator_trains(tiny_model_dir, tmp_path, advantage, first_batch):
    extra = ["algo.kl_coef=0.05"] if "ref_logprobs" in requirements(advantage) else []
    if "step_rewards" in requirements(advantage):  # a process reward: a score per step
        extra.append("reward={name: '_reward_helpers:RandomSteps'}")
    if "components" in requirements(advantage):  # a composed reward with named components
        extra.append("reward={name: weighted, args: {components: {correct: {name: random, args: {p: 0.5}}, short: {name: length, args: {max_len: 3}}}}}")
    c = cfg(tiny_model_dir, tmp_path, advantage, f"algo.advantage={advantage}", *extra)
    d = Trainer(c).fit(progress=False).run_dir
    rows = trained_steps(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)
    assert_learned(d, tiny_model_dir)
    check_first_update(c, tiny_model_dir, first_batch, rows[0])
    if advantage in NEEDS_CRITIC:  # the trainer built and trained a critic for it
        assert all(CRITIC_KEYS <= r.keys() and r["critic/loss"] >= 0 for r in rows)
        assert (d / "checkpoints" / "step_000003" / "critic.safetensors").is_file()
    else:
        assert not any(k.startswith("critic/") for r in rows for k in r)


@pytest.mark.parametrize("loss", [n for n in POLICY_LOSSES.names() if loss_reads(n) == "logprobs"])  # nft: tests/test_images.py
def test_every_loss_trains(tiny_model_dir, tmp_path, loss, first_batch):
    c = cfg(tiny_model_dir, tmp_path, loss, f"algo.loss={loss}", "algo.aggregation=seq-mean-token-sum-norm")
    d = Trainer(c).fit(progress=False).run_dir
    rows = trained_steps(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert_learned(d, tiny_model_dir)
    check_first_update(c, tiny_model_dir, first_batch, rows[0])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_every_aggregation_trains(tiny_model_dir, tmp_path, aggregation, first_batch):
    c = cfg(tiny_model_dir, tmp_path, aggregation, "algo.loss=reinforce", f"algo.aggregation={aggregation}")
    d = Trainer(c).fit(progress=False).run_dir
    assert_learned(d, tiny_model_dir)
    check_first_update(c, tiny_model_dir, first_batch, trained_steps(d)[0])


@pytest.mark.parametrize("advantage", sorted(NEEDS_CRITIC))
def test_compute_advantages_without_values_is_refused_in_one_line(advantage):
    batch = collate([Trajectory(Sample("a", "1+1="), "2", [1, 2], [3], [-0.5], True)], [RewardResult(1.0)], 0, torch.device("cpu"))
    with pytest.raises(AssayError, match=r"needs (\w+, )*values") as e:
        compute_advantages(batch, AlgoConfig(advantage=advantage))
    assert "\n" not in str(e.value)
    given = {"values": torch.zeros(1, 1), "turn_rewards": torch.zeros(1, 1), "turn_index": torch.zeros(1, 1, dtype=torch.long)}  # one turn
    extras = {k: v for k, v in given.items() if k in requirements(advantage)}
    assert compute_advantages(batch, AlgoConfig(advantage=advantage), extras).shape == (1, 1)


def test_unknown_names_list_the_known_ones(tiny_model_dir, tmp_path):
    with pytest.raises(AssayError, match="known: .*grpo"):
        Trainer(cfg(tiny_model_dir, tmp_path, "x", "algo.advantage=nope")).fit(progress=False)


# ---------------------------------------------------------------- rollout/trainer mismatch correction


def shifted_sampler(monkeypatch, delta):
    """The sampler reports every logprob `delta` higher than it is: ρ = π_trainer/π_sampler = e^{−delta} per token."""
    from assay.rollout.torch_sampler import TorchSampler

    real = TorchSampler.generate

    def generate(self, *a, **kw):
        trajs = real(self, *a, **kw)
        for t in trajs:
            t.logprobs = [lp + delta for lp in t.logprobs]
        return trajs

    monkeypatch.setattr(TorchSampler, "generate", generate)


def first_step(model_dir, out, name, *extra):
    """Step 1 of a run with a 0/1 reward independent of the text (so advantages are not all 0).

    The loss is REINFORCE's −A·log π: a group's advantages sum to 0, so a ratio loss at
    ρ = 1 (−A per token) would average to 0 over equal lengths whatever the weights.
    """
    c = cfg(model_dir, out, name, "train.steps=1", "reward={name: random, args: {p: 0.5}}", "algo.loss=reinforce", *extra)
    return trained_steps(Trainer(c).fit(progress=False).run_dir)[0]


def test_mismatch_weights_scale_the_policy_loss(tiny_model_dir, tmp_path, monkeypatch):
    """The loss is mean(−w·A·log π) over tokens: a constant weight w scales it and its gradient by w."""
    base = first_step(tiny_model_dir, tmp_path, "base", "algo.mismatch=tis")
    assert base["mismatch/weight_mean"] == pytest.approx(1.0, abs=1e-5) and base["mismatch/corrected_frac"] == 0.0
    assert abs(base["actor/loss"]) > 1e-4 and base["actor/grad_norm"] > 1e-4

    shifted_sampler(monkeypatch, math.log(4))  # ρ = 1/4 < cap: TIS weight 1/4 on every token
    quarter = first_step(tiny_model_dir, tmp_path, "quarter", "algo.mismatch=tis")
    assert quarter["mismatch/weight_mean"] == pytest.approx(0.25, rel=1e-5)
    assert quarter["mismatch/k1"] == pytest.approx(math.log(4), rel=1e-5)  # log(π_sampler/π_trainer) per token
    assert quarter["mismatch/k3"] == pytest.approx(0.25 - 1 + math.log(4), rel=1e-5)  # e^{−x} − 1 + x
    assert quarter["mismatch/abs_diff_max"] == pytest.approx(math.log(4), rel=1e-5)
    assert quarter["actor/loss"] == pytest.approx(0.25 * base["actor/loss"], rel=1e-4)
    assert quarter["actor/grad_norm"] == pytest.approx(0.25 * base["actor/grad_norm"], rel=1e-4)
    assert quarter["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the ratio uses the trainer's π_old

    shifted_sampler(monkeypatch, -math.log(4))  # on top of the +log 4 patch: back to ρ = 1, then ρ = 4
    shifted_sampler(monkeypatch, -math.log(4))
    capped = first_step(tiny_model_dir, tmp_path, "capped", "algo.mismatch=tis", "algo.mismatch_cap=2")
    assert capped["mismatch/weight_mean"] == pytest.approx(2.0, rel=1e-5) and capped["mismatch/corrected_frac"] == 1.0
    assert capped["actor/loss"] == pytest.approx(2.0 * base["actor/loss"], rel=1e-4)
    masked = first_step(tiny_model_dir, tmp_path, "masked", "algo.mismatch=mis", "algo.mismatch_cap=2")
    assert masked["mismatch/weight_mean"] == 0.0 and masked["mismatch/corrected_frac"] == 1.0
    assert masked["actor/loss"] == 0.0 and masked["actor/grad_norm"] == 0.0  # every token left the loss


def test_mismatch_is_off_by_default_with_no_extra_forward_pass(tiny_model_dir, tmp_path, monkeypatch):
    import assay.training.rl as rl

    calls = {"n": 0}
    real = rl.token_logprobs

    def counting(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(rl, "token_logprobs", counting)
    row = first_step(tiny_model_dir, tmp_path, "default")
    assert calls["n"] == 0 and not any(k.startswith("mismatch/") for k in row)
    keys = {"mismatch/k1", "mismatch/corrected_frac", "mismatch/weight_mean"}
    row = first_step(tiny_model_dir, tmp_path, "mis", "algo.mismatch=mis")  # one optimizer step: its own forward is π_old
    assert calls["n"] == 0 and keys <= row.keys()
    row = first_step(tiny_model_dir, tmp_path, "mis2", "algo.mismatch=mis", "algo.epochs=2")  # two: one pass before
    assert calls["n"] == 1 and keys <= row.keys()
