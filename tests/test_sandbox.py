"""assay.sandbox: isolation detection and opt-out, the runner's limits, the pool, grading helpers.

Tests that run programs use the `pool` fixture, once with a fresh bwrap sandbox per program
and once with the fork server: both paths must behave the same.
"""

from __future__ import annotations

import json
import os
import struct

import pytest

from _sandbox import require_sandbox
from assay.errors import AssayError
from assay.sandbox import Job, Limits, SandboxPool, WorkerPool, grading, isolation, language, seccomp
from assay.sandbox.runner import parse_records, run_job


@pytest.fixture(scope="module", params=[False, True], ids=["fresh", "forkserver"])
def pool(request):
    require_sandbox()
    p = SandboxPool(workers=2, fork_server=request.param)
    yield p
    p.close()


def py_job(source: str, cases: list[dict], mode: str = "stdio", **kw) -> Job:
    return Job(language("python"), source, mode, cases, **kw)


# --- isolation --------------------------------------------------------------------------


def test_no_sandbox_is_refused_with_a_message_naming_the_opt_out(monkeypatch):
    monkeypatch.setattr(isolation, "candidate_bwraps", lambda: [])
    monkeypatch.delenv(isolation.UNSAFE_ENV, raising=False)
    with pytest.raises(AssayError, match="unsafe_no_sandbox=True") as e:
        isolation.detect()
    assert isolation.UNSAFE_ENV in str(e.value)


def test_opt_out_is_loud(monkeypatch):
    monkeypatch.setattr(isolation, "candidate_bwraps", lambda: [])
    with pytest.warns(RuntimeWarning, match="WITHOUT isolation"):
        assert isolation.detect(unsafe_no_sandbox=True).kind == "none"
    monkeypatch.setenv(isolation.UNSAFE_ENV, "1")
    with pytest.warns(RuntimeWarning):
        assert isolation.detect().kind == "none"


def test_opt_out_still_runs_programs_with_limits():
    uid, fd = isolation.claim_slot_uid()
    try:
        r = run_job(py_job("print(int(input()) * 2)", [{"input": "21"}]), isolation.Isolation("none"), uid)
    finally:
        if fd is not None:
            os.close(fd)
    assert r.status == "ok" and r.cases[0].stdout == b"42\n"


def test_bwrap_is_found_and_works():
    require_sandbox()
    iso = isolation.detect()
    assert iso.kind == "bwrap" and isolation.probe_bwrap(str(iso.bwrap)) == ""


# --- runner and pool ----------------------------------------------------------------------


def test_stdio_call_and_expression_modes(pool):
    jobs = [py_job("a, b = map(int, input().split())\nprint(a + b)", [{"input": "1 2"}, {"input": "5 6"}]),
            py_job("def f(x):\n    return (x, [x], {'k': x})", [{"args": [3]}], "call", fn="f"),
            py_job("def f(x):\n    return x + 1", [{"exprs": ["f(1)", "f(2)"]}], "exprs")]
    stdio, call, exprs = pool.run(jobs)
    assert [c.stdout for c in stdio.cases] == [b"3\n", b"11\n"]
    assert grading.decode(call.cases[0].result) == (3, [3], {"k": 3})
    assert grading.decode(exprs.cases[0].result) == [2, 3]


def test_the_sandbox_sees_no_host_files_network_or_environment(pool):
    src = ("import os, socket\n"
           "print(sorted(os.listdir('/')))\n"
           "print(os.getuid() != 0, sorted(os.environ))\n"
           "print(os.path.exists('/work'), os.path.exists('/etc/shadow'), os.path.exists('/root'))\n"
           "print(sorted(n for _, n in socket.if_nameindex()))\n")
    r = pool.run([py_job(src, [{"input": ""}])])[0]
    lines = r.cases[0].stdout.decode().splitlines()
    assert set(eval(lines[0])) <= {"bin", "box", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}
    assert lines[1].startswith("True") and "HOME" in lines[1]
    assert lines[2] == "False False False"
    assert lines[3] == "['lo']"


def cpu_share(pool) -> float:
    """The share of a core a sandboxed process gets right now: CPU seconds per wall second of a busy loop."""
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass"
    rec = pool.run([py_job(busy, [{"input": ""}])])[0].cases[0]
    return min(1.0, rec.cpu / rec.wall)


