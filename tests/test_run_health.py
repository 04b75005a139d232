"""A run that cannot learn says so; bad input is one line; samples show what the model writes."""

import json
import subprocess
import sys

import pytest

from _train_helpers import LEARNING_SIGNAL
from assay.config import load_config
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.training.health import RunCannotLearn
from assay.training.rl import Trainer


def cfg(model_dir, out, name, *extra):
    return load_config(None, [f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=6", "train.eval_n=8",
                              "train.eval_every=0", "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=3",
                              "rollout.group_size=4", "train.threads=1", *extra])


def test_a_run_whose_rewards_are_all_unscorable_stops_with_one_line(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"  # references no verifier can parse: every reward is None
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": "\\frac{"}) + "\n" for i in range(40)))
    c = cfg(tiny_model_dir, tmp_path, "none", "data.task=null", f"data.path={data}", "reward=math")
    with pytest.raises(RunCannotLearn) as e:
        Trainer(c).fit(progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "no reward could be scored for 3 steps in a row" in msg and "12 of 12 completions" in msg and "example: prompt" in msg
    rows = [r for r in read_metrics(tmp_path / "none" / "metrics.jsonl") if "reward/none" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/none"] == 12 and r["reward/mean"] is None for r in rows)  # never averaged as 0
    assert (tmp_path / "none" / "checkpoints" / "step_000003").is_dir() and "no reward could be scored" in (tmp_path / "none" / "report.html").read_text()
    # through the command: exit 2, one line
    p = subprocess.run([sys.executable, "-m", "assay.cli", "train", *[f"{k}" for k in (
        f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=cli", "data.task=null", f"data.path={data}", "reward=math",
        "reward_workers=0", "train.eval_n=4", "rollout.prompts_per_step=2", "rollout.group_size=2")], "--no-progress"],
        capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("assay: error: no reward could be scored"), p.stderr


def test_a_task_the_model_cannot_solve_warns_and_keeps_samples(tmp_path):
    """The bundled model has pass@8 = 0 on countdown: every group fails, so there is nothing to learn."""
    c = load_config(None, [f"output_dir={tmp_path}", "run_name=cd", "data.task=countdown", "train.steps=4", "train.zero_var_steps=2",
                           "train.samples_every=2", "train.eval_n=8", "train.eval_every=0", "reward_workers=0", "rollout.prompts_per_step=4",
                           "rollout.max_new_tokens=12", "train.threads=1"])
    d = Trainer(c).fit(progress=False).run_dir
    rows = read_metrics(d / "metrics.jsonl")
    warned = [r for r in rows if "warning" in r]
    assert [r["step"] for r in warned] == [2, 4]
    assert "100% of groups had all-equal rewards" in warned[0]["warning"] and "assay eval --k 8" in warned[0]["warning"]
    assert all(r["reward/unsolved_group_frac"] == 1.0 for r in rows if "reward/mean" in r)
    samples = read_metrics(d / "samples.jsonl")
    assert sorted({s["step"] for s in samples}) == [1, 2, 4] and all(len(s["completions"]) == 4 for s in samples)
    first = samples[0]["completions"][0]
    assert {"text", "reward", "reason"} <= first.keys() and first["reward"] == 0.0
    html = (d / "report.html").read_text()
    assert "Warnings" in html and "Sample completions" in html and __import__("html").escape(repr(samples[-1]["prompt"])) in html  # the last dumps


def test_a_run_with_signal_does_not_warn(tiny_model_dir, tmp_path):
    d = Trainer(cfg(tiny_model_dir, tmp_path, "ok", LEARNING_SIGNAL, "train.zero_var_steps=1", "train.zero_var_warn=0.99")).fit(progress=False).run_dir
    assert not any("warning" in r for r in read_metrics(d / "metrics.jsonl"))
    assert "Warnings" not in (d / "report.html").read_text()


def test_completions_cut_off_by_the_length_limit_warn_once_on_a_data_file(tmp_path):
    """The default rollout.max_new_tokens (6) fits the bundled task, not a user's data: when most of a step's completions
    stop at the limit, the run says so once (bar, metrics row, report); when they end with EOS it says nothing."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a + 3}=", "answer": str(2 * a + 3)}) + "\n" for a in range(10, 60)))
    base = [f"output_dir={tmp_path}", f"data.path={data}", "reward=arithmetic", "train.steps=3", "train.eval_n=4", "train.eval_every=0",
            "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=3", "rollout.group_size=2", "train.threads=1"]
    cut = Trainer(load_config(None, [*base, "run_name=cut", "rollout.max_new_tokens=2"])).fit(progress=False).run_dir
    warned = [r for r in read_metrics(cut / "metrics.jsonl") if "warning" in r]
    assert [r["step"] for r in warned] == [1] and "completions stopped at rollout.max_new_tokens=2 before EOS" in warned[0]["warning"]
    assert "rollout.max_new_tokens=2 before EOS" in (cut / "report.html").read_text()
    fits = Trainer(load_config(None, [*base, "run_name=fits"])).fit(progress=False).run_dir
    assert not any("warning" in r for r in read_metrics(fits / "metrics.jsonl"))


def test_the_report_is_one_self_contained_page(tiny_model_dir, tmp_path):
    """report.html carries its plots inside it: moved or mailed alone, it still shows them."""
    import base64
    import re
    import shutil

    d = Trainer(cfg(tiny_model_dir, tmp_path, "page", LEARNING_SIGNAL, "train.steps=2")).fit(progress=False).run_dir
    alone = tmp_path / "elsewhere"
    alone.mkdir()
    shutil.copy(d / "report.html", alone)
    srcs = re.findall(r'<img src="([^"]+)"', (alone / "report.html").read_text())
    assert len(srcs) == 2 and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert {base64.b64decode(s.split(",", 1)[1]) for s in srcs} == {(d / n).read_bytes() for n in ("reward.png", "heldout_accuracy.png")}


def test_over_long_prompts_error_drop_or_truncate(tiny_model_dir, tmp_path, caplog):
    data = tmp_path / "long.jsonl"  # the tiny model takes 256 positions
    rows = [{"prompt": "1+" * 1500 + "1=", "answer": "1501"}] + [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(30)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["data.task=null", f"data.path={data}", "reward=arithmetic", "data.eval_fraction=0.0", "train.steps=1"]
    with pytest.raises(AssayError, match=r"training data id '0': the prompt is 3002 tokens; the model takes 256 positions.*at most 250"):
        Trainer(cfg(tiny_model_dir, tmp_path, "err", *base, "rollout.max_new_tokens=6"))
    t = Trainer(cfg(tiny_model_dir, tmp_path, "drop", *base, "data.overlong=drop"))
    assert len(t.source._rows) == 30 and "1 prompts longer than 250 tokens were dropped" in caplog.text
    t = Trainer(cfg(tiny_model_dir, tmp_path, "cut", *base, "data.overlong=truncate"))
    long = next(s for s in t.source._rows if s.id == "0")
    assert len(long.prompt) == 250 and long.prompt.endswith("+1+1=") and "1501" == long.answer
    t.fit(progress=False)  # and it trains


def test_an_unwritable_output_dir_is_one_line(tiny_model_dir, tmp_path):
    import shutil

    blocker = tmp_path / "file"
    blocker.write_text("x")
    ro = tmp_path / "ro"
    ro.mkdir()
    train = [sys.executable, "-m", "assay.cli", "train", f"model.path={tiny_model_dir}", "run_name=r", "train.steps=1"]
    runs = [(train + [f"output_dir={blocker}"], "is a file, not a folder")]
    if shutil.which("bwrap"):  # a real read-only mount (mode bits do not stop root)
        runs.append((["bwrap", "--dev-bind", "/", "/", "--ro-bind", str(ro), str(ro), *train, f"output_dir={ro}"], "is not writable"))
    for cmd, needle in runs:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def test_a_config_mistake_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    """A bad task, data file or output folder is refused before the policy loads (the error in seconds, nothing made)."""
    import assay.training.rl as rl

    monkeypatch.setattr(rl, "load_policy", lambda *a, **k: pytest.fail("the policy loaded before the config was checked"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "metrics.jsonl").write_text("")
    cases = [(["data.task=sudoku"], "unknown task 'sudoku'"),
             (["data.task=null", f"data.path={data}", "reward=arithmetic"], "d.jsonl:2: malformed JSON line"),
             ([f"output_dir={blocker}"], "is a file, not a folder"),
             (["run_name=stopped"], "holds a run that stopped before its first checkpoint")]
    for extra, needle in cases:
        with pytest.raises(AssayError, match=needle):
            Trainer(cfg("nowhere", tmp_path, "r", *extra))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "file", "stopped"]


def test_options_anywhere_a_readable_model_and_a_summary_over_many_steps(tiny_model_dir, tmp_path):
    """`assay train cfg.yaml --no-progress k=v` works; weights are readable by others; the summary's reward is not one batch."""
    import os
    import stat

    conf = tmp_path / "c.yaml"
    conf.write_text(f"model: {{path: {tiny_model_dir}}}\nreward_workers: 0\nrollout: {{prompts_per_step: 2, group_size: 2}}\n"
                    "train: {eval_n: 4, threads: 1}\nreward: {name: random}\n")
    old = os.umask(0o022)
    try:
        p = subprocess.run([sys.executable, "-m", "assay.cli", "train", str(conf), "--no-progress", "train.steps=12", f"output_dir={tmp_path}",
                            "run_name=o"], capture_output=True, text=True, timeout=300)
    finally:
        os.umask(old)
    assert p.returncode == 0, p.stderr
    run = tmp_path / "o"
    for f in ("final/model.safetensors", "checkpoints/step_000012/model.safetensors", "final/config.json"):
        assert stat.S_IMODE((run / f).stat().st_mode) == 0o644, f
    rows = [r for r in read_metrics(run / "metrics.jsonl") if r.get("reward/mean") is not None]
    assert len(rows) == 12
    assert f"train reward (mean of the last 1 steps): {rows[-1]['reward/mean']}" in p.stderr  # 12 steps: the last tenth is 1 step


def test_the_summary_reward_averages_the_last_tenth_of_the_steps():
    from assay.report.figures import recent_reward as _recent_reward

    rows = [{"step": i, "reward/mean": float(i)} for i in range(1, 101)] + [{"step": 100, "eval/accuracy": 0.5}]
    assert _recent_reward(rows) == {"train reward (mean of the last 10 steps)": sum(range(91, 101)) / 10}
    assert _recent_reward([{"step": 1, "reward/mean": None}]) == {"train reward (mean of the last 1 steps)": None}
