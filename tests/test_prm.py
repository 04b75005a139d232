"""Process reward models: step splitting and spans, step-labelled rows, Monte Carlo labels from the bundled model,
BCE training on a real tiny model, the `prm` reward and its reduces, ProcessBench's first-error F1 by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.rewards.spec import build_reward
from assay.rm.config import load_rm_config
from assay.rm.label_steps import continued, label_steps
from assay.rm.model import load_rm
from assay.rm.prm import REDUCES, first_error_f1, min_form_returns, predict_first_error, reduce_steps, score_steps
from assay.rm.steps import read_processbench, read_step_rows, split_steps
from assay.rm.train import train_rm
from assay.types import Sample, Trajectory


def assay(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=timeout)


def one_line_error(p, needle):
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("assay: error:") and needle in lines[0], p.stderr


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def comma_split(text):
    """A user's own splitter (`test_prm:comma_split`): spans between commas."""
    out, start = [], 0
    for i, ch in enumerate(text + ","):
        if ch == ",":
            out.append((start, i))
            start = i + 1
    return out


# ---------------------------------------------------------------- splitting


def spans_of(text, how="newline"):
    steps = split_steps(text, how)
    for s in steps:
        assert text[s.start : s.end] == s.text  # every span is exactly its text in the completion
    return [(s.text, s.start, s.end) for s in steps]


def test_split_by_newline_drops_blank_steps_and_keeps_spans():
    assert spans_of("x = 3\n\n  y = 4  \n\nz") == [("x = 3", 0, 5), ("y = 4", 9, 14), ("z", 18, 19)]
    assert spans_of("") == [] and spans_of("\n \n\t") == []


def test_split_thinking_completion():
    text = "<think>\nadd 7 and 8\n\n15\n</think>\nThe answer is 15."
    assert [t for t, _, _ in spans_of(text)] == ["<think>", "add 7 and 8", "15", "</think>", "The answer is 15."]
    assert spans_of(text, "\n\n") == [("<think>\nadd 7 and 8", 0, 19), ("15\n</think>\nThe answer is 15.", 21, 50)]
    assert spans_of("<think>\n\n</think>", "\n\n") == [("<think>", 0, 7), ("</think>", 9, 17)]  # an empty thought is no step


def test_split_by_marker_chars_and_function():
    assert spans_of("Step 1: a=2. Step 2: b=a+1.", "Step") == [("Step 1: a=2.", 0, 12), ("Step 2: b=a+1.", 13, 27)]
    assert spans_of("intro Step 1: x", "Step") == [("intro", 0, 5), ("Step 1: x", 6, 15)]
    assert spans_of("173", "chars:1") == [("1", 0, 1), ("7", 1, 2), ("3", 2, 3)]
    assert spans_of("12345", "chars:2") == [("12", 0, 2), ("34", 2, 4), ("5", 4, 5)]
    assert spans_of("a, b,,c", "test_prm:comma_split") == [("a", 0, 1), ("b", 3, 4), ("c", 6, 7)]


@pytest.mark.parametrize("how, needle", [("chars:0", "chars:N"), ("chars:x", "chars:N"), ("", "newline, chars:N"),
                                         ("no_such_mod:split", "cannot import step splitter")])
def test_split_errors_are_one_line(how, needle):
    with pytest.raises(AssayError, match=needle):
        split_steps("1\n2", how)


# ---------------------------------------------------------------- step-labelled rows