def test_cpu_limit_ends_the_run_by_sigxcpu_within_one_and_a_half_times_the_limit(pool):
    """Issue 21: the CPU limit is asserted by its own signal, and the run ends within ~1.5x the limit.

    The run's wall time is the harness's own clock for the test's process. On a machine
    busy with other work a process gets less than a core, so the bound is 1.5x the limit in
    the CPU time the machine gives: divided by the share a calibration loop got just before.
    """
    limit, runs = 1.0, []
    for _ in range(3):
        share = cpu_share(pool)
        rec = pool.run([py_job("while True: pass", [{"input": ""}], limits=Limits(cpu_s=limit))])[0].cases[0]
        assert rec.status == "signal" and rec.sig == 24, rec  # SIGXCPU, not the wall clock
        assert 0.9 * limit <= rec.cpu <= 1.5 * limit
        runs.append((rec.wall, share))
        if rec.wall <= 1.5 * limit / share:
            break
    assert any(wall <= 1.5 * limit / share for wall, share in runs), runs


def test_output_cap_and_memory_limit(pool):
    lim = Limits(cpu_s=1.0, output_bytes=1000, memory_mb=256)
    jobs = [py_job("while True: print('x' * 100)", [{"input": ""}], limits=lim),
            py_job("a = bytearray(1 << 30)\nprint('allocated')", [{"input": ""}], limits=lim)]
    flood, mem = pool.run(jobs)
    assert flood.cases[0].status == "output_limit" and len(flood.cases[0].stdout) <= 1000
    assert mem.cases[0].status == "exit" and "MemoryError" in mem.cases[0].stderr


def test_wall_clock_timeout_kills_a_sleeping_program(pool):
    r = pool.run([py_job("import time\ntime.sleep(60)", [{"input": ""}], limits=Limits(cpu_s=0.5))])[0]
    assert r.cases[0].status == "timeout" and r.cases[0].wall < 3


def test_syntax_error_and_cpp_compile(pool):
    cpp = language("cpp")
    jobs = [py_job("def f(:\n", [{"input": ""}]),
            Job(cpp, "#include <cstdio>\nint main(){int a;scanf(\"%d\",&a);printf(\"%d\\n\",a*3);}", "stdio",
                [{"input": "7"}]),
            Job(cpp, "int main( {", "stdio", [{"input": ""}])]
    bad_py, good_cpp, bad_cpp = pool.run(jobs)
    assert not bad_py.compiled and "SyntaxError" in bad_py.compile_error
    assert good_cpp.compiled and good_cpp.cases[0].stdout == b"21\n"
    assert not bad_cpp.compiled and "error" in bad_cpp.compile_error


def test_pool_survives_a_worker_that_dies_or_hangs():
    wp = WorkerPool("os:_exit", workers=1)
    try:
        out = wp.map([0], [5.0])
        assert out[0].reason == "crashed" and "crashed" in out[0].error
        wp2 = WorkerPool("time:sleep", workers=1)
        out = wp2.map([30, 0], [1.0, 5.0])
        assert out[0].reason == "timeout" and "timeout after 1s" in out[0].error and out[1] is None
        assert wp2.restarts == 1 and wp.restarts == 1
        wp2.close()
    finally:
        wp.close()


def test_many_programs_at_once(pool):
    jobs = [py_job(f"print({i} * int(input()))", [{"input": "2"}]) for i in range(12)]
    assert [r.cases[0].stdout for r in pool.run(jobs)] == [f"{2 * i}\n".encode() for i in range(12)]


def test_records_are_parsed_defensively():
    junk = b"\n".join([b"garbage", b"{not json", b'{"t": "case", "i": 99}', b'{"t": "case", "i": "0"}',
                       b'{"t": "compile", "ok": true}', b'{"t": "case", "i": 0, "st": "ok", "out": "!!!"}',
                       b"[1, 2]", b'{"t": "case", "i": 1, "st": "ok", "out": "eA=="}',
                       b'{"t": "case", "i": 1, "st": "ok", "out": "eA=="}', b"{" * 100000])
    r = parse_records(junk, 2)
    assert r.compiled and r.cases[0].status == "missing"
    assert r.cases[1].status == "missing"  # a duplicate record voids the case


# --- grading (parent side) ----------------------------------------------------------------


