"""Staged scoring: no way a program can end without running its tests earns more than a crash.

Issue 15: `sys.exit(0)` before any result used to be staged `wrong_answer` (0.3), above a
program that raises (0.1). Every ending below is placed before the function is defined
(the program never reaches its tests) and, for the kinds that call a function, inside the
function; each test kind and both sandbox paths are tried. The reference crash is a program
that raises: nothing may score above it.
"""

from __future__ import annotations

import pytest

from _sandbox import require_sandbox
from assay.rewards.code import DEFAULT_TIERS, CodeReward
from assay.types import Sample, Trajectory

ENDINGS = {
    "sys_exit_0": "import sys\nsys.exit(0)",
    "sys_exit_1": "import sys\nsys.exit(1)",
    "sys_exit_message": "import sys\nsys.exit('bye')",
    "raise_system_exit": "raise SystemExit",
    "os_exit_0": "import os\nos._exit(0)",
    "os_exit_3": "import os\nos._exit(3)",
    "close_stdout": "import os, sys\nsys.stdout.close()\nos.close(1)",
    "close_every_fd": "import os\nos.closerange(0, 4096)",
    "print_blank_and_exit": "import sys\nprint()\nsys.exit(0)",
    "sigkill_self": "import os\nos.kill(os.getpid(), 9)",
    "sigterm_self": "import os\nos.kill(os.getpid(), 15)",
    "sigxcpu_self": "import os, signal\nos.kill(os.getpid(), signal.SIGXCPU)",
    "sigsegv_self": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
    "abort": "import os\nos.abort()",
    "stop_self": "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)",
    "keyboard_interrupt": "raise KeyboardInterrupt",
    "memory_limit": "blocks = []\nwhile True:\n    blocks.append(bytearray(64 << 20))",
    "memory_limit_kill": "import ctypes\nctypes.string_at(0)",
    "cpu_limit": "while True:\n    pass",
    "wall_limit": "import time\ntime.sleep(60)",
    "exec_true": "import os\nos.execv('/usr/bin/true', ['true'])",
    "exec_python": "import os\nos.execv('/usr/bin/python3', ['python3', '-c', 'pass'])",
    "fork_parent_exits": "import os, time\nif os.fork():\n    os._exit(0)\ntime.sleep(30)",
    "thread_exits_process": "import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
                            "import time\ntime.sleep(5)",
    "atexit_exit": "import atexit, os\natexit.register(os._exit, 0)\nraise SystemExit(0)",
    "recursion": "def r():\n    return r()\nr()",
}
STDIO_ONLY = ("close_stdout",)
"""Endings only for stdio tests: a call's result does not travel on stdout, so a program that
closes stdout and goes on to answer has not ended (`close_every_fd` closes the result channel)."""
TESTS = {
    "stdio": {"kind": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "20 22\n", "output": "42\n"}]},
    "call": {"kind": "call", "fn": "add", "cases": [{"args": [1, 2], "expected": 3}]},
    "assert": {"kind": "assert", "cases": ["assert add(1, 2) == 3"]},
    "check": {"kind": "check", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n"},
}
MAIN = "\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))\n"


def before(ending: str) -> str:
    return ending + "\ndef add(a, b):\n    return a + b\n" + MAIN


def inside(ending: str) -> str:
    body = "\n".join("    " + line for line in ending.splitlines())
    return "def add(a, b):\n" + body + "\n    return a + b\n" + MAIN


def traj(program: str, tests: dict, sid: str) -> Trajectory:
    return Trajectory(Sample(sid, "", None, {"tests": tests}), f"```python\n{program}\n```", [], [], [], True)


@pytest.fixture(scope="module", params=[True, False], ids=["forkserver", "fresh"])
def staged(request):
    require_sandbox()
    return CodeReward(mode="staged", cpu_s=0.5, memory_mb=256, fork_server=request.param)


@pytest.mark.parametrize("kind", sorted(TESTS))
def test_no_ending_scores_above_a_crash(staged, kind):
    crash = DEFAULT_TIERS["runtime_error"]
    batch = [traj(before("raise ValueError('crash')"), TESTS[kind], "crash"),
             traj(before(""), TESTS[kind], "honest")]
    endings = {n: e for n, e in ENDINGS.items() if kind == "stdio" or n not in STDIO_ONLY}
    batch += [traj(before(e), TESTS[kind], f"before:{name}") for name, e in endings.items()]
    if kind != "stdio":
        batch += [traj(inside(e), TESTS[kind], f"inside:{name}") for name, e in endings.items()]
    out = {t.sample.id: r for t, r in zip(batch, staged(batch))}
    assert out["crash"].score == crash and out["honest"].score == 1.0
    above = {k: (r.score, r.info.get("stage")) for k, r in out.items() if k not in ("crash", "honest") and r.score > crash}
    assert above == {}
    assert all(r.error is None for r in out.values())


def test_a_real_timeout_is_a_timeout_and_a_self_sent_sigxcpu_is_a_crash(staged):
    out = staged([traj(before(ENDINGS["cpu_limit"]), TESTS["call"], "a"),
                  traj(before(ENDINGS["sigxcpu_self"]), TESTS["call"], "b"),
                  traj(before(ENDINGS["wall_limit"]), TESTS["call"], "c")])
    assert [r.info["stage"] for r in out] == ["timeout", "runtime_error", "timeout"]


def test_tiers_that_reward_avoiding_the_tests_are_refused():
    from assay.errors import AssayError

    for tiers in ({"timeout": 0.2}, {"syntax_error": 0.5}, {"no_code": 0.2}, {"compile_error": 0.15}):
        with pytest.raises(AssayError, match="above a crash"):
            CodeReward(mode="staged", tiers=tiers)
    with pytest.raises(AssayError, match="unknown stages"):
        CodeReward(mode="staged", tiers={"crash": 0.1})
    assert CodeReward(mode="staged", tiers={"runtime_error": 0.2, "timeout": 0.2}).tiers["timeout"] == 0.2
