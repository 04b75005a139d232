"""The `code` reward: extraction, test kinds, scoring modes, and the security suite.

Each attack in the security suite must earn nothing and leave the host unharmed: no
process of a sandbox uid survives (an idle fork server aside), planted host files are
unread and unchanged, nothing is written outside the scratch directory, and the pool still
scores an honest program. Every test that runs programs runs twice: with the fork server
(the default) and with a fresh bwrap sandbox per program.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from _sandbox import describe, require_sandbox, slot_leftovers
from assay.rewards.base import REWARDS
from assay.rewards.code import CodeReward, extract_code
from assay.types import Sample, Trajectory

SECRET = "assay-host-secret-7d1f"
os.environ.setdefault("ASSAY_TEST_SECRET", SECRET)

ADD_STDIO = {"kind": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "20 22\n", "output": "42\n"}]}
ADD_CALL = {"kind": "call", "fn": "add", "cases": [{"args": [1, 2], "expected": 3}, {"args": [20, 22], "expected": 42}]}
ADD_ASSERT = {"kind": "assert", "cases": ["assert add(1, 2) == 3", "assert add(20, 22) == 42"]}
ADD_CHECK = {"kind": "check", "entry_point": "add",
             "test": "def check(candidate):\n    for a, b in [(1, 2), (20, 22)]:\n        assert candidate(a, b) == a + b\n"}
HONEST = ("def add(a, b):\n    return a + b\n\n"
          "if __name__ == '__main__':\n    a, b = map(int, input().split())\n    print(add(a, b))\n")


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution.\n```{lang}\n{code}\n```\n"


def traj(completion: str, tests, sid: str = "p0", **fields) -> Trajectory:
    return Trajectory(Sample(sid, "add two numbers", None, {"tests": tests, **fields}), completion, [], [], [], True)


@pytest.fixture(scope="module", params=[True, False], ids=["forkserver", "fresh"])
def fork_server(request):
    require_sandbox()
    return request.param


@pytest.fixture(scope="module")
def reward(fork_server):
    return CodeReward(mode="all", cpu_s=1.0, fork_server=fork_server)


@pytest.fixture(scope="module")
def attack_reward(fork_server):
    return CodeReward(mode="all", cpu_s=0.5, fork_server=fork_server)


def assert_host_unharmed(reward: CodeReward) -> None:
    deadline = time.monotonic() + 3
    while slot_leftovers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (left := slot_leftovers()), f"a sandboxed process outlived its run: {describe(left)}"
    assert reward([traj(fenced(HONEST), ADD_STDIO)])[0].score == 1.0, "the pool no longer scores honest code"


# --- extraction, test kinds, modes --------------------------------------------------------


def test_registered():
    assert REWARDS.get("code") is CodeReward


def test_extraction_takes_the_last_block_of_the_language():
    text = "```python\nprint(1)\n```\n```text\nnot code\n```\n```py\nprint(2)\n```"
    assert extract_code(text, "python") == "print(2)\n"
    assert extract_code("```\nprint(3)\n```", "python") == "print(3)\n"
    assert extract_code("```\nprint(3)\n```", "python", "fenced_strict") is None
    assert extract_code(text, "python", "first_fenced") == "print(1)\n"
    assert extract_code("no code here", "python") is None
    assert extract_code("print(4)", "python", "raw") == "print(4)"


def test_honest_solution_passes_every_test_kind(reward):
    out = reward([traj(fenced(HONEST), t) for t in (ADD_STDIO, ADD_CALL, ADD_ASSERT, ADD_CHECK)])
    assert [r.score for r in out] == [1.0, 1.0, 1.0, 1.0]
    assert all(r.info["stage"] == "pass" and r.info["passed"] == [True, True] for r in out[:3])
    assert out[3].info["passed"] == [True]  # a check function is one test


def test_stages_and_pass_vector(reward):
    cases = {
        "no_code": "I don't know.",
        "syntax_error": fenced("def add(a, b) return a + b"),
        "runtime_error": fenced("raise ValueError('boom')"),
        "timeout": fenced("while True:\n    pass"),
        "wrong_answer": fenced("a, b = map(int, input().split())\nprint(3)"),
    }
    out = reward([traj(c, ADD_STDIO) for c in cases.values()])
    assert [r.info["stage"] for r in out] == list(cases), [r.info for r in out]
    assert out[4].info["passed"] == [True, False] and out[4].info["case_stages"] == ["pass", "wrong_answer"]
    assert all(r.score == 0.0 for r in out)
    assert "ValueError: boom" in out[2].info["errors"][0]


def test_a_test_that_ran_out_of_time_on_a_busy_machine_is_a_timeout():
    """On a busy machine the whole program's deadline can stop the sandbox while a looping test is still under its
    own CPU limit: the harness then records that test killed (SIGKILL, little CPU), or not at all. Both ran out of
    time; a test that failed on its own before the deadline stays a runtime error. And the CPU time read back after
    SIGXCPU can fall short of the limit the kernel counted."""
    from assay.rewards.code_tests import Options, grade, parse_tests
    from assay.sandbox.runner import CaseRecord, Limits, ProgramResult

    groups = parse_tests(ADD_STDIO, "python", "while True:\n    pass", Limits(cpu_s=1.0), None)
    killed, missing = CaseRecord(status="signal", sig=9, cpu=0.4), CaseRecord(status="missing")
    crashed = CaseRecord(status="exit", rc=1, cpu=0.05)
    stopped = grade(groups, [ProgramResult(compiled=True, cases=[killed, missing], status="timeout")], Options())
    assert stopped.stages == ["timeout", "timeout"] and stopped.stage == "timeout"
    ran = grade(groups, [ProgramResult(compiled=True, cases=[crashed, missing], status="timeout")], Options())
    assert ran.stages == ["runtime_error", "timeout"] and ran.stage == "runtime_error"
    alone = grade(groups, [ProgramResult(compiled=True, cases=[killed, crashed])], Options())
    assert alone.stages == ["runtime_error", "runtime_error"]  # killed with no deadline passed: not a timeout
    # SIGXCPU at the limit by the kernel's tick-sampled count, with less read back: a timeout; sent early, a crash
    limit, early = CaseRecord(status="signal", sig=24, cpu=0.85), CaseRecord(status="signal", sig=24, cpu=0.01)
    assert grade(groups, [ProgramResult(compiled=True, cases=[limit, early])], Options()).stages == ["timeout", "runtime_error"]


def test_cpp_program(reward):
    code = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"
    bad = "#include <iostream>\nint main(){ return x; }"
    out = reward([traj(fenced(code, "cpp"), ADD_STDIO, language="cpp"), traj(fenced(bad, "cpp"), ADD_STDIO, language="cpp")])
    assert out[0].score == 1.0
    assert out[1].info["stage"] == "compile_error" and "x" in out[1].info["compile_error"]


def test_fraction_and_staged_modes(reward):
    half = fenced("a, b = map(int, input().split())\nprint(3)")
    tests = {"kind": "stdio", "cases": ADD_STDIO["cases"] * 2}  # passes 2 of 4
    assert CodeReward(mode="fraction")([traj(half, tests)])[0].score == 0.5
    staged = CodeReward(mode="staged", cpu_s=1.0)
    out = staged([traj(half, tests), traj(fenced("raise SystemExit(3)"), tests), traj(fenced(HONEST), tests)])
    assert [r.score for r in out] == [0.3, 0.1, 1.0]


def test_verpo_weights_follow_running_pass_rates(reward):
    r = CodeReward(mode="verpo", verpo_beta=0.5, cpu_s=1.0)
    tests = {"kind": "stdio", "cases": [{"input": "1 2\n", "output": "3\n"}, {"input": "20 22\n", "output": "42\n"}]}
    first_only = fenced("input()\nprint(3)")
    # No history: p = 1/2 for both tests, w = [1/2, 1/2]; one of two passed -> dense 1/2 -> 0.5 * 1/2.
    out = r([traj(first_only, tests)])[0]
    assert out.score == pytest.approx(0.25) and out.info["weights"] == [0.5, 0.5]
    # After that run: test 0 passed 1/1 -> p = 2/3, w = 1/3; test 1 passed 0/1 -> p = 1/3, w = 2/3.
    # Passing only the easy test 0 again: dense = (1/3) / (1/3 + 2/3) = 1/3 -> score 1/6.
    out = r([traj(first_only, tests)])[0]
    assert out.score == pytest.approx(1 / 6)
    # An all-pass program gets (1 - beta) * 1 + beta * 1 = 1.
    assert r([traj(fenced(HONEST), tests)])[0].score == pytest.approx(1.0)


def test_runtime_relative_to_the_reference(reward):
    r = CodeReward(mode="all", runtime_weight=0.5, cpu_s=2.0)
    slow = fenced("import time\ntime.sleep(0.3)\n" + HONEST)
    out = r([traj(fenced(HONEST), ADD_STDIO, reference=HONEST), traj(slow, ADD_STDIO, reference=HONEST)])
    fast_speed, slow_speed = out[0].components["speed"], out[1].components["speed"]
    assert slow_speed < 0.2 < fast_speed
    assert out[0].score == pytest.approx(0.5 + 0.5 * fast_speed) and out[1].score > 0.5
    wrong = r([traj(fenced("print(0)"), ADD_STDIO, reference=HONEST)])[0]
    assert wrong.score == 0.0 and "speed" not in wrong.components


def test_malformed_tests_cannot_be_scored(reward):
    for tests in (None, "not json", {"kind": "nope", "cases": []}, {"kind": "assert", "cases": ["x = 1"]},
                  {"kind": "call", "cases": [{"args": [1]}]}, {"kind": "call", "fn": "add", "cases": [5]},
                  {"kind": "stdio", "cases": [None]}, ["nope"]):
        out = reward([traj(fenced(HONEST), tests)])[0]
        assert out.score is None and out.error
    cpp_call = reward([traj(fenced("int main(){}", "cpp"), ADD_CALL, language="cpp")])[0]
    assert cpp_call.score is None and "stdio" in cpp_call.error


def test_tests_given_as_a_json_string(reward):
    import json

    assert reward([traj(fenced(HONEST), json.dumps(ADD_CALL))])[0].score == 1.0


# --- the security suite -----------------------------------------------------------------

# Each attack sets `won = True` only if it succeeded; the template then answers every test
# correctly, so a score of 0 proves the attack was contained (not merely that it printed junk).
WIN_TEMPLATE = """import sys
won = False
{body}
def add(a, b):
    return a + b if won else None