def test_decode_refuses_anything_but_the_tagged_plain_encoding():
    assert grading.decode('{"T": [1, {"S": [2], "f": true}]}') == (1, frozenset({2}))
    assert grading.decode('{"D": [[1, "a"]]}') == {1: "a"}
    for bad in ('{"X": 1}', '{"S": [[1]]}', "[" * 1000 + "]" * 1000, "nope"):
        with pytest.raises(ValueError):
            grading.decode(bad)


def test_values_equal_is_type_strict():
    assert grading.values_equal(3, 3) and grading.values_equal(0.1 + 0.2, 0.3)
    assert not grading.values_equal(True, 1) and not grading.values_equal(1, True)
    assert not grading.values_equal("1", 1) and not grading.values_equal([1], [1, 1])
    assert grading.values_equal({1, 2}, [2, 1]) and not grading.values_equal({1}, [1, 1, 2])
    assert grading.values_equal({"a": [1, 2.0]}, {"a": [1, 2]})


def test_stdout_whitespace_modes():
    assert grading.stdout_matches(b"1 2 \n3\n\n", "1 2\n3", "lines")
    assert not grading.stdout_matches(b"1 2\n", "1 2\n3", "lines")  # no truncation to the shorter
    assert not grading.stdout_matches(b"1  2\n", "1 2\n", "lines")
    assert grading.stdout_matches(b"1  2\n", "1 2\n", "tokens")
    assert not grading.stdout_matches(b"3\n", "3", "exact")


def test_split_assert_keeps_the_comparison_in_the_parent():
    check = grading.split_assert("assert math.isclose(f(1.5), 2.25, rel_tol=1e-3) and g('A').lower() == 'a'")
    assert check.exprs == ["f(1.5)", "g('A')"]
    assert check.passes([2.2501, "A"]) and not check.passes([2.3, "A"])
    assert grading.split_assert("assert Solution().two([1], 2) == [0]").exprs == ["Solution().two([1], 2)"]
    assert grading.split_assert("assert (lambda: f(1))() == 1").exprs == ["(lambda: f(1))()"]
    for bad in ("x = 1", "assert all(f(x) == x for x in range(3))", "assert f(1) =="):
        with pytest.raises(AssayError):
            grading.split_assert(bad)


def test_job_deadline_covers_every_case():
    job = py_job("", [{"input": ""}] * 3, limits=Limits(cpu_s=1.0))
    assert job.deadline_s() == pytest.approx(3 * (2.5 + 0.1) + 3.0)
    assert json.loads(json.dumps(job.cases)) == job.cases


def test_a_test_s_daemons_do_not_survive_into_the_next_test(pool):
    src = ("import os, time\n"
           "if input() == 'spawn' and os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n"
           "time.sleep(0.1)\nprint(len([p for p in os.listdir('/proc') if p.isdigit()]))\n")
    r = pool.run([py_job(src, [{"input": "spawn"}, {"input": "look"}])])[0]
    first, second = (int(c.stdout) for c in r.cases)
    assert first == second + 1  # bwrap's init, the harness, the test: the daemon is gone


def test_a_call_or_expression_without_a_result_reports_none_not_empty(pool):
    """The harness sends "no result" (None) when the process ends before answering."""
    enders = ["import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit", "import os\nos.closerange(3, 1024)",
              "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
              "import os\nos.execv('/usr/bin/true', ['true'])"]
    jobs = [py_job(src + "\ndef f(x):\n    return x", [{"args": [1]}], "call", fn="f") for src in enders]
    jobs += [py_job(src + "\ndef f(x):\n    return x", [{"exprs": ["f(1)"]}], "exprs") for src in enders]
    for r in pool.run(jobs):
        assert r.cases[0].result is None, r.cases[0]
    ok = pool.run([py_job("def f(x):\n    return x", [{"args": [1]}], "call", fn="f")])[0]
    assert ok.cases[0].result == "1"


# --- the seccomp filter, read by a small BPF interpreter ----------------------------------


