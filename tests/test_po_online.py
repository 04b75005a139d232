"""`assay train algo.objective=NAME`: pairs from groups, the reference refreshed or kept, RAFT, exact resume, self-judging, the canary."""

import math

import pytest
import torch

from _train_helpers import LEARNING_SIGNAL, assert_learned, weights
from assay.api import train
from assay.errors import AssayError
from assay.po.pairs import group_pairs, pairs_of
from assay.po.selfjudge import CanaryGates, canary_metrics, serving_policy
from assay.report.metrics import read_metrics
from assay.training.health import HealthGates
from assay.types import RewardResult, Sample, Trajectory



def assert_keys_documented(run_dir):
    """The preference keys the run logged (`po/`, `raft/`, `canary/`) are defined in docs/metrics.md (the rest are `assay train`'s)."""
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    logged = {k for r in read_metrics(run_dir / "metrics.jsonl") for k in r if k.startswith(("po/", "raft/", "canary/"))}
    assert logged and not sorted(k for k in logged if f"`{k}`" not in text)


def item(score, error=None, text=""):
    return Trajectory(Sample("0", "1+1="), text, [1], [2], [0.0], True), RewardResult(score, error=error)


def test_pairs_of_a_group_by_hand():
    g = [item(0.2, text="a"), item(0.9, text="b"), item(None, text="c"), item(0.9, text="d"), item(1.0, error="boom", text="e"),
         item(0.2, text="f")]
    got = group_pairs(g, "best_worst")  # the unscored and failed ones take no part; the first of equals is taken
    assert [(c[0].completion, r[0].completion) for c, r in got.pairs] == [("b", "a")] and got.ties == 0
    got = group_pairs(g, "all")  # scored: a .2, b .9, d .9, f .2 → four pairs across, two ties (b–d, a–f)
    assert sorted((c[0].completion, r[0].completion) for c, r in got.pairs) == [("b", "a"), ("b", "f"), ("d", "a"), ("d", "f")]
    assert got.ties == 2
    assert group_pairs(g, "all", margin=0.7).ties == 6 and not group_pairs(g, "all", margin=0.7).pairs  # .7 apart is a tie too
    assert group_pairs([item(1.0), item(1.0)]).ties == 1  # best and worst tie: dropped, counted
    both = pairs_of([[item(1.0)], [item(None), item(0.0)], [item(1.0), item(0.0)]])
    assert (len(both.pairs), both.ties, both.unpaired) == (1, 0, 2)
    with pytest.raises(AssayError, match="pairs='best'"):
        group_pairs(g, "best")


def args(model_dir, out, name, *extra):
    return [f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=3", "train.eval_every=3", "train.eval_n=8",
            "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1", "optim.warmup_steps=0",
            "optim.lr=1e-3", LEARNING_SIGNAL, *extra]


def steps_of(run_dir):
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    return {r["step"]: {k: v for k, v in r.items() if not (k.startswith("perf/") or k.endswith("_per_s"))} for r in rows}  # timings differ


