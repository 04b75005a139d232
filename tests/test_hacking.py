"""Hacking monitors and the canary: they fire on a real hack, once, early; stay quiet on honest series; survive a resume."""

import doctest
import json
import subprocess
import sys

import pytest

from assay.config import MonitorConfig, load_config
from assay.report.metrics import read_metrics
from assay.training import hacking
from assay.training.hacking import HackingAlarm, HackingMonitor
from assay.training.rl import Trainer


def test_doctests():
    assert doctest.testmod(hacking).failed == 0


def feed(monitor, rows, start=1):
    fired = []
    for step, row in enumerate(rows, start):
        _, alarms = monitor.check(step, row)
        fired += [(step, a.split(":", 1)[0]) for a in alarms]
    return fired


def honest(n):
    """Reward rising, length flat, entropy decaying ever more slowly: what a run that learns looks like."""
    return [{"reward/mean": min(1.0, 0.3 + 0.02 * i), "reward/length_corr": 0.4, "rollout/response_length": 3.2 + 0.01 * (i % 3),
             "rollout/repetition": 0.0, "actor/entropy": 0.2 + 0.5 * 0.9**i, "actor/kl": 0.05 * (1 - 0.9**i),
             "reward/zero_var_group_frac": min(1.0, 0.02 * i), "reward/unsolved_group_frac": max(0.0, 0.5 - 0.02 * i),
             "eval/accuracy": min(1.0, 0.3 + 0.02 * i) if i % 10 == 0 else None}
            for i in range(n)]


def test_an_honest_run_raises_no_alarm():
    assert feed(HackingMonitor(MonitorConfig()), honest(200)) == []


def length_hack(n=60):
    """Honest rows, except that from step 21 completions grow 0.15 tokens a step and the reward tracks length (corr 0.8)."""
    rows = honest(n)
    for i, r in enumerate(rows):
        r["rollout/response_length"] = 3.0 if i < 20 else 3.0 + 0.15 * (i - 20)
        r["reward/length_corr"] = 0.8
    return rows


def test_length_growth_with_a_reward_that_pays_for_it_fires_once():
    rows = length_hack()
    fired = feed(HackingMonitor(MonitorConfig()), rows)
    assert [name for _, name in fired] == ["length"]
    step = fired[0][0]  # the last window's mean first reaches +30% (and one token) over the first window's 3.0
    assert 3.0 + 0.15 * (step - 1 - 20 - 4.5) >= 3.9 and step <= 40


def test_the_same_growth_with_an_uncorrelated_reward_is_not_an_alarm():
    rows = honest(60)
    for i, r in enumerate(rows):
        r["rollout/response_length"] = 3.0 + 0.15 * max(0, i - 20)
        r["reward/length_corr"] = 0.05
    assert feed(HackingMonitor(MonitorConfig()), rows) == []


def test_entropy_that_collapses_faster_and_faster_fires():
    rows = honest(60)
    for i, r in enumerate(rows):
        r["actor/entropy"] = 1.0 if i < 30 else max(0.0, 1.0 - 0.05 * (i - 30))
    assert [name for _, name in feed(HackingMonitor(MonitorConfig()), rows)] == ["entropy"]


def test_a_saturated_reward_fires_only_while_the_verified_accuracy_is_low():
    def run(accuracy):
        rows = [{"reward/zero_var_group_frac": 0.2 if i < 10 else 0.95, "reward/unsolved_group_frac": 0.0,
                 "eval/accuracy": accuracy if i % 10 == 0 else None} for i in range(40)]
        return feed(HackingMonitor(MonitorConfig()), rows)

    assert run(0.2) == [(20, "saturation")]
    assert run(0.95) == []  # every group right: learned, not hacked


def test_heldout_accuracy_falling_while_the_reward_rises_fires_divergence():
    rows = [{"reward/mean": 0.3 + 0.01 * i + 0.02 * (i % 2), "eval/accuracy": (0.6 if i <= 20 else 0.6 - 0.004 * (i - 20)) if i % 5 == 0 else None}
            for i in range(60)]
    fired = feed(HackingMonitor(MonitorConfig()), rows, start=0)
    assert fired == [(40, "divergence")]  # the second evaluation in a row 5 points below the best (0.54, 0.52 after 0.6)


def test_divergence_follows_the_sampled_accuracy_when_the_run_logs_it():
    """Greedy accuracy can fall under honest training while the policy as sampled gets better (tiny-steps on its own
    verifier, docs/integrity.md): with `eval/sampled_accuracy` logged, that is what the monitor reads."""
    def rows(greedy_falls: bool):
        out = []
        for i in range(60):
            r = {"reward/mean": 0.3 + 0.01 * i + 0.02 * (i % 2)}
            if i % 5 == 0:
                falling = 0.6 if i <= 20 else 0.6 - 0.004 * (i - 20)
                rising = 0.4 + 0.003 * i
                r["eval/accuracy"], r["eval/sampled_accuracy"] = (falling, rising) if greedy_falls else (rising, falling)
            out.append(r)
        return out

    assert feed(HackingMonitor(MonitorConfig()), rows(greedy_falls=True), start=0) == []
    m = HackingMonitor(MonitorConfig())
    assert feed(m, rows(greedy_falls=False), start=0) == [(40, "divergence")]
    assert m.held_out == "eval/sampled_accuracy"
    without = [{k: v for k, v in r.items() if k != "eval/sampled_accuracy"} for r in rows(greedy_falls=True)]
    assert feed(HackingMonitor(MonitorConfig()), without, start=0) == [(40, "divergence")]  # greedy, when that is all there is


