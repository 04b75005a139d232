"""Every advantage estimator and policy loss trains through the real loop for 3 steps."""

import math

import pytest

from assay.algos import ADVANTAGES, POLICY_LOSSES, requirements
from assay.config import load_config
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.train.rl import Trainer

NEEDS_CRITIC = {name for name in ADVANTAGES.names() if "values" in requirements(name)}


def cfg(model_dir, out, name, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=3", "train.eval_every=0",
        "train.eval_n=8", "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=3", "rollout.group_size=4", "train.threads=1", *extra,
    ])


def trained_steps(run_dir):
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "actor/loss" in r]


@pytest.mark.parametrize("advantage", sorted(set(ADVANTAGES.names()) - NEEDS_CRITIC))
def test_every_estimator_trains(tiny_model_dir, tmp_path, advantage):
    extra = ["algo.kl_coef=0.05"] if "ref_logprobs" in requirements(advantage) else []
    if "components" in requirements(advantage):  # a composed reward with named components
        extra.append("reward={name: weighted, args: {components: {correct: arithmetic, short: {name: length, args: {max_len: 3}}}}}")
    d = Trainer(cfg(tiny_model_dir, tmp_path, advantage, f"algo.advantage={advantage}", *extra)).fit(progress=False).run_dir
    rows = trained_steps(d)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["actor/loss"]) and math.isfinite(r["actor/grad_norm"]) for r in rows)


@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_loss_trains(tiny_model_dir, tmp_path, loss):
    d = Trainer(cfg(tiny_model_dir, tmp_path, loss, f"algo.loss={loss}", "algo.aggregation=seq-mean-token-sum-norm")).fit(progress=False).run_dir
    assert [r["step"] for r in trained_steps(d)] == [1, 2, 3]


@pytest.mark.parametrize("advantage", sorted(NEEDS_CRITIC))
def test_estimators_needing_a_critic_are_refused_in_one_line(tiny_model_dir, tmp_path, advantage):
    with pytest.raises(AssayError, match="needs values"):
        Trainer(cfg(tiny_model_dir, tmp_path, advantage, f"algo.advantage={advantage}")).fit(progress=False)


def test_unknown_names_list_the_known_ones(tiny_model_dir, tmp_path):
    with pytest.raises(AssayError, match="known: .*grpo"):
        Trainer(cfg(tiny_model_dir, tmp_path, "x", "algo.advantage=nope")).fit(progress=False)
