"""The lab's plumbing on synthetic rows (figures, claims, plot, page), and each experiment's own claim on a short real run (slow)."""

import json
import subprocess
import sys

import pytest

from assay.config import load_config
from assay.lab import EXPERIMENTS, run_lab
from assay.lab.run import fall_step, plot_lab, summarise, write_page
from assay.rewards.spec import build_reward


def rows(acc, lengths, canary=None, alarm_at=None):
    out = [{"step": 0, "eval/accuracy": acc[0]}]
    for i, n in enumerate(lengths, 1):
        r = {"step": i, "rollout/response_length": n, "rollout/repetition": 0.0, "reward/mean": 0.5 + 0.01 * i}
        if canary is not None:
            r["canary/mean"] = canary[i - 1]
        if i == alarm_at:
            r["alarm"], r["alarm/length"] = "length: grew", 1.0
        out.append(r)
    out.append({"step": len(lengths), "eval/accuracy": acc[1]})
    return out


def test_summary_reads_start_end_alarms_and_the_canary_drop_at_the_first_alarm():
    canary = [0.8] * 20 + [0.8 - 0.02 * i for i in range(1, 21)]
    s = summarise(rows((0.9, 0.2), [30.0] * 20 + [30.0 + i for i in range(1, 21)], canary, alarm_at=25))
    assert s["accuracy_start"] == 0.9 and s["accuracy_end"] == 0.2 and s["accuracy_gain"] == pytest.approx(-0.7)
    assert s["length_start"] == 30.0 and s["length_end"] == pytest.approx(45.5) and s["length_growth"] == pytest.approx(45.5 / 30 - 1)
    assert s["alarms"] == [("length", 25)] and s["first_alarm"] == ("length", 25)
    assert s["canary_drop_at_alarm"] == pytest.approx(0.8 - sum(canary[15:25]) / 10)  # best 10-step mean minus the one ending there


def test_a_fall_is_two_evaluations_in_a_row_below_the_best_before_them():
    wobble = [(0, 0.40), (10, 0.60), (20, 0.54), (30, 0.60), (40, 0.58)]  # one low evaluation, then back: noise
    assert fall_step(wobble) is None
    assert fall_step([*wobble, (50, 0.52), (60, 0.20)]) == 50  # 8 and 40 points below 0.60, in a row
    assert fall_step([*wobble, (50, 0.54)]) == 50  # the last evaluation has no next one: it counts alone
    assert fall_step([(0, 0.5)]) is None and fall_step([]) is None


def test_the_verified_accuracy_is_the_sampled_one_when_the_run_logs_it():
    greedy_only = rows((0.9, 0.2), [30.0] * 20, alarm_at=10)
    s = summarise(greedy_only)
    assert s["verified"] == "greedy" and s["accuracy_fall_step"] == 20 and s["accuracy_drop_at_alarm"] == 0.0
    both = [{**r, "eval/sampled_accuracy": 0.4 + 0.01 * r["step"]} if "eval/accuracy" in r else r for r in greedy_only]
    s = summarise(both)
    assert s["verified"] == "sampled" and s["verified_start"] == 0.4 and s["verified_best"] == pytest.approx(0.6)
    assert s["accuracy_fall_step"] is None and s["accuracy_start"] == 0.9  # greedy figures stay as they were


def test_every_arm_of_every_experiment_is_a_valid_config_whose_heldout_check_is_the_task_verifier():
    """No arm's reward gives verdicts except the ground truth: held-out accuracy is the task's verifier in every arm."""
    from assay.rewards.executor import gives_verdicts

    for exp in EXPERIMENTS.values():
        for arm in exp.arms:
            if any("${lab." in o for o in arm.overrides):
                continue  # a reward model: its folder is made by the experiment's first stage
            cfg = load_config(None, [*exp.base, *arm.overrides])
            assert gives_verdicts(build_reward(cfg.reward)) == (arm.name.startswith("truth")), (exp.name, arm.name)


def test_claims_are_judged_from_the_figures_and_the_page_says_what_was_not_seen(tmp_path):
    exp = EXPERIMENTS["prm-hacking"]
    hacked = rows((0.88, 0.0), [30.0] * 20 + [30.0 + i for i in range(1, 21)], [0.5] * 40, alarm_at=30)
    kept = rows((0.88, 0.85), [30.0] * 40, [0.5] * 40)
    per = {a.name: hacked if a.name == "sum" else kept for a in exp.arms}
    summaries = {a: {**summarise(r), "seconds": 1.0} for a, r in per.items()}
    claims = exp.claims(summaries)
    assert [c.seen for c in claims[:2]] == [True, True] and all(c.seen for c in claims[2:6])
    assert claims[-1].text.startswith("A hacking monitor fires") and "`length` at step 30" in claims[-1].figures
    assert claims[-1].seen and "had fallen 5 points at step 40" in claims[-1].figures
    unharmed = {**summaries, "sum": {**summarise(rows((0.88, 0.86), [30.0] * 40, [0.5] * 40, alarm_at=30)), "seconds": 1.0}}
    early = exp.claims(unharmed)[-1]  # an alarm, but held-out accuracy never fell: nothing for it to be early for
    assert not early.seen and "never fell 5 points" in early.figures
    summaries["min"] = summaries["sum"]  # a fix that did not hold: said so
    claims = exp.claims(summaries)
    page = write_page(exp, summaries, claims, plot_lab(exp, per, tmp_path / "lab.png"), tmp_path, 40, 0, {})
    text = page.read_text()
    assert (tmp_path / "lab.png").stat().st_size > 1000 and "data:image/png;base64," in text
    assert "Not seen:</b> With min, length and repetition stay near the start and held-out accuracy holds (within 15 points)" in text
    assert "assay train model.path=tiny-steps" in text and "sum@30" not in text and "length@30" in text