def test_rows_labels_ratings_prm800k_and_processbench(tmp_path):
    rows = [
        {"prompt": "p1", "steps": ["a", "b", "c"], "labels": [True, 0.25, False]},
        {"problem": "p2", "steps": ["a", "b", "c"], "ratings": [1, 0, -1]},  # PRM800K: neutral is not wrong
        {"question": {"problem": "p3"}, "label": {"steps": [
            {"completions": [{"text": "s1", "rating": 1}], "chosen_completion": 0, "human_completion": None},
            {"completions": [{"text": "s2a", "rating": 0}, {"text": "s2b", "rating": 1}], "chosen_completion": 1, "human_completion": None},
            {"completions": [{"text": "s3a", "rating": 1}, {"text": "s3b", "rating": -1}], "chosen_completion": None, "human_completion": None},
            {"completions": [{"text": "never read", "rating": 1}], "chosen_completion": 0}]}},
    ]
    got = read_step_rows(write_jsonl(tmp_path / "s.jsonl", rows))
    assert [r.labels for r in got] == [[1.0, 0.25, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert got[2].prompt == "p3" and got[2].steps == ["s1", "s2b", "s3b"]
    assert [r.first_error for r in got] == [1, 2, 2]  # the first label below 0.5
    assert got[0].completion == "a\nb\nc" and got[0].pieces() == ["a", "\nb", "\nc"]
    pb = read_processbench(write_jsonl(tmp_path / "pb.jsonl", [{"problem": "q", "steps": ["a", "b", "c"], "label": 1},
                                                                {"problem": "q2", "steps": ["a"], "label": -1}]))
    assert [r.labels for r in pb] == [[1.0, 0.0, 0.0], [1.0]] and [r.first_error for r in pb] == [1, -1]


@pytest.mark.parametrize("row, needle", [
    ({"prompt": "p", "steps": ["a"], "labels": [-1]}, "'ratings' column"),
    ({"prompt": "p", "steps": ["a"], "labels": [1.5]}, "not a boolean or a number in [0, 1]"),
    ({"prompt": "p", "steps": ["a"], "ratings": [2]}, "not a PRM800K rating"),
    ({"prompt": "p", "steps": ["a", "b"], "labels": [1]}, "2 steps but 1 labels"),
    ({"prompt": "p", "steps": [], "labels": []}, "non-empty list of strings"),
    ({"prompt": "p", "steps": ["a"]}, "neither 'labels'"),
    ({"steps": ["a"], "labels": [1]}, "no prompt column"),
])
def test_bad_rows_are_one_line(tmp_path, row, needle):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "steps": ["a"], "labels": [1]}, row])
    with pytest.raises(AssayError, match="row 2") as e:
        read_step_rows(path)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_processbench_label(tmp_path):
    with pytest.raises(AssayError, match="'label' must be -1 or the index of a step"):
        read_processbench(write_jsonl(tmp_path / "pb.jsonl", [{"problem": "q", "steps": ["a"], "label": 3}]))


def test_cli_bad_step_file_is_one_line(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "steps": ["a"], "labels": ["yes"]}])
    one_line_error(assay("rm", "train", "kind=prm", f"data.path={path}", f"output_dir={tmp_path}"), "row 1: label 'yes'")
    one_line_error(assay("rm", "label-steps", "--out", str(tmp_path / "x.jsonl"), "--steps", "chars:0"), "chars:N")


# ---------------------------------------------------------------- PURE's min form and ProcessBench, by hand


def test_min_form_and_reduces_by_hand():
    assert min_form_returns([0.9, 0.2, 0.7, 0.8]) == [0.2, 0.2, 0.7, 0.8]
    assert min_form_returns([0.5]) == [0.5] and min_form_returns([]) == []
    s = [0.9, 0.5, 0.8]
    assert [reduce_steps(s, h) for h in REDUCES] == pytest.approx([0.5, 2.2 / 3, 0.8, 0.9 * 0.5 * 0.8, 2.2], abs=1e-12)
    with pytest.raises(AssayError, match="unknown reduce"):
        reduce_steps(s, "max")


def test_first_error_f1_by_hand():
    assert predict_first_error([0.9, 0.4, 0.2]) == 1 and predict_first_error([0.9, 0.6]) == -1
    assert predict_first_error([0.9, 0.6], threshold=0.7) == 1
    # erroneous rows: labels 2, 0, 1 → predicted 2 (hit), 1 (miss), 1 (hit): 2/3; correct rows: -1, -1 → -1 (hit), 0 (miss): 1/2
    got = first_error_f1([2, 1, 1, -1, 0], [2, 0, 1, -1, -1])
    assert got["error_accuracy"] == pytest.approx(2 / 3) and got["correct_accuracy"] == 0.5
    assert got["f1"] == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))  # 4/7
    assert first_error_f1([-1], [-1]) == {"error_accuracy": None, "correct_accuracy": 1.0, "f1": None}
    assert first_error_f1([0, 1], [1, -1])["f1"] == 0.0