if __name__ == "__main__" and won:
    a, b = map(int, sys.stdin.readline().split())
    print(a + b)
"""


def attack(body: str) -> str:
    return WIN_TEMPLATE.format(body=body)


ATTACKS = {
    "fork_bomb": attack("import os\nn = 0\nfor _ in range(500):\n    try:\n        if os.fork() == 0:\n"
                        "            import time\n            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
                        "    except OSError:\n        pass\nwon = n >= 100"),
    "fork_bomb_exponential": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "thread_bomb": attack("import threading, time\nn = 0\nfor _ in range(500):\n    try:\n"
                          "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
                          "    except (RuntimeError, MemoryError):\n        break\nwon = n >= 100"),
    "memory_bomb": attack("try:\n    a = bytearray(3 << 30)\n    a[::4096] = b'x' * len(a[::4096])\n    won = True\n"
                          "except MemoryError:\n    pass"),
    "infinite_loop": "def add(a, b):\n    return a + b\nwhile True:\n    pass",
    "sleep_forever": "import time\ndef add(a, b):\n    return a + b\ntime.sleep(10**6)",
    "endless_output": "def add(a, b):\n    return a + b\nwhile True:\n    print('42' * 10000)",
    "disk_fill": attack("import os\nn = 0\ntry:\n    with open('/tmp/fill', 'wb') as f:\n        while True:\n"
                        "            f.write(b'x' * (1 << 20))\n            n += 1\nexcept OSError:\n    pass\n"
                        "for i in range(100):\n    try:\n        open(f'/dev/shm/f{i}', 'wb').write(b'x' * (1 << 20))\n"
                        "        n += 1\n    except OSError:\n        pass\n"
                        "for d in ('/box', '/', '/usr', '/dev', '/proc', '/sys'):\n    try:\n"
                        "        open(os.path.join(d, 'fill'), 'wb').write(b'x')\n        won = True\n"
                        "    except OSError:\n        pass\nwon = won or n > 64"),
    "write_system_dirs": attack("for p in ('/usr/evil', '/usr/bin/python3', '/box/main.py', '/box/harness.py'):\n"
                                "    try:\n        open(p, 'ab').write(b'#')\n        won = True\n    except OSError:\n"
                                "        pass"),
    "kill_parent": attack("import os, signal\nfor pid in (os.getppid(), 1, 2, -1):\n    try:\n"
                          "        os.kill(pid, signal.SIGKILL)\n        won = True\n    except OSError:\n"
                          "        pass"),
    "env_secret": attack("import os\nwon = os.environ.get('ASSAY_TEST_SECRET') is not None or "
                         "any(b'ASSAY_TEST_SECRET' in open(f'/proc/{p}/environ', 'rb').read() "
                         "for p in os.listdir('/proc') if p.isdigit())"),
    "read_host_secrets": attack("import os\nfor p in ('/etc/shadow', '/etc/passwd', '/root/.bashrc', '/work', "
                                "'/proc/1/root/etc/shadow'):\n    if os.path.exists(p):\n        won = True"),
    "privilege_escalation": attack("import os, ctypes\nlibc = ctypes.CDLL(None)\n"
                                   "won = libc.unshare(0x10000000) == 0 or libc.setuid(0) == 0 or "
                                   "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0"),
    "ptrace_harness": attack("import ctypes, os\nlibc = ctypes.CDLL(None)\n"
                             "won = libc.ptrace(16, os.getppid(), 0, 0) == 0\ntry:\n"
                             "    open('/proc/%d/mem' % os.getppid(), 'rb').read(1)\n    won = True\nexcept OSError:\n"
                             "    pass\ntry:\n    os.listdir('/proc/%d/fd' % os.getppid())\n    won = True\n"
                             "except OSError:\n    pass"),
    "stop_the_harness": attack("import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nwon = True"),
    "many_files_and_fds": attack("fds = []\ntry:\n    for i in range(10000):\n"
                                 "        fds.append(open(f'/tmp/f{i}', 'w'))\nexcept OSError:\n    pass\nwon = len(fds) > 1000"),
    "background_daemon": ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                          "        time.sleep(30)\n        os._exit(0)\n    os._exit(0)\n"),
    "always_true_eq": ("class A(int):\n    def __eq__(self, o): return True\n    def __ne__(self, o): return False\n"
                       "    def __hash__(self): return 0\n"
                       "class S(str):\n    def __eq__(self, o): return True\n    def strip(self, *a): return self\n"
                       "def add(a, b): return A(0)\nprint(S('nothing'))"),
    "sys_exit_early": "import sys\nsys.exit(0)\ndef add(a, b): return a + b",
    "os_exit_early": "import os\nos._exit(0)\ndef add(a, b): return a + b",
    "patch_grader": ("import sys, builtins, json\nh = sys.modules.get('__main__')\n"
                     "for name in ('encode', 'evaluate', 'send_result', 'finish', 'stdout_matches', 'values_equal'):\n"
                     "    setattr(h, name, lambda *a, **k: True)\n"
                     "json.dumps = lambda *a, **k: 'true'\nbuiltins.AssertionError = Exception\n"
                     "def add(a, b): return True"),
    "fake_pass_marker": ("import os, sys\nmsg = '{\"t\": \"case\", \"i\": 0, \"st\": \"ok\", \"out\": \"NDIK\", \"res\": \"NDI=\"}\\n'\n"
                         "print(msg * 3 + 'ALL TESTS PASSED\\nPASS\\n')\nsys.stderr.write(msg)\n"
                         "for fd in range(3, 20):\n    try:\n        os.write(fd, msg.encode())\n    except OSError:\n        pass\n"
                         "for path in ('/proc/%d/fd/1' % os.getppid(), '/proc/1/fd/1'):\n"
                         "    try:\n        with open(path, 'w') as f:\n            f.write(msg)\n    except OSError:\n        pass\n"
                         "def add(a, b): return 0"),
}


ATTACKS.update({
    "poison_fork_server": attack("import os, resource, signal\nfor pid in (1, 2, -1, -2):\n"
                                 "    for act in (lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (4, 4)),\n"
                                 "                lambda: os.setpriority(os.PRIO_PROCESS, pid, 19),\n"
                                 "                lambda: os.sched_setaffinity(pid, {0}),\n"
                                 "                lambda: os.kill(pid, signal.SIGSTOP)):\n"
                                 "        try:\n            act()\n            won = True\n"
                                 "        except (OSError, ValueError):\n            pass\n"
                                 "try:\n    os.setpriority(os.PRIO_USER, os.getuid(), 19)\n    won = True\n"
                                 "except OSError:\n    pass"),
    "keyrings_and_ipc": attack("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                               "won = libc.syscall(248, b'user', b'leak', b'x', 1, -4) > 0 or "
                               "libc.shmget(0x5eed, 4096, 0o1666) >= 0 or libc.semget(0x5eed, 1, 0o1666) >= 0 or "
                               "libc.msgget(0x5eed, 0o1666) >= 0"),
})


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_earns_nothing_and_the_host_is_unharmed(reward, attack_reward, name):
    start = time.monotonic()
    code = ATTACKS[name]
    kinds = [{**t, "cases": t["cases"][1:]} for t in (ADD_STDIO, ADD_CALL, ADD_ASSERT)]  # 1 case each: fast
    kinds.append({**ADD_CHECK, "test": "def check(candidate):\n    assert candidate(20, 22) == 42\n"})
    out = attack_reward([traj(fenced(code), t) for t in kinds])
    assert [r.score for r in out] == [0.0, 0.0, 0.0, 0.0], [r.info for r in out]
    assert all(r.error is None for r in out)
    assert time.monotonic() - start < 30
    assert_host_unharmed(reward)


def test_planted_host_file_is_neither_read_nor_written(reward, tmp_path):
    planted = tmp_path / "answer.txt"
    planted.write_text("3\n")
    os.chmod(tmp_path, 0o755)
    os.chmod(planted, 0o666)
    outside = tmp_path / "pwned"
    code = (f"import os\ntry:\n    open({str(outside)!r}, 'w').write('x')\nexcept OSError:\n    pass\n"
            f"try:\n    open({str(planted)!r}, 'w').write('5\\n')\nexcept OSError:\n    pass\n"
            f"for p in ({str(planted)!r}, '/proc/1/root{planted}', '/proc/self/root{planted}'):\n"
            "    try:\n        print(open(p).read(), end='')\n        break\n    except OSError:\n        pass\n")
    tests = {"kind": "stdio", "cases": [{"input": "", "output": "3\n"}]}
    out = reward([traj(fenced(code), tests)])[0]
    assert out.score == 0.0
    assert planted.read_text() == "3\n" and not outside.exists()
    assert_host_unharmed(reward)


def test_network_connection_to_a_host_listener_fails(reward):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(5)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                accepted.append(server.accept())
            except OSError:
                pass

    thread = threading.Thread(target=accept)
    thread.start()
    abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"\0assay-test-{os.getpid()}"
    abstract.bind(name)
    abstract.listen(1)
    code = (f"import socket\nwon = False\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "    won = True\nexcept OSError:\n    pass\ntry:\n    u = socket.socket(socket.AF_UNIX)\n"
            f"    u.connect({name!r})\n    won = True\nexcept OSError:\n    pass\n"
            "print(3 if won else 'no network')\n")
    tests = {"kind": "stdio", "cases": [{"input": "", "output": "3\n"}]}
    out = reward([traj(fenced(code), tests)])[0]
    done.set()
    thread.join()
    server.close()
    abstract.close()
    assert out.score == 0.0 and accepted == []
    assert_host_unharmed(reward)


def test_state_does_not_leak_between_tests_or_programs(reward):
    poison = fenced("import builtins\nbuiltins.print = lambda *a, **k: None\n"
                    "open('/tmp/state', 'w').write('x')\ndef add(a, b): return a + b")
    probe = fenced("import os\nprint(3 if os.path.exists('/tmp/state') else 0)")
    tests = {"kind": "stdio", "cases": [{"input": "", "output": "3\n"}]}
    out = reward([traj(poison, ADD_ASSERT), traj(probe, tests)])
    assert out[0].score == 1.0 and out[1].score == 0.0


def test_pickles_and_runs_under_the_reward_executor(reward):
    import pickle

    from assay.rewards.executor import RewardExecutor

    r = pickle.loads(pickle.dumps(CodeReward(mode="verpo", cpu_s=1.0)))
    assert r.kind == "io" and "_lock" not in r.hparams()
    batch = [traj(fenced(HONEST), ADD_CALL, sid=str(i)) for i in range(6)] + [traj("no code", ADD_CALL)]
    with RewardExecutor(r, timeout=30.0) as ex:
        out = ex.score(batch)
    assert [o.score for o in out] == [1.0] * 6 + [0.0]


def test_hack_patterns_are_flagged_in_info(attack_reward):
    out = attack_reward([traj(fenced(ATTACKS["always_true_eq"]), ADD_CALL),
                         traj(fenced(ATTACKS["sys_exit_early"]), ADD_CALL), traj(fenced(HONEST), ADD_CALL)])
    assert "eq_override" in out[0].info["flags"] and "early_exit" in out[1].info["flags"]
    assert out[2].info["flags"] == []
