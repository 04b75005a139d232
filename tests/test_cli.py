"""The `assay` command: user errors are one line and a non-zero exit, never a traceback."""

import json
import subprocess
import sys

import pytest


def assay(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def one_line_error(p, needle):
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("assay: error:"), p.stderr
    assert "Traceback" not in p.stderr
    assert needle in lines[0], lines[0]


def test_missing_model_path(tmp_path):
    one_line_error(assay("train", f"model.path={tmp_path / 'nope'}", f"output_dir={tmp_path}"), "is not a directory")
    one_line_error(assay("eval", "--model", str(tmp_path / "nope")), "is not a directory")


def test_malformed_jsonl_line_is_named(tmp_path, tiny_model_dir):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": \n')
    p = assay("train", f"model.path={tiny_model_dir}", "data.task=null", f"data.path={data}", "reward=arithmetic", f"output_dir={tmp_path}")
    one_line_error(p, "d.jsonl:2: malformed JSON line")


def test_unknown_task():
    one_line_error(assay("eval", "--task", "sudoku"), "unknown task 'sudoku'; known: arithmetic, arithmetic_steps, code-fix, countdown, mix, sql-agent")
    one_line_error(assay("train", "data.task=sudoku", "train.steps=1"), "unknown task 'sudoku'")


@pytest.mark.parametrize("override,needle", [("train.steps=zero", "invalid config value train.steps='zero'"), ("algo.nope=1", "unknown config key 'algo.nope'")])
def test_invalid_override(override, needle):
    one_line_error(assay("train", override), needle)


def test_unknown_algorithm_lists_known(tiny_model_dir, tmp_path):
    one_line_error(assay("train", f"model.path={tiny_model_dir}", "algo.loss=nope", f"output_dir={tmp_path}", "train.steps=1"), "known: ")


def test_eval_json_on_bundled_model():
    p = assay("eval", "--n", "20", "--k", "2", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["n"] == 20 and 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["pass@2"] <= 1.0 and out["mean_length"] > 0