# ---------------------------------------------------------------- Monte Carlo labels from the bundled model


@pytest.fixture(scope="module")
def mc_rows():
    return label_steps("tiny-arith", "arithmetic", split="train", problems=12, samples=2, rollouts=4, steps="chars:1", seed=3)


def test_label_steps_on_the_bundled_model(mc_rows):
    from assay.data.tasks import ArithmeticReward

    verify = ArithmeticReward()
    assert len(mc_rows) >= 20  # 24 solutions, less any empty one
    for r in mc_rows:
        comp = r["completion"]
        assert len(r["steps"]) == len(r["labels"]) == len(r["spans"]) == len(r["rollouts"]) == len(comp.strip())  # one step per character
        assert all(comp[a:b] == s for s, (a, b) in zip(r["steps"], r["spans"])) and "".join(r["steps"]) == comp
        assert all(0.0 <= y <= 1.0 and (y * 4).is_integer() for y in r["labels"][:-1])  # soft: a share of 4 rollouts
        assert r["rollouts"] == [4] * (len(r["steps"]) - 1) + [1]
        right = verify.score(Trajectory(Sample("x", r["prompt"], r["answer"]), comp, [], [], [], True)).score
        assert r["labels"][-1] == right  # the last step is the solution itself
    assert {r["split"] for r in mc_rows} == {"chars:1"}
    assert {0.0, 1.0} <= {y for r in mc_rows for y in r["labels"]}  # right and wrong steps both occur


def test_continued_prompts():
    text = continued(Sample("1", "7+8=", "15", {"nums": [7, 8]}), "1")
    assert text.prompt == "7+8=1" and text.answer == "15" and text.fields == {"nums": [7, 8]}
    chat = continued(Sample("2", [{"role": "user", "content": "7+8?"}], "15", template_args={"enable_thinking": False}), "<think>\nadd")
    assert chat.prompt[-1] == {"role": "assistant", "content": "<think>\nadd"} and len(chat.prompt) == 2
    assert chat.template_args == {"enable_thinking": False}  # the sampler's chat template continues the final assistant message


def test_label_steps_hard_and_seeded():
    a = label_steps("tiny-arith", problems=4, samples=2, rollouts=3, steps="chars:1", label="hard", seed=1)
    b = label_steps("tiny-arith", problems=4, samples=2, rollouts=3, steps="chars:1", label="hard", seed=1)
    assert a == b and all(y in (0.0, 1.0) for r in a for y in r["labels"])


# ---------------------------------------------------------------- training, the saved model, the reward


# digit steps whose label is whether the digit is even: learnable from the step's own last token
EVEN = [{"prompt": f"{a}=", "steps": list(f"{a * 7 + 13}"), "labels": [float(int(d) % 2 == 0) for d in f"{a * 7 + 13}"], "separator": ""}
        for a in range(60)]


@pytest.fixture(scope="module")
def prm_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("prm")
    data = write_jsonl(tmp / "even.jsonl", [{**r, "split": "chars:1"} for r in EVEN])
    cfg = load_rm_config(None, ["kind=prm", f"model={tiny_model_dir}", f"data.path={data}", f"output_dir={tmp}", "run_name=even",
                                "train.steps=40", "train.batch_size=16", "train.eval_every=20", "train.threads=1", "optim.lr=3e-3",
                                "optim.warmup_steps=2", "data.eval_fraction=0.2"])
    return train_rm(cfg), tiny_model_dir