def run_filter(prog: bytes, nr: int, args: tuple[int, ...] = (), arch: int = 0xC000003E) -> str:
    """Execute a classic-BPF seccomp program on one syscall; "allow" or "eperm"."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *(list(a & (2**64 - 1) for a in args) + [0] * (6 - len(args))))
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack_from("=I", data, k)[0]
        elif code in (0x15, 0x35):  # jeq / jge
            hit = acc == k if code == 0x15 else acc >= k
            pc += jt if hit else jf
        elif code == 0x06:
            return {0x7FFF0000: "allow", 0x00050001: "eperm"}[k]
        pc += 1


def test_the_seccomp_filter_refuses_what_it_says_and_nothing_else():
    prog = seccomp.program("x86_64")
    kill, keyctl, prlimit, setprio, getpid, write, tgkill = 62, 250, 302, 141, 39, 1, 234
    assert run_filter(prog, keyctl, (1, 2)) == "eperm"
    assert run_filter(prog, kill, (2, 9)) == run_filter(prog, kill, (1, 9)) == "eperm"
    assert run_filter(prog, kill, (-1, 9)) == run_filter(prog, kill, (-2, 9)) == "eperm"
    assert run_filter(prog, kill, (3, 9)) == run_filter(prog, kill, (0, 9)) == "allow"
    assert run_filter(prog, tgkill, (2, 2, 19)) == "eperm" and run_filter(prog, tgkill, (5, 5, 19)) == "allow"
    assert run_filter(prog, prlimit, (2, 7, 0, 0)) == "eperm" and run_filter(prog, prlimit, (0, 7, 0, 0)) == "allow"
    assert run_filter(prog, setprio, (2, 61000, 19)) == "eperm"  # PRIO_USER: every process of the uid
    assert run_filter(prog, setprio, (0, 2, 19)) == "eperm" and run_filter(prog, setprio, (0, 0, 19)) == "allow"
    assert run_filter(prog, getpid) == run_filter(prog, write, (1, 0, 0)) == "allow"
    assert run_filter(prog, kill, (3, 9), arch=0x40000003) == "eperm"  # i386 ABI from a 64-bit process
    assert run_filter(prog, 0x40000000 | write, (1,)) == "eperm"  # x32 ABI
    assert seccomp.program("riscv64") is None


def test_the_seccomp_filter_holds_inside_the_sandbox(pool):
    """Keys, IPC, and signals or limits aimed at the harness (pid 2, or the fork server's child) are refused."""
    src = ("import ctypes, os, resource\nlibc = ctypes.CDLL(None, use_errno=True)\nout = []\n"
           "out.append(libc.syscall(248, b'user', b'k', b'v', 1, -4) == -1 and ctypes.get_errno())\n"
           "out.append(libc.shmget(0x1234, 4096, 0o1666) == -1 and ctypes.get_errno())\n"
           "for call in (lambda: os.kill(2, 0), lambda: resource.prlimit(2, resource.RLIMIT_NOFILE),\n"
           "             lambda: os.kill(os.getppid(), 19), lambda: os.kill(-os.getppid(), 19),\n"
           "             lambda: os.sched_setaffinity(2, {0}), lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19)):\n"
           "    try:\n        call()\n        out.append('allowed')\n    except OSError as e:\n        out.append(e.errno)\n"
           "os.kill(os.getpid(), 0)\nprint(out)\n")
    r = pool.run([py_job(src, [{"input": ""}])])[0]
    assert r.cases[0].stdout.decode().strip() == "[1, 1, 1, 1, 1, 1, 1, 1]", r.cases[0]


@pytest.mark.parametrize("name", ["assay.sandbox.check", "assay.sandbox.seccomp", "assay.sandbox.forkserver",
                                  "assay.sandbox.runner", "assay.sandbox.grading", "assay.rewards.code",
                                  "assay.rewards.code_tests", "assay.rewards.code_datasets"])
def test_docstring_examples(name):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(name)).failed == 0


def test_one_worker_pool_runs_everything_with_deadlines():
    """The sandbox, the SQL reward and the reward executor share assay.workers.WorkerPool."""
    import assay.rewards.executor as executor
    import assay.rewards.sql as sql
    import assay.sandbox.pool as pool
    from assay import workers

    assert pool.WorkerPool is workers.WorkerPool and sql.WorkerPool is workers.WorkerPool and executor.WorkerPool is workers.WorkerPool
    wp = workers.WorkerPool("time:sleep", workers=2)
    try:
        out = wp.stream([0, 30, 0, 0], deadline=1.0, chunk=2)  # the hung job fails alone; the rest of its chunk runs elsewhere
        assert out[0] is None and out[2:] == [None, None] and out[1].reason == "timeout" and wp.restarts == 1
    finally:
        wp.close()