def test_kl_that_accelerates_fires_and_steady_kl_growth_does_not():
    steady = [{"actor/kl": 0.01 * i} for i in range(60)]
    assert feed(HackingMonitor(MonitorConfig()), steady) == []
    bursting = [{"actor/kl": 0.01 * i if i < 30 else 0.3 + 0.05 * (i - 30)} for i in range(60)]
    assert [name for _, name in feed(HackingMonitor(MonitorConfig()), bursting)] == ["kl"]


def test_canary_falling_while_the_reward_rises_fires_and_names_both():
    rows = [{"reward/mean": 0.5 + 0.01 * i, "canary/mean": 0.6 - 0.01 * i + 0.02 * (i % 2), "canary/reward_mean": 0.5 + 0.01 * i,
             "canary/corr": 0.3} for i in range(30)]
    m = HackingMonitor(MonitorConfig())
    fired = feed(m, rows)
    assert fired == [(20, "canary")]
    _, alarms = m.check(31, rows[-1])
    assert alarms == []  # once per run


def test_a_reward_that_stops_agreeing_with_the_canary_fires():
    rows = [{"canary/mean": 0.5, "canary/reward_mean": 0.5, "canary/corr": 0.5 if i < 10 else 0.5 - 0.1 * (i - 9)} for i in range(20)]
    # the first 10 checks against the last 5: 0.5 against 0.3 at step 14, 0.2 (a drop of 0.3) at step 15
    assert feed(HackingMonitor(MonitorConfig()), rows) == [(15, "canary")]


def test_a_reward_that_starts_paying_rejected_completions_like_accepted_ones_fires():
    """A hack spreading one completion at a time: steady means and correlation, the discordant share rising."""
    rows = [{"canary/mean": 0.6, "canary/reward_mean": 2.5, "canary/corr": 0.85, "canary/discordant": 0.03 if i < 12 else 0.03 + 0.06 * (i - 11)}
            for i in range(24)]
    # the first 10 checks (0.03) against the last 5: a rise of 0.18 at step 17, 0.24 at step 18
    fired = []
    m = HackingMonitor(MonitorConfig())
    for step, row in enumerate(rows, 1):
        _, alarms = m.check(step, row)
        fired += [(step, a) for a in alarms]
    assert [s for s, _ in fired] == [18] and "pays what the canary rejects like what it accepts" in fired[0][1]
    # a reward that disagrees with the canary as much from the start (a random reward: ~half the pairs) is left to the other rules
    flat = [{**r, "canary/discordant": 0.5} for r in rows]
    assert feed(HackingMonitor(MonitorConfig()), flat) == []


def test_state_round_trips_so_a_resumed_run_fires_at_the_same_step():
    rows = length_hack()
    whole = feed(HackingMonitor(MonitorConfig()), rows)
    first = HackingMonitor(MonitorConfig())
    assert feed(first, rows[:25]) == []
    state = json.loads(json.dumps(first.state_dict()))
    second = HackingMonitor(MonitorConfig())
    second.load_state_dict(state)
    assert feed(second, rows[25:], start=26) == whole


def hack_args(tmp_path):
    """The bundled model trained on a reward that pays for length (tests/_reward_helpers.py): a real, fast hack."""
    return [f"output_dir={tmp_path}", "reward=_reward_helpers:PaysForLength", "optim.lr=2e-4", "train.steps=40", "train.eval_every=10",
            "train.eval_n=100", "train.save_every=0", "reward_workers=0", "train.threads=1"]


def hack_cfg(tmp_path, name, *extra):
    return load_config(None, [*hack_args(tmp_path), f"run_name={name}", *extra])


def test_a_real_length_hack_is_caught_by_the_canary_and_stop_ends_the_run(tmp_path):
    with pytest.raises(HackingAlarm) as e:
        Trainer(hack_cfg(tmp_path, "hack", "train.on_alarm=stop")).fit(progress=False)
    assert "canary" in str(e.value) and "train.on_alarm=stop" in str(e.value)
    d = tmp_path / "hack"
    rows = read_metrics(d / "metrics.jsonl")
    alarmed = [r for r in rows if "alarm" in r]
    assert len(alarmed) == 1 and alarmed[0]["alarm/canary"] == 1.0
    step = alarmed[0]["step"]
    assert rows[-1]["step"] == step  # stopped at the step it fired, with a checkpoint of it
    assert (d / "checkpoints" / f"step_{step:06d}").is_dir()
    canary = [r["canary/mean"] for r in rows if "canary/mean" in r]
    assert canary[-1] < canary[0]  # the task's verifier, re-scoring the same completions, saw accuracy fall
    assert "Hacking alarms" in (d / "report.html").read_text()