def test_online_dpo_refreshes_or_keeps_its_reference(tmp_path, tiny_model_dir):
    """`round`: each step's reference is the policy as the step began, so at its one update every margin is 0 and the loss
    is log 2; `initial`: the starting model stays the reference, so once the policy moved the margins do not vanish."""
    fresh = train(None, *args(tiny_model_dir, tmp_path, "round", "algo.objective=dpo", "preference.loss_args={beta: 0.5}"), progress=False)
    rows = steps_of(fresh.run_dir)
    assert all(r["po/loss"] == pytest.approx(math.log(2), abs=1e-5) and abs(r["po/reward_margin"]) < 1e-5 for r in rows.values())
    # 0/1 rewards: each of the 4 groups is a pair (best 1, worst 0) or a tie
    assert all(r["po/pairs"] + r["po/ties"] + r["po/unpaired_groups"] == 4 for r in rows.values()) and rows[1]["po/pairs"] > 0
    assert_learned(fresh.run_dir, tiny_model_dir)
    assert_keys_documented(fresh.run_dir)
    kept = train(None, *args(tiny_model_dir, tmp_path, "initial", "algo.objective=dpo", "preference.loss_args={beta: 0.5}",
                             "preference.reference=initial"), progress=False)
    rows = steps_of(kept.run_dir)
    assert rows[1]["po/loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert abs(rows[3]["po/reward_margin"]) > 1e-4 and rows[3]["po/loss"] != pytest.approx(math.log(2), abs=1e-5)


def test_resume_is_exact_with_a_kept_reference(tmp_path, tiny_model_dir):
    extra = ["algo.objective=kto", "preference.reference=initial", "train.save_every=2", "train.steps=4", "algo.minibatches=2",
             "preference.pairs=all"]
    whole = train(None, *args(tiny_model_dir, tmp_path, "whole", *extra), progress=False)
    cut = train(None, *args(tiny_model_dir, tmp_path, "cut", *[e if e != "train.steps=4" else "train.steps=2" for e in extra]),
                progress=False)
    resumed = train(None, "train.steps=4", resume=cut.run_dir, progress=False)
    assert steps_of(resumed.run_dir) == steps_of(whole.run_dir)
    a, b = weights(whole.model), weights(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(r["po/kl"] >= 0 for r in steps_of(whole.run_dir).values())


def test_raft_trains_on_each_group_s_best(tmp_path, tiny_model_dir):
    result = train(None, *args(tiny_model_dir, tmp_path, "raft", "algo.objective=raft", "preference.raft_keep=2"), progress=False)
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    steps = steps_of(result.run_dir)
    # 0/1 rewards, at most 2 kept from each of 4 groups, only those that scored 1
    for r in steps.values():
        assert 0 < r["raft/kept"] <= 8 and r["raft/nll"] > 0
    assert_learned(result.run_dir, tiny_model_dir)
    assert_keys_documented(result.run_dir)
    assert rows[0]["step"] == 0


@pytest.mark.parametrize("extra, needle", [
    (["algo.objective=dpp"], "unknown algo.objective 'dpp'; known: pg, raft, cdpo, dpo"),
    (["algo.objective=ipo", "preference.loss_args={beta: 0}"], "preference.loss_args: beta=0 for ipo must be > 0"),
    (["algo.objective=dpo", "rollout.group_size=1"], "pairs and best-of-N need two completions"),
    (["algo.objective=raft", "algo.kl_coef=0.1"], "set algo.kl_coef=0"),
])
def test_bad_objectives_are_one_line_before_any_folder(tmp_path, tiny_model_dir, extra, needle):
    with pytest.raises(AssayError) as e:
        train(None, *args(tiny_model_dir, tmp_path, "bad", *extra), progress=False)
    assert needle in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- self-judging and the canary


JUDGE = {"name": "judge", "args": {"url": "local://policy", "api": "completions", "template": "{completion}+0=", "low": 0, "high": 1000,
                                   "max_tokens": 6, "retries": 0}}


def test_a_local_judge_asks_the_live_policy(bundled):
    """The bundled model adds: asked `{completion}+0=`, it answers the completion's number, the judge's rating. The policy's
    own weights answer, at the moment of asking (no cache); with no policy served, each item is unscored in one line."""
    from assay.rewards.spec import build_reward

    model, tok = bundled
    judge = build_reward(JUDGE)
    trajs = [Trajectory(Sample(str(i), "1+1="), text, [], [], [], True) for i, text in enumerate(["2", "35"])]
    missing = judge(trajs)
    assert all(r.score is None and r.info["reason"] == "http_error" and "no model 'policy' is served" in r.error for r in missing)
    with serving_policy(model, tok) as live:
        got = judge(trajs)
        assert [r.components["rating"] for r in got] == [2.0, 35.0] and live.requests == 2
        judge(trajs)
        assert live.requests == 4  # asked again: a model that trains is never answered from a cache


def test_canary_metrics_and_warning_by_hand():
    t = [Trajectory(Sample(str(i), "q"), "", [], [], [], True) for i in range(6)]
    verified = {id(t[0]): 1.0, id(t[1]): 0.0, id(t[2]): 0.0, id(t[3]): 1.0, id(t[4]): None, id(t[5]): 0.0}
    # pairs (chosen, rejected): (0,1) agrees, (2,3) disagrees, (4,5) not comparable (4 unscored), (1,2) equal: not compared
    m = canary_metrics(verified, t, pairs=[(t[0], t[1]), (t[2], t[3]), (t[4], t[5]), (t[1], t[2])])
    assert m == {"canary/accuracy": 2 / 5, "canary/chosen_accuracy": 1 / 3, "canary/pairs_compared": 2.0, "canary/pair_agreement": 0.5}
    assert canary_metrics(verified, t, kept=[t[0], t[2]])["canary/kept_accuracy"] == 0.5
    gates = CanaryGates.around(HealthGates(0, 0.9, 0), floor=0.6)
    assert gates.check(1, {"canary/pair_agreement": 0.5, "canary/pairs_compared": 3.0, "canary/accuracy": 0.6}, t, []) is None  # 3: too few
    warning = gates.check(2, {"canary/pair_agreement": 0.25, "canary/pairs_compared": 8.0, "canary/accuracy": 0.5}, t, [])
    assert "agrees with the reward's choice on only 25% of the 8 pairs" in warning
    # nothing left to compare, but the verified share collapsed: still drifting (said again on the 10th drifting step in a row)
    said = [gates.check(3 + i, {"canary/pairs_compared": 1.0, "canary/accuracy": 0.1}, t, []) for i in range(9)]
    assert said == [None] * 8 + [said[-1]] and "accepts 10% of this step's completions, down from 60%" in said[-1]
    assert gates.check(12, {"canary/accuracy": 0.55}, t, []) is None and gates.drift_streak == 0
    again = CanaryGates.around(HealthGates(), floor=0.6)
    again.load_state_dict(gates.state_dict())  # a resumed run keeps the best share seen
    assert again.best_accuracy == 0.6


def test_self_rewarding_run_reports_the_canary(tmp_path):
    """The policy judges its own samples (local://policy); the task's verifier scores them beside it, untrained on."""
    from assay.api import run_config

    cfg = run_config({"reward": JUDGE, "algo": {"objective": "dpo"}}, [f"output_dir={tmp_path}", "run_name=self", "train.steps=2",
                     "train.eval_every=2", "train.eval_n=8", "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
                     "train.threads=1"])
    run = train(cfg, progress=False)
    rows = steps_of(run.run_dir)
    assert {"canary/accuracy", "canary/chosen_accuracy", "canary/pairs_compared", "reward/rating/mean"} <= rows[1].keys()
    assert 0 <= rows[2]["canary/accuracy"] <= 1 and "train/accuracy" not in rows[1]  # a judge's scores are not verdicts
    assert_keys_documented(run.run_dir)


def test_po_pairs_samples_scores_and_pairs_each_group(tmp_path, bundled):
    """`assay po pairs`: G completions of each prompt from the bundled model, scored by the task's verifier, best against worst;
    the file trains as it is (`read_preferences`)."""
    from assay.po.data import read_preferences
    from assay.po.pairs import sample_pairs, write_rows

    rows, counts = sample_pairs("tiny-arith", 12, 4, chunk=5)
    assert counts["completions"] == 48 and counts["pairs"] + counts["ties"] + counts["unpaired_groups"] == 12
    assert rows and all(r["chosen_reward"] == 1.0 and r["rejected_reward"] == 0.0 and r["chosen"] == r["answer"] for r in rows)
    write_rows(tmp_path / "p.jsonl", rows)
    assert [p.prompt for p in read_preferences(str(tmp_path / "p.jsonl"))] == [r["prompt"] for r in rows]
    again, _ = sample_pairs("tiny-arith", 12, 4, chunk=5)
    assert again == rows  # a function of the seed


def test_the_command_line_speaks_one_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "assay.cli", "po", "train", f"output_dir={tmp_path}"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and "data.path=None: give the training pairs" in out.stderr


def test_the_examples_are_valid_configs():
    from pathlib import Path

    from assay.config import load_config
    from assay.po.online import check_objective

    for name in ("online-dpo.yaml", "self-rewarding.yaml"):
        cfg = load_config(str(Path(__file__).parents[1] / "examples" / name))
        check_objective(cfg)
        assert cfg.algo.objective == "dpo"
