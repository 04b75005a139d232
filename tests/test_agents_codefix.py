"""The `code-fix` environment: a real sandbox, scripted submissions, containment, the report's cap, the example run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from assay.envs import ENVS, CodeFix, CodeFixTask, env_factory
from assay.envs.code_fix import FAMILIES
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.types import Sample

ROOT = Path(__file__).resolve().parent.parent
ADD = Sample("add", "Write Python: f(a, b) returns a+b.",
             fields={"tests": {"kind": "assert", "cases": ["assert f(1, 2) == 3", "assert f(0, 0) == 0", "assert f(-4, 1) == -3",
                                                           "assert f(2, 2) == 4"]}})


def env(**kw):
    return CodeFix(**{"extract": "raw", "workers": 1, **kw})


def test_registered_and_every_bundled_reference_passes():
    assert ENVS.get("code-fix") is CodeFix
    task = CodeFixTask()
    problems = {s.prompt: s for s in task.heldout(100)}
    stream = task.stream("train", 0)
    while len(problems) < sum(len(c) for _, _, c, _ in FAMILIES.values()):  # every problem of both splits: 42
        s = next(stream)
        problems.setdefault(s.prompt, s)
    fenced = CodeFix(workers=1)  # the default extraction: a ```python block
    for s in problems.values():
        fenced.reset(s)
        obs, reward, done, info = fenced.step(f"Here:\n```python\n{s.fields['reference']}```")
        assert (reward, done, info["finish_reason"]) == (1.0, True, "pass"), (s.prompt, obs)


def test_a_wrong_program_sees_its_failing_tests_then_a_fix_scores_1():
    e = env()
    assert e.reset(ADD) == ADD.prompt
    obs, reward, done, info = e.step("def f(a, b):\n    return a * b\n")  # 0*0 and 2*2 are right by accident
    assert not done and reward == 0.0 and info["progress"] == 0.5 and info["stage"] == "wrong_answer"
    assert obs.splitlines() == ["2/4 tests passed (wrong_answer).", "failed: assert f(1, 2) == 3", "failed: assert f(-4, 1) == -3"]
    obs, reward, done, info = e.step("def f(a, b):\n    return a + b\n")
    assert (obs, reward, done, info["finish_reason"], info["attempt"]) == ("", 1.0, True, "pass", 2)


def test_the_last_program_is_scored_whatever_ends_the_episode():
    e = env(mode="fraction", max_attempts=3)
    e.reset(ADD)
    steps = [e.step(p) for p in ["def f(a, b):\n    return a * b\n",            # 2/4
                                 "def f(a, b):\n    return a - b if a else 0\n",  # f(0,0) only: 1/4
                                 "def f(a, b):\n    return 1 / 0\n"]]            # 0/4, and the last attempt
    assert [s.reward for s in steps] == [0.5, -0.25, -0.25]  # each turn: this program's score minus the last one's
    assert sum(s.reward for s in steps) == 0.0 and steps[-1].info["finish_reason"] == "attempts"
    assert steps[1].observation.startswith("1/4 tests passed (wrong_answer).")


def test_the_report_shows_the_error_and_is_cut_to_its_cap():
    e = env(max_chars=300)
    e.reset(ADD)
    obs = e.step("def f(a, b):\n    return 1 / 0\n").observation
    assert obs.startswith("0/4 tests passed (runtime_error).\nfailed: assert f(1, 2) == 3") and "ZeroDivisionError" in obs
    assert len(obs) <= 300
    long = Sample("long", "p", fields={"tests": {"kind": "assert", "cases": [f"assert f({i}) == {'9' * 70}" for i in range(20)]}})
    e = env(max_chars=100)
    e.reset(long)
    obs = e.step("def f(x):\n    return 0\n").observation
    assert len(obs) == 100 and obs.endswith("...") and obs.startswith("0/20 tests passed (wrong_answer).\nfailed: assert f(0) == 999")
    assert e.step("").observation == "no program found"  # raw extraction: nothing to run
    e = env(extract="fenced")
    e.reset(ADD)
    assert e.step("def f(a, b): return a + b").observation == "no program found: write it in a ```python block"


def test_a_hanging_flooding_or_escaping_program_is_contained(tmp_path):
    e = env(cpu_s=0.5, max_chars=200, max_attempts=5)
    e.reset(ADD)
    start = time.monotonic()
    obs, reward, done, info = e.step("def f(a, b):\n    while True:\n        pass\n")
    assert info["stage"] == "timeout" and not done and reward == 0.0 and obs.startswith("0/4 tests passed (timeout).")
    assert time.monotonic() - start < 4 * (2 * 0.5 + 0.5) + 5  # each test stopped at its wall limit (2 x cpu_s + 0.5)

    obs, _, done, info = e.step("import sys\ndef f(a, b):\n    sys.stderr.write('E' * 10**7)\n    print('x' * 10**7)\n    return a + b\n")
    assert info["stage"] != "pass" and not done and len(obs) <= 200  # the flood never reaches the model whole

    marker = tmp_path / "escaped"
    obs, _, done, info = e.step(f"import os\nos.system('touch {marker}')\nopen({str(marker)!r}, 'w').write('x')\n"
                                "def f(a, b):\n    return a + b\n")
    assert not marker.exists()  # the host's file system is not the sandbox's
    assert info["stage"] != "pass" and not done  # writing there failed, so the program died before its tests
    obs, reward, done, info = e.step("def f(a, b):\n    return a + b\n")  # the sandbox still works
    assert (reward, done, info["finish_reason"]) == (1.0, True, "pass")


def test_bad_arguments_are_one_line():
    with pytest.raises(AssayError, match="max_attempts >= 1"):
        env_factory("code-fix", {"max_attempts": 0})
    with pytest.raises(AssayError, match="mode='best'"):
        env_factory("code-fix", {"mode": "best"})
    with pytest.raises(AssayError, match="no_such"):
        env_factory("code-fix", {"no_such": 1})


def test_code_fix_example_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", str(ROOT / "examples" / "code-fix-agent.yaml"), "train.steps=2",
                          f"output_dir={tmp_path}", "train.threads=1", "--no-progress"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = tmp_path.glob("code-fix-agent-*")  # named after the file and the time
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2
    for r in rows:  # 4 prompts x 4 episodes, each 1 to 3 turns, ended by a pass, the attempts, or the loop's budget
        assert r["reward/count"] == 16 and 1 <= r["agent/turns_mean"] <= 3 and r["agent/env_errors"] == 0
        assert sum(v for k, v in r.items() if k.startswith("agent/finish/")) == pytest.approx(1.0)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["prompt"].startswith("Write Python: f(") for s in samples)


def test_docstring_examples():
    import doctest

    import assay.envs.code_fix

    assert doctest.testmod(assay.envs.code_fix).failed == 0