def test_prm_training_moves_weights_and_lowers_the_loss(prm_run):
    from safetensors.torch import load_file

    result, base = prm_run
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    losses = [r["rm/loss"] for r in rows if "rm/loss" in r]
    assert len(losses) == 40 and sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    evals = [r for r in rows if "eval/step_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 20, 40] and evals[-1]["eval/step_accuracy"] > 0.9 and evals[-1]["eval/step_bce"] < evals[0]["eval/step_bce"]
    before, after = load_file(base / "model.safetensors"), load_file(result.model_dir / "model.safetensors")
    moved = [k for k in before if k in after and not torch.equal(before[k], after[k])]
    assert moved and "score.weight" in after
    meta = json.loads((result.model_dir / "assay_rm.json").read_text())
    assert meta["kind"] == "prm" and meta["split"] == "chars:1"
    from test_rm import assert_keys_documented

    assert_keys_documented(result.run_dir)  # every key in docs/metrics.md


def test_prm_resume_is_exact(tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "even.jsonl", EVEN)
    base = ["kind=prm", f"model={tiny_model_dir}", f"data.path={data}", f"output_dir={tmp_path}", "train.batch_size=8", "train.threads=1",
            "optim.lr=3e-3", "train.save_every=3", "train.eval_every=3"]
    whole = train_rm(load_rm_config(None, [*base, "run_name=whole", "train.steps=6"]))
    train_rm(load_rm_config(None, [*base, "run_name=part", "train.steps=3"]))
    resumed = train_rm(resume=tmp_path / "part", overrides=["train.steps=6"])
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(resumed.model_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

    def timeless(run_dir):
        return [{k: v for k, v in r.items() if "seconds" not in k} for r in read_metrics(run_dir / "metrics.jsonl")]

    assert len(timeless(whole.run_dir)) == 7 and timeless(whole.run_dir) == timeless(resumed.run_dir)  # step 0 and 6 steps, the same numbers


def test_saved_prm_loads_with_the_hf_class_and_scores_steps(prm_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    result, _ = prm_run
    model, tok, _ = load_rm(result.model_dir)
    got = score_steps(model, tok, "5=", "47", "chars:1")
    assert [span for _, span in got] == [(0, 1), (1, 2)]
    assert got[0][0] > 0.5 > got[1][0]  # "4" is even, "7" odd
    hf = AutoModelForSequenceClassification.from_pretrained(result.model_dir).eval()
    ids = AutoTokenizer.from_pretrained(result.model_dir)("5=47", add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        whole = torch.sigmoid(hf(input_ids=ids).logits[0, 0]).item()
    assert whole == pytest.approx(got[1][0], abs=1e-6)  # the HF class's own pooling is the last step's score


def test_prm_reward_scores_steps_and_reduces(prm_run):
    result, _ = prm_run
    samples = [Sample("a", "5=", "47"), Sample("b", "6=", "2468"), Sample("c", "7=", "")]
    trajs = [Trajectory(s, s.answer, [], [], [], True) for s in samples]
    model, tok, _ = load_rm(result.model_dir)
    by = {}
    for how in REDUCES:
        reward = build_reward({"name": "prm", "args": {"path": str(result.run_dir), "reduce": how}})
        by[how] = reward(trajs)
    first = by["min"]
    for r, t in zip(first[:2], trajs[:2]):
        expect = score_steps(model, tok, t.sample.prompt, t.completion, "chars:1")
        assert r.steps == pytest.approx([s for s, _ in expect], abs=1e-6) and r.spans == [span for _, span in expect]
    assert len(first[1].steps) == 4 and all(p > 0.5 for p in first[1].steps)  # every digit even
    for how in REDUCES:
        for r in by[how][:2]:
            assert r.score == pytest.approx(reduce_steps(first[by[how].index(r)].steps, how))
    assert by["min"][0].score == min(first[0].steps) and by["last"][0].score == first[0].steps[-1]
    assert first[2].score is None and first[2].error is None and first[2].info["reason"] == "no steps in the completion"
    assert build_reward({"name": "prm", "args": {"path": str(result.run_dir), "split": "newline"}})(trajs[:1])[0].steps == pytest.approx(
        [score_steps(model, tok, "5=", "47", "newline")[0][0]])  # one line: one step, scored at its end
    with pytest.raises(Exception, match="reduce 'max'"):
        build_reward({"name": "prm", "args": {"path": str(result.run_dir), "reduce": "max"}})


def test_rm_eval_processbench_f1(prm_run, tmp_path):
    result, _ = prm_run
    model, tok, _ = load_rm(result.model_dir)
    rows = [{"problem": "1=", "steps": ["2", "4"], "label": -1}, {"problem": "2=", "steps": ["4", "3", "8"], "label": 1},
            {"problem": "3=", "steps": ["5"], "label": 0}, {"problem": "4=", "steps": ["8", "6"], "label": 1}]
    data = write_jsonl(tmp_path / "pb.jsonl", [{**r, "separator": ""} for r in rows])
    for threshold in (0.5, 0.9):
        p = assay("rm", "eval", "--path", str(result.run_dir), "--data", data, "--json", "--threshold", str(threshold))
        assert p.returncode == 0, p.stderr
        out = json.loads(p.stdout)
        pred = [predict_first_error([s for s, _ in score_steps(model, tok, r["problem"], "".join(r["steps"]), "chars:1")], threshold) for r in rows]
        expect = first_error_f1(pred, [r["label"] for r in rows])
        assert out["rows"] == 4 and out["erroneous_rows"] == 3 and out["threshold"] == threshold
        assert (out["first_error_f1"], out["error_accuracy"], out["correct_accuracy"]) == (expect["f1"], expect["error_accuracy"], expect["correct_accuracy"])
        if threshold == 0.5:  # the model learned parity: "86" looks right, so row 4's error at step 1 is missed
            assert pred == [-1, 1, 0, -1]
            assert out["first_error_f1"] == pytest.approx(2 * (2 / 3) * 1.0 / (2 / 3 + 1.0))  # error 2/3, correct 1/1: F1 0.8
    one_line_error(assay("rm", "eval", "--path", str(result.run_dir), "--data", data, "--threshold", "1.5"), "--threshold 1.5")


def test_label_steps_cli_then_train_prm(tmp_path, tiny_model_dir):
    out = tmp_path / "steps.jsonl"
    p = assay("rm", "label-steps", "--out", str(out), "--problems", "8", "--rollouts", "2", "--steps", "chars:1", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "labelled steps ->" in p.stderr
    rows = read_step_rows(str(out))
    assert rows and all(r.separator == "" and r.split == "chars:1" for r in rows)
    cfg = load_rm_config(None, ["kind=prm", f"model={tiny_model_dir}", f"data.path={out}", f"output_dir={tmp_path}", "run_name=mc",
                                "train.steps=3", "train.batch_size=4", "train.threads=1", "data.eval_fraction=0"])
    result = train_rm(cfg)
    assert math.isfinite(result.final["rm/loss"]) and (result.run_dir / "final" / "config.json").is_file()


def test_prm_reward_in_assay_train_with_pure_credit(prm_run, tmp_path, tiny_model_dir):
    """The reward's per-step scores and spans feed the `pure` estimator (min-form credit per step) in a real RL run."""
    result, _ = prm_run
    p = assay("train", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=rl", "train.steps=2", "train.eval_n=4",
              "reward_workers=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4", "train.threads=1",
              "algo.advantage=pure", f"reward={{name: prm, args: {{path: {result.run_dir}, reduce: min, split: 'chars:1'}}}}", "--no-progress")
    assert p.returncode == 0, p.stderr
    rl = [r for r in read_metrics(tmp_path / "rl" / "metrics.jsonl") if "reward/mean" in r or "reward/count" in r]
    assert len(rl) >= 2 and all(r["reward/count"] == 4 and r["reward/failures"] == 0 for r in rl)


def test_docstring_examples():
    import doctest

    import assay.rm.prm
    import assay.rm.steps

    assert doctest.testmod(assay.rm.steps).failed == 0 and doctest.testmod(assay.rm.prm).failed == 0