def test_an_unknown_experiment_is_one_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "assay", "lab", "nope", "--out", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "invalid choice: 'nope'" in p.stderr


@pytest.mark.slow
def test_prm_hacking_shows_the_hack_and_the_fix_that_holds(tmp_path):
    """The experiment's own claim on its two decisive arms: the summed process reward is farmed (longer completions,
    held-out accuracy gone) and flagged; success-gating keeps length and accuracy."""
    page = run_lab("prm-hacking", tmp_path, progress=False, arms=("sum", "gated"), log=lambda s: None)
    s = json.loads((page.parent / "summary.json").read_text())["arms"]
    assert s["sum"]["length_growth"] > 0.3 and s["sum"]["accuracy_end"] < s["sum"]["accuracy_start"] - 0.3
    assert s["sum"]["alarms"] and "Hacking alarms" in (page.parent / "sum" / "report.html").read_text()
    # the clause: an alarm before the verified accuracy (sampled, as the monitors read it) has fallen 5 points
    assert s["sum"]["verified"] == "sampled" and s["sum"]["accuracy_fall_step"] is not None
    assert s["sum"]["first_alarm"][1] < s["sum"]["accuracy_fall_step"], (s["sum"]["alarms"], s["sum"]["accuracy_fall_step"])
    assert abs(s["gated"]["length_growth"]) < 0.15 and s["gated"]["accuracy_end"] > max(0.6, s["sum"]["accuracy_end"] + 0.4)
    assert "claims, which compare arms, were not judged" in page.read_text()


@pytest.mark.slow
def test_spurious_rewards_gain_less_than_the_ground_truth(tmp_path):
    page = run_lab("spurious", tmp_path, steps=40, progress=False, arms=("truth", "random"), log=lambda s: None)
    s = json.loads((page.parent / "summary.json").read_text())["arms"]
    assert s["truth"]["accuracy_gain"] > 0.3  # tiny-sum3 has headroom: 0.13 → above 0.43 in 40 steps
    assert s["random"]["accuracy_gain"] < s["truth"]["accuracy_gain"] - 0.2
    assert s["random"]["canary_start"] is not None  # the task's verifier watched the random-reward run


@pytest.mark.slow
def test_length_hacking_trains_its_reward_models_and_the_hack_is_flagged(tmp_path):
    """The first stage trains two real reward models; RL against the plain one overshoots: held-out accuracy rises, then
    falls by 10 points or more from its best while the reward model's score climbs, and a monitor says so."""
    page = run_lab("length-hacking", tmp_path, progress=False, arms=("rm",), log=lambda s: None)
    s = json.loads((page.parent / "summary.json").read_text())["arms"]["rm"]
    assert (page.parent / "reward-model" / "final").is_dir() and (page.parent / "reward-model-odin" / "final").is_dir()
    assert s["accuracy_best"] > s["accuracy_start"] + 0.2 and s["accuracy_end"] < s["accuracy_best"] - 0.1
    assert s["reward_gain"] > 0 and {m for m, _ in s["alarms"]} & {"canary", "divergence"}


@pytest.mark.slow
def test_image_rewards_trains_a_picture_scorer_and_the_checker_watches_every_arm(tmp_path, monkeypatch):
    """The first stage draws pairs of the generator's pictures and trains a real picture scorer on them; the learned arm
    trains on the scorer alone with the checker as its canary, and the combined arm logs both rewards as components."""
    from assay.lab import experiments
    from assay.report.metrics import read_metrics

    monkeypatch.setattr(experiments, "IMAGE_PAIRS", 48)
    monkeypatch.setattr(experiments, "IMAGE_RM_STEPS", 20)
    page = run_lab("image-rewards", tmp_path, steps=2, progress=False, arms=("learned", "both"), log=lambda s: None)
    folder = page.parent
    assert (folder / "image-rm" / "final" / "model.safetensors").is_file() and len((folder / "pairs.jsonl").read_text().splitlines()) == 48
    learned = read_metrics(folder / "learned" / "metrics.jsonl")
    assert [r["canary/mean"] for r in learned if "canary/mean" in r] and any("eval/accuracy" in r for r in learned)
    both = read_metrics(folder / "both" / "metrics.jsonl")
    assert all(k in both[1] for k in ("reward/checker/mean", "reward/learned/mean"))
    assert "claims, which compare arms, were not judged" in page.read_text()
