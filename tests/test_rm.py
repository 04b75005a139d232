"""Reward models: the objective by hand, a real tiny training run, save/reload, exact resume, errors, the CLI, the `rm` reward."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.rm.config import load_rm_config
from assay.rm.data import batch_indices, read_comparisons
from assay.rm.eval import comparison_metrics
from assay.rm.losses import bt_loss, centering_loss, length_corr, rm_loss
from assay.rm.model import Encoder, build_rm, load_rm, save_rm, score_texts
from assay.rm.train import train_rm

# "yes" is always right, "no" always wrong: separable from the last tokens alone
SEPARABLE = [{"prompt": f"{a}+{b}=", "chosen": "yes", "rejected": "no", "subset": "s"} for a in range(12) for b in range(4)]


def assay(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(p, needle):
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("assay: error:") and needle in lines[0], p.stderr


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_keys_documented(run_dir):
    """Every key the run logged has its definition in docs/metrics.md (`eval/pair_accuracy/<subset>` is a family)."""
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "metrics.md").read_text()
    keys = re.findall(r"`([a-z0-9_<>]+(?:/[a-z0-9_@<>]+)+)`", text)
    documented = [re.compile(re.sub(r"<[a-z_]+>", "[^/]+", k) + "$") for k in keys]
    logged = {k for r in read_metrics(run_dir / "metrics.jsonl") for k in r if k != "step"}
    assert not sorted(k for k in logged if not any(d.match(k) for d in documented))


def rm_args(tmp_path, model_dir, data, name, *extra):
    return [f"model={model_dir}", f"data.path={data}", f"output_dir={tmp_path}", f"run_name={name}", "train.threads=1",
            "train.batch_size=8", "optim.lr=2e-3", "optim.warmup_steps=2", "data.eval_fraction=0.25", *extra]


# ---------------------------------------------------------------- the objective, by hand


def test_bt_loss_and_margin_by_hand():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    got = bt_loss(c, r)
    assert got.tolist() == pytest.approx([math.log(1 + math.exp(-1.0)), math.log(1 + math.exp(1.0))], abs=1e-6)
    got = bt_loss(c, r, margin=0.5)  # −log σ(d − m): d = 1, −1
    assert got.tolist() == pytest.approx([math.log(1 + math.exp(-0.5)), math.log(1 + math.exp(1.5))], abs=1e-6)


def test_centering_and_length_terms_by_hand():
    c, r = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    assert centering_loss(c, r).tolist() == [9.0, 1.0]
    # rewards [2, 0, 1, 1] vs lengths [1, 3, 2, 2]: deviations [1, −1, 0, 0] and [−1, 1, 0, 0], so corr = −2 / 2 = −1
    assert length_corr(torch.tensor([2.0, 0.0, 1.0, 1.0]), torch.tensor([1, 3, 2, 2])).item() == pytest.approx(-1.0)
    assert length_corr(torch.tensor([2.0, 0.0]), torch.tensor([3, 3])).item() == 0.0  # constant lengths
    loss, m = rm_loss(c, r, torch.tensor([1, 3]), torch.tensor([2, 2]), margin=0.5, center_coef=0.1, length_coef=0.2)
    bt = (math.log(1 + math.exp(-0.5)) + math.log(1 + math.exp(1.5))) / 2
    assert loss.item() == pytest.approx(bt + 0.1 * 5.0 + 0.2 * 1.0, abs=1e-6)
    assert m["rm/bt_loss"] == pytest.approx(bt, abs=1e-6) and m["rm/accuracy"] == 0.5 and m["rm/margin"] == 0.0
    assert m["rm/center_loss"] == 5.0 and m["rm/length_corr"] == pytest.approx(-1.0)


def test_length_term_pushes_against_correlation():
    """A small step down the gradient of corr² makes rewards less correlated with length."""
    lengths = torch.tensor([1, 2, 3, 4])
    rewards = torch.tensor([1.0, 2.0, 3.0, 2.5], requires_grad=True)
    before = length_corr(rewards, lengths) ** 2
    before.backward()
    after = length_corr((rewards - 0.1 * rewards.grad).detach(), lengths) ** 2
    assert 0.5 < before.item() and after.item() < before.item() - 0.01


def test_best_of_n_and_subsets_by_hand():
    from assay.rm.data import Comparison

    comps = [Comparison("a", "p", ["c"], ["r1", "r2", "r3"], "x"), Comparison("b", "p", ["c"], ["r1", "r2", "r3"], "x"),
             Comparison("c", "p", ["c"], ["r"], "y")]
    scores = [([1.0], [0.0, 0.5, 0.9]), ([1.0], [0.0, 2.0, 0.9]), ([0.0], [1.0])]
    m = comparison_metrics(comps, scores, prefix="")
    assert m["pairs"] == 7 and m["pair_accuracy"] == pytest.approx(5 / 7)
    assert m["best_of_n_accuracy"] == 0.5 and m["best_of_n_rows"] == 2
    assert m["pair_accuracy/x"] == pytest.approx(5 / 6) and m["pair_accuracy/y"] == 0.0


def test_calibration_by_hand():
    """Gaps 0 and ±ln 3 (σ = 0.75) and ln 19 (σ = 0.95): bins by σ(|gap|), accuracy per bin, ECE weighted by pairs."""
    import math

    from assay.rm.data import Comparison

    comps = [Comparison(str(i), "p", ["c"], ["r"], "") for i in range(4)]
    scores = [([math.log(3)], [0.0]), ([0.0], [math.log(3)]), ([math.log(19)], [0.0]), ([1.0], [1.0])]
    m = comparison_metrics(comps, scores, prefix="", bins=True)
    assert [b["pairs"] for b in m["calibration"]] == [1, 2, 1]
    (tie, three, nineteen) = m["calibration"]
    assert tie == {"confidence": 0.5, "accuracy": 0.0, "pairs": 1}  # a tie counts as wrong
    assert three == {"confidence": 0.75, "accuracy": 0.5, "pairs": 2} and nineteen == {"confidence": 0.95, "accuracy": 1.0, "pairs": 1}
    assert m["calibration_ece"] == pytest.approx((0.5 + 2 * 0.25 + 0.05) / 4)
    assert "calibration" not in comparison_metrics(comps, scores)  # a training run's metrics keep numbers only


def test_verifier_disagreement_by_hand():
    from assay.rewards.monitors import reward_health
    from assay.types import RewardResult

    def r(score, verifier):
        return RewardResult(score, components={"verifier": verifier})

    # group 0: (2, right) vs (1, wrong) agree, (2, right) vs (3, wrong) disagree, (1, wrong) vs (3, wrong) not counted;
    # group 1: (0.5, right) vs (0.5, wrong) tie: disagree; the unscored item is left out
    results = [r(2.0, 1.0), r(1.0, 0.0), r(3.0, 0.0), r(0.5, 1.0), r(0.5, 0.0), RewardResult(None)]
    m = reward_health(results, [0, 0, 0, 1, 1, 1], [1] * 6)
    assert m["reward/verifier_disagreement"] == pytest.approx(2 / 3) and m["reward/verifier/mean"] == 0.4
    assert "reward/verifier_disagreement" not in reward_health([RewardResult(1.0)], [0], [1])


def test_batches_are_a_function_of_seed_and_step():
    a = [batch_indices(10, 4, 0, s) for s in range(5)]
    assert a == [batch_indices(10, 4, 0, s) for s in range(5)]
    assert sorted(sum(a[:2], []) + a[2][:2]) == list(range(10))  # the first epoch covers every pair once
    assert a != [batch_indices(10, 4, 1, s) for s in range(5)]


# ---------------------------------------------------------------- data and errors


def test_rewardbench_rows_and_field_mapping(tmp_path):
    rb2 = write_jsonl(tmp_path / "rb2.jsonl", [{"id": "7", "prompt": "q", "chosen": ["good"], "rejected": ["b1", "b2", "b3"], "subset": "Math"}])
    (c,) = read_comparisons(str(rb2))
    assert (c.id, c.chosen, c.rejected, c.subset, len(c.pairs())) == ("7", ["good"], ["b1", "b2", "b3"], "Math", 3)
    mapped = write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "good": "a", "bad": "b"}])
    (c,) = read_comparisons(str(mapped), {"prompt": "question", "chosen": "good", "rejected": "bad"})
    assert (c.prompt, c.chosen, c.rejected) == ("q", ["a"], ["b"])
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"prompt": "q", "chosen": ["a", "b"], "rejected": ["c"]}]), tmp_path / "p.parquet")
    (c,) = read_comparisons(str(tmp_path / "p.parquet"))
    assert c.pairs() == [("a", "c"), ("b", "c")]


@pytest.mark.parametrize("rows,needle", [
    ([{"prompt": "q", "chosen": "a"}], "row 1 has no rejected column 'rejected'"),
    ([], "no rows"),
    ([{"prompt": "q", "chosen": "a", "rejected": []}], "column 'rejected' must be a string or a non-empty list"),
])
def test_bad_pair_files_are_one_line(tmp_path, rows, needle):
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(AssayError, match=needle):
        read_comparisons(str(data))
    one_line_error(assay("rm", "train", f"data.path={data}", f"output_dir={tmp_path}"), needle)


def test_config_errors_are_one_line(tmp_path):
    one_line_error(assay("rm", "train", f"output_dir={tmp_path}"), "data.path")
    one_line_error(assay("rm", "train", "data.path=x.jsonl", "loss.nope=1"), "unknown rm config key 'loss.nope'")
    one_line_error(assay("rm", "eval", "--path", str(tmp_path), "--data", "x.jsonl"), "x.jsonl")


# ---------------------------------------------------------------- the model


def test_save_reload_gives_the_same_scores(tmp_path, tiny_model_dir):
    from transformers import AutoModelForSequenceClassification

    model, tok = build_rm(str(tiny_model_dir), seed=3)
    items = [("1+2=", "3"), ("10+20=", "30 and more"), ("7+7=", "")]
    before = score_texts(model, Encoder(tok, 64), items)
    save_rm(tmp_path / "rm", model, tok, {"max_length": 64})
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["num_labels"] == 1
    assert "score.weight" in load_file(tmp_path / "rm" / "model.safetensors")
    again, tok2, meta = load_rm(tmp_path / "rm")
    assert score_texts(again, Encoder(tok2, meta["max_length"]), items) == before
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")  # as any other tool loads it
    ids = tok2("1+2=3", return_tensors="pt")["input_ids"]  # the saved tokenizer appends the EOS training appended
    assert ids[0, -1].item() == tok2.eos_token_id and plain(input_ids=ids).logits[0, 0].item() == pytest.approx(before[0], abs=1e-5)
    # the same head for the same seed, another for another
    assert torch.equal(build_rm(str(tiny_model_dir), seed=3)[0].score.weight, model.score.weight)
    assert not torch.equal(build_rm(str(tiny_model_dir), seed=4)[0].score.weight, model.score.weight)


# ---------------------------------------------------------------- training


def test_tiny_run_learns_separable_pairs_and_scores_as_a_reward(tmp_path, tiny_model_dir):
    from assay.rewards.spec import build_reward
    from assay.types import Sample, Trajectory

    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    cfg = load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "sep", "train.steps=30", "train.eval_every=10"))
    result = train_rm(cfg)
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert rows[0]["step"] == 0 and rows[-1]["step"] == 30
    assert rows[-1]["eval/pair_accuracy"] == 1.0 and rows[-1]["eval/bt_loss"] < rows[0]["eval/bt_loss"] / 4
    for key in ("rm/loss", "rm/bt_loss", "rm/accuracy", "rm/margin", "rm/grad_norm", "rm/lr", "rm/length_corr", "eval/pair_accuracy/s"):
        assert key in rows[-1] or key in rows[0], key
    assert_keys_documented(result.run_dir)
    assert {"report.html", "rm_loss.png", "heldout_pair_accuracy.png"} <= {p.name for p in result.run_dir.iterdir()}
    reward = build_reward({"name": "rm", "args": {"path": str(result.run_dir)}})
    trajs = [Trajectory(Sample(str(i), "99+1=", None), text, [], [], [], True) for i, text in enumerate(["yes", "no", "yes"])]
    scores = [r.score for r in reward(trajs)]
    assert scores[0] > scores[1] and scores[0] == pytest.approx(scores[2], abs=1e-6)
    assert reward.score(trajs[1]).score == pytest.approx(scores[1], abs=1e-5)  # one at a time, as in a worker


def test_resume_is_exact(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    common = ["train.eval_every=3", "train.save_every=3", "loss.margin=0.2", "loss.center_coef=0.01", "loss.length_coef=0.1"]
    whole = train_rm(load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "whole", "train.steps=6", *common)))
    train_rm(load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "cut", "train.steps=3", *common)))
    # a run killed after step 4 left a row past its checkpoint: resume drops it and recomputes
    cut = tmp_path / "cut"
    with open(cut / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "rm/loss": 123.0}) + "\n")
    resumed = train_rm(resume=cut, overrides=["train.steps=6"])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("rm/step_seconds", "rm/elapsed_seconds")} for r in rows]  # noqa: E731
    assert strip(read_metrics(cut / "metrics.jsonl")) == strip(read_metrics(whole.run_dir / "metrics.jsonl"))
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(resumed.model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(AssayError, match="cannot change when a run is resumed"):
        train_rm(resume=cut, overrides=["optim.lr=1"])


def test_threads_follow_the_cores_other_processes_leave_free(tmp_path, tiny_model_dir, monkeypatch):
    """`train.threads=0` (the default) re-reads the load before every step, as `assay train` does: with one of two cores
    taken by someone else the steps run on one thread (fed synthetic /proc readings); `train.threads=N` keeps N."""
    from assay import threads
    from assay.threads import ThreadGovernor

    monkeypatch.setattr(threads, "cores", lambda: 2)
    clock = {"t": 0.0, "machine": 0.0, "tree": 0.0}

    def busy_elsewhere(self):  # each reading: one more second in which another process kept one core busy
        clock["t"] += 1.0
        clock["machine"] += 1.0
        return clock["t"], clock["machine"], clock["tree"]

    monkeypatch.setattr(ThreadGovernor, "_sample", busy_elsewhere)
    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    before = torch.get_num_threads()
    try:
        for fixed, want in (("0", [2, 1, 1, 1]), ("2", [2, 2, 2, 2])):
            args = [a for a in rm_args(tmp_path, tiny_model_dir, data, f"t{fixed}", "train.steps=4") if not a.startswith("train.threads")]
            result = train_rm(load_rm_config(None, [*args, f"train.threads={fixed}"]))
            assert [r["rm/threads"] for r in read_metrics(result.run_dir / "metrics.jsonl") if "rm/threads" in r] == want
    finally:
        torch.set_num_threads(before)


def test_time_limit_ends_the_run_cleanly(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    result = train_rm(load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "t", "train.steps=50", "train.time_limit=0.001")))
    last = read_metrics(result.run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 1 and last["rm/stopped_early"] == 1.0 and "eval/pair_accuracy" in last
    assert (result.run_dir / "checkpoints" / "step_000001").is_dir() and (result.model_dir / "model.safetensors").is_file()
    assert_keys_documented(result.run_dir)


def test_sigterm_saves_the_finished_step_and_resume_continues(tmp_path, tiny_model_dir):
    import signal
    import time

    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    args = rm_args(tmp_path, tiny_model_dir, data, "sig", "train.steps=100000", "train.save_every=0", "train.eval_every=0")
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "rm", "train", *args, "--no-progress"], stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "continue with: assay rm train --resume" in err.splitlines()[-1]
    rows = read_metrics(metrics)
    step = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(step + 1)) and (tmp_path / "sig" / "checkpoints" / f"step_{step:06d}").is_dir()
    resumed = train_rm(resume=tmp_path / "sig", overrides=[f"train.steps={step + 2}"])
    assert [r["step"] for r in read_metrics(metrics)] == list(range(step + 3)) and resumed.final["rm/loss"] > 0


# ---------------------------------------------------------------- pairs from the bundled task


def test_longer_pairs_are_longer_yet_plausible_sums():
    from collections import Counter

    from assay.rm.pairs import DEFAULT_MIX, answer_range, build_pairs
    from assay.data.tasks import make_task

    lo, hi = answer_range(make_task("arithmetic"), "train", 0)
    assert lo <= 5 and 190 <= hi <= 198  # a+b with a, b in 0..99, over 2000 drawn problems
    rows = build_pairs(n=400, seed=1)
    longer = [r for r in rows if r["subset"] == "longer"]
    for r in longer:  # more digits than the answer, yet a sum two numbers up to 99 can have: size gives nothing away
        assert len(r["rejected"]) > len(r["chosen"]) and 0 <= int(r["rejected"]) <= 198 and int(r["chosen"]) <= 99, r
    # a 3-digit answer has no plausible longer wrong answer: the drawn kind waits, so the mix holds (0.25 of 400, ± 3 sd)
    assert abs(len(longer) - 100) <= 3 * (400 * 0.25 * 0.75) ** 0.5
    assert set(Counter(r["subset"] for r in rows)) == set(DEFAULT_MIX)
    import doctest

    import assay.rm.pairs

    assert doctest.testmod(assay.rm.pairs).failed == 0


# ---------------------------------------------------------------- the CLI, end to end


@pytest.mark.slow  # about 30 s: four commands end to end
def test_cli_pairs_train_eval_and_rl_with_the_rm(tmp_path, tiny_model_dir):
    from assay.data.tasks import in_heldout

    train_file, held_file = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    p = assay("rm", "pairs", "--out", str(train_file), "--n", "200", "--seed", "5")
    assert p.returncode == 0, p.stderr
    assert assay("rm", "pairs", "--out", str(tmp_path / "again.jsonl"), "--n", "200", "--seed", "5").returncode == 0
    assert (tmp_path / "again.jsonl").read_bytes() == train_file.read_bytes()  # deterministic with a seed
    assert assay("rm", "pairs", "--out", str(held_file), "--n", "60", "--split", "heldout").returncode == 0
    rows = [json.loads(line) for line in train_file.read_text().splitlines()]
    held = [json.loads(line) for line in held_file.read_text().splitlines()]
    assert {r["subset"] for r in rows} == {"near_miss", "carry", "random", "longer", "shorter"}
    for r in rows:
        assert int(r["chosen"]) == eval(r["prompt"][:-1]) != int(r["rejected"])  # the prompts are a+b=
        assert r["subset"] != "longer" or len(r["rejected"]) > len(r["chosen"]) and 0 <= int(r["rejected"]) <= 198  # a plausible sum
        assert not in_heldout(r["prompt"], 0.2)
    assert all(in_heldout(r["prompt"], 0.2) for r in held)

    p = assay("rm", "train", f"model={tiny_model_dir}", f"data.path={train_file}", f"data.eval_path={held_file}", f"output_dir={tmp_path}",
              "run_name=cli", "train.steps=4", "train.batch_size=8", "train.threads=1", "data.max_length=32", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "eval/pair_accuracy/longer" in p.stderr and (tmp_path / "cli" / "final" / "model.safetensors").is_file()
    p = assay("rm", "train", "--resume", str(tmp_path / "cli"), "train.steps=5", "--no-progress")  # one more step
    assert p.returncode == 0, p.stderr
    assert [r["step"] for r in read_metrics(tmp_path / "cli" / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    p = assay("rm", "eval", "--path", str(tmp_path / "cli"), "--data", str(held_file), "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["rows"] == 60 and out["pairs"] == 60 and 0.0 <= out["pair_accuracy"] <= 1.0
    last = read_metrics(tmp_path / "cli" / "metrics.jsonl")[-1]
    assert out["pair_accuracy"] == last["eval/pair_accuracy"]  # the saved model scores as the trained one did
    assert sum(b["pairs"] for b in out["calibration"]) == 60 and out["calibration_ece"] == pytest.approx(last["eval/calibration_ece"])
    plain_transformers_score_as_assay(tmp_path / "cli" / "final", held, out["pair_accuracy"])
    p = assay("rm", "eval", "--path", str(tmp_path / "cli"), "--data", str(held_file), "--plot", str(tmp_path / "cal.png"))
    assert p.returncode == 0 and (tmp_path / "cal.png").read_bytes()[:4] == b"\x89PNG" and "calibration_ece" in p.stdout
    rb2 = write_jsonl(tmp_path / "rb2.jsonl", [{"id": str(i), "prompt": "3+4=", "chosen": ["7"], "rejected": ["8", "17", "6"], "subset": "Math"}
                                               for i in range(2)])
    p = assay("rm", "eval", "--path", str(tmp_path / "cli" / "final"), "--data", str(rb2), "--json")
    out = json.loads(p.stdout)
    assert out["rows"] == 2 and out["pairs"] == 6 and out["best_of_n_rows"] == 2 and out["best_of_n_accuracy"] in (0.0, 1.0)

    # RL with the reward model as the reward, through the CLI
    p = assay("train", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=rl", "train.steps=2", "train.eval_n=4",
              "reward_workers=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.threads=1",
              f"reward={{name: rm, args: {{path: {tmp_path / 'cli'}, verifier: arithmetic}}}}", "--no-progress")
    assert p.returncode == 0, p.stderr
    rl = [r for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rl) >= 2 and all(r["reward/count"] == 4 and r["reward/failures"] == 0 and r["reward/none"] == 0 for r in rl)
    assert all("reward/verifier_disagreement" in r and 0.0 <= r["reward/verifier/mean"] <= 1.0 for r in rl)
    # a reward model's score is no verdict: no sampled "accuracy" of it; held-out accuracy is the task's verifier's, the rm's mean beside it
    rows = read_metrics(tmp_path / "rl" / "metrics.jsonl")
    evals = [r for r in rows if "eval/mean_length" in r]
    assert not any("train/accuracy" in r for r in rows) and evals and all("eval/accuracy" in r and "eval/mean_reward" in r for r in evals)
    assert "held-out accuracy at end: " in p.stderr and "held-out mean reward at end: " in p.stderr
    verified = json.loads(assay("eval", "--model", str(tmp_path / "rl" / "final"), "--n", "4", "--k", "0", "--max-new-tokens", "4",
                                "--workers", "0", "--json").stdout)
    assert evals[-1]["eval/accuracy"] == verified["accuracy"]


def plain_transformers_score_as_assay(final, rows, pair_accuracy):
    """The obvious call on a saved reward model — `AutoTokenizer` + `AutoModelForSequenceClassification` on
    `tok(prompt + response)`, and `pipeline("text-classification")` — gives the `rm` reward's scores and
    `assay rm eval`'s pairwise accuracy on the same text."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline

    from assay.rewards.spec import build_reward
    from assay.types import Sample, Trajectory

    tok = AutoTokenizer.from_pretrained(final)
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    texts = [(r["prompt"], r[side]) for r in rows for side in ("chosen", "rejected")]
    with torch.no_grad():
        plain = [model(**tok(p + c, return_tensors="pt")).logits[0, 0].item() for p, c in texts]
    piped = [x["score"] for x in pipeline("text-classification", model=str(final))([p + c for p, c in texts])]
    reward = build_reward({"name": "rm", "args": {"path": str(final)}})
    ours = [r.score for r in reward([Trajectory(Sample(str(i), p, None), c, [], [], [], True) for i, (p, c) in enumerate(texts)])]
    assert plain == pytest.approx(ours, abs=1e-5) and piped == pytest.approx(ours, abs=1e-5)
    assert sum(a > b for a, b in zip(plain[::2], plain[1::2])) / len(rows) == pair_accuracy
    # and a text longer than max_length, cut from the left under truncation=True as assay cuts it
    long_prompt = "1+" * 40 + "1="
    cut = tok(long_prompt + "41", truncation=True)["input_ids"]
    assert len(cut) == json.loads((final / "assay_rm.json").read_text())["max_length"] and cut[-1] == tok.eos_token_id
    with torch.no_grad():
        assert model(input_ids=torch.tensor([cut])).logits[0, 0].item() == pytest.approx(reward([Trajectory(Sample("l", long_prompt, None), "41", [], [], [], True)])[0].score, abs=1e-5)