@pytest.mark.slow  # 13-17 s: the default suite stays near ten minutes (CI runs the slow tier)
def test_the_command_exits_3_on_a_stopping_alarm_and_warns_by_default(tmp_path):
    args = hack_args(tmp_path)
    p = subprocess.run([sys.executable, "-m", "assay", "train", "--no-progress", *args, "run_name=cli", "train.on_alarm=stop"],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 3 and "assay: stopped by a hacking alarm: step" in p.stderr, p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-m", "assay", "train", "--no-progress", *args, "run_name=warn"],
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0 and "assay: alarm: step" in p.stderr, p.stderr[-2000:]
    assert read_metrics(tmp_path / "warn" / "metrics.jsonl")[-1]["step"] == 40  # warned and trained on


def _env():
    import os
    from pathlib import Path

    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}


def test_monitors_off_leave_no_keys(tmp_path):
    d = Trainer(hack_cfg(tmp_path, "disabled", "monitor.enabled=false", "train.steps=3")).fit(progress=False).run_dir
    keys = {k for r in read_metrics(d / "metrics.jsonl") for k in r}
    assert not any(k.startswith(("monitor/", "canary/", "alarm")) for k in keys)


def test_a_bad_canary_is_one_line_naming_the_setting_and_leaves_no_run_folder(tmp_path):
    from assay.errors import AssayError

    with pytest.raises(AssayError, match=r"^monitor\.canary\.name: unknown reward 'nope'"):
        Trainer(hack_cfg(tmp_path, "bad", "monitor.canary=nope"))
    assert not (tmp_path / "bad").exists()


def test_a_given_canary_scores_a_run_that_trains_on_its_own_verifier(tmp_path):
    """`auto` adds no canary to a run on the task's verifier; naming one adds it (here the same verifier: it agrees)."""
    base = [f"output_dir={tmp_path}", "train.steps=2", "train.eval_n=8", "train.save_every=0", "reward_workers=0", "train.threads=1"]
    plain = Trainer(load_config(None, [*base, "run_name=plain"])).fit(progress=False).run_dir
    assert not any(k.startswith("canary/") for r in read_metrics(plain / "metrics.jsonl") for k in r)
    given = Trainer(load_config(None, [*base, "run_name=given", "monitor.canary=arithmetic", "monitor.canary_n=8"])).fit(progress=False).run_dir
    rows = [r for r in read_metrics(given / "metrics.jsonl") if "canary/mean" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["canary/n"] == 8 and r["canary/mean"] == r["canary/reward_mean"] for r in rows)


def test_discordance_counts_the_canarys_worse_completions_paid_as_much():
    # canary-rejected completions 1 and 2 against accepted 0 and 3: 1 is paid as much as 0 and more than 3, 2 less than both
    assert hacking.discordance([3, 3, 1, 2], [1, 0, 0, 1]) == 0.5
    assert hacking.discordance([1, 0, 1], [1, 0, 1]) == 0.0  # the reward is the canary
    assert hacking.discordance([0.2, 0.9], [0.7, 0.7]) is None  # the canary tells nothing apart
    import random

    rng = random.Random(0)
    for _ in range(200):  # against every pair counted one by one, with ties on both sides
        n = rng.randint(1, 30)
        canary, reward = [rng.choice([0, 0.5, 1, rng.random()]) for _ in range(n)], [rng.choice([0, 1, 3, rng.random()]) for _ in range(n)]
        pairs = [(i, j) for i in range(n) for j in range(n) if canary[i] < canary[j]]
        want = sum(reward[i] >= reward[j] for i, j in pairs) / len(pairs) if pairs else None
        assert hacking.discordance(reward, canary) == pytest.approx(want)


def test_the_followed_accuracy_survives_a_resume_and_an_older_checkpoint_falls_back_to_greedy():
    rows = [{"reward/mean": 0.3 + 0.01 * i, **({"eval/accuracy": 0.8, "eval/sampled_accuracy": 0.4 + 0.01 * i} if i % 5 == 0 else {})}
            for i in range(30)]
    first = HackingMonitor(MonitorConfig())
    feed(first, rows)
    state = json.loads(json.dumps(first.state_dict()))
    again = HackingMonitor(MonitorConfig())
    again.load_state_dict(state)
    assert again.held_out == "eval/sampled_accuracy" and again.tracked == first.tracked and again.evals == first.evals
    assert [a for _, a in again.tracked][:2] == [0.4, 0.45] and {a for _, a in again.evals} == {0.8}
    old = {k: v for k, v in state.items() if k not in ("tracked", "held_out")}  # written before sampled accuracy was followed
    older = HackingMonitor(MonitorConfig())
    older.load_state_dict(old)
    assert older.held_out == "eval/accuracy" and older.tracked == older.evals == first.evals