def test_docstring_examples():
    import doctest

    import assay.rm.losses

    assert doctest.testmod(assay.rm.losses).failed == 0


def test_a_model_reward_is_scored_in_batches_in_the_callers_process(tmp_path, tiny_model_dir):
    """`rm` declares kind = "batch": with the default reward workers (as `assay eval --best-of` and `assay reward score`
    use them) the executor starts no worker process and the model scores the batch in forwards of `batch_size`, alone
    or inside a composition; the scores are those of workers=0."""
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward
    from assay.rm.reward import loaded
    from assay.types import Sample, Trajectory

    model, tok = build_rm(str(tiny_model_dir), seed=2)
    save_rm(tmp_path / "rm", model, tok, {"max_length": 64})
    batch = [Trajectory(Sample(str(i), f"{i}+1=", str(i + 1)), str(i + d), [], [], [], True) for i in range(10) for d in (0, 1)]
    spec = {"name": "rm", "args": {"path": str(tmp_path / "rm"), "batch_size": 8}}
    with RewardExecutor(build_reward(spec), workers=0) as inline:
        want = [r.score for r in inline.score(batch)]
    rm_model, _ = loaded(str(tmp_path / "rm"), "cpu")
    forwards = []
    rm_model.register_forward_hook(lambda m, args, kwargs, out: forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    for reward in (build_reward(spec), build_reward({"name": "weighted", "args": {"components": {"rm": spec, "ok": "arithmetic"}}})):
        forwards.clear()
        with RewardExecutor(reward, workers=2) as ex:
            got = ex.score(batch)
            assert ex._pool is None  # no worker process was started
        assert forwards == [8, 8, 4]
        scores = [r.components.get("rm", r.score) for r in got]
        assert scores == pytest.approx(want, abs=1e-6)


def test_a_conversation_is_scored_through_the_template_with_its_generation_prompt(tmp_path):
    """`rm` and `prm` render a conversational prompt with the reward model's chat template and its generation prompt: with
    a ChatML template that honours `add_generation_prompt`, the scored ids are the rendering with the assistant header,
    then the response (and, for `rm`, EOS) — and the saved model scores that text the same under plain transformers."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from assay.models import build_tiny_model, quiet_hf
    from assay.models.chat import build_chat_tokenizer
    from assay.rewards.spec import build_reward
    from assay.rm.prm import StepEncoder
    from assay.types import Sample, Trajectory

    quiet_hf()
    tok = build_chat_tokenizer("chatml")
    lm = tmp_path / "lm"
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64).save_pretrained(lm)
    tok.save_pretrained(lm)
    model, tok = build_rm(str(lm), seed=1)
    conv = [{"role": "user", "content": "What is 3 + 4?"}]
    header = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    assert header != tok.apply_chat_template(conv, add_generation_prompt=False, tokenize=False)  # the template honours the flag
    ids, _ = Encoder(tok, 128).ids(conv, "7")
    assert ids == tok(header + "7", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    step_ids, ends = StepEncoder(tok, 128).ids(conv, ["7"])
    assert step_ids == tok(header, add_special_tokens=False)["input_ids"] + tok("7", add_special_tokens=False)["input_ids"]
    save_rm(tmp_path / "rm", model, tok, {"max_length": 128})
    reward = build_reward({"name": "rm", "args": {"path": str(tmp_path / "rm")}})
    ours = reward([Trajectory(Sample("0", conv, None), "7", [], [], [], True)])[0].score
    plain_tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    plain = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    with torch.no_grad():
        assert plain(**plain_tok(header + "7", return_tensors="pt")).logits[0, 0].item() == pytest.approx(ours, abs=1e-5)
