"""The fork server: programs run by the same server share nothing, and none can poison it.

Every test here uses one worker, so all its programs go to the same server. The leak test
runs a probe that prints everything a program could have left behind (files, environment,
modules, globals, descriptors, limits, cwd, signal state, identity, scheduling, processes),
then a program that changes all of it, then the probe again: both probes must print the same.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from pathlib import Path

import pytest

from _sandbox import descendants, describe, require_sandbox, slot_leftovers
from assay.sandbox import Job, Limits, SandboxPool, language


@pytest.fixture(scope="module")
def pool():
    require_sandbox()
    p = SandboxPool(workers=1, fork_server=True)
    yield p
    p.close()


def run(pool: SandboxPool, source: str, stdin: str = "", **limits) -> str:
    r = pool.run([Job(language("python"), source, "stdio", [{"input": stdin}], limits=Limits(**limits))])[0]
    assert r.status == "ok", r
    case = r.cases[0]
    assert case.status == "ok", (case.status, case.stderr)
    return case.stdout.decode()


PROBE = r'''
import builtins, json, math, os, resource, signal, socket, sys
def tree(top):
    out = []
    for root, dirs, files in os.walk(top):
        for n in sorted(dirs + files):
            p = os.path.join(root, n)
            out.append((p, oct(os.lstat(p).st_mode)))
    return sorted(out)
def shown(path):
    st = os.stat(path)
    return (oct(st.st_mode), st.st_mtime, sorted(os.listxattr(path)), tree(path))
state = {
    "scratch": [shown("/tmp"), shown("/dev/shm")],
    "env": sorted(os.environ.items()),
    "modules": sorted(sys.modules), "patched": [math.pi, json.dumps.__module__, hasattr(builtins, "LEAK"),
                                                 print.__module__, len(vars(builtins))],
    "globals": sorted(globals()), "fds": sorted(os.listdir("/proc/self/fd")),
    "rlimits": [resource.getrlimit(getattr(resource, n)) for n in sorted(dir(resource)) if n.startswith("RLIMIT_")],
    "cwd": os.getcwd(), "umask": os.umask(0),
    "handlers": [str(signal.getsignal(s)) for s in sorted(signal.valid_signals()) if s not in (9, 19)],
    "mask": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "ids": [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()],
    "sched": [os.getpriority(os.PRIO_PROCESS, 0), sorted(os.sched_getaffinity(0)), os.sched_getscheduler(0)],
    "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
    "ipc": [open(f"/proc/sysvipc/{k}").read().count("\n") for k in ("shm", "sem", "msg")],
    "host": socket.gethostname(),
}
print(json.dumps(state, sort_keys=True))
'''

POISON = r'''
import builtins, json, math, os, resource, signal, sys, time, types
os.makedirs("/tmp/a/b", exist_ok=True)
open("/tmp/a/b/leak", "w").write("x")
os.symlink("/tmp/a", "/tmp/link")
os.chmod("/tmp/a", 0)
open("/dev/shm/leak", "w").write("x")
for path in ("/tmp", "/dev/shm"):
    os.setxattr(path, "user.leak", b"1")
    os.utime(path, (12345, 12345))
    os.chmod(path, 0o700)
os.environ["LEAK"] = "1"
os.putenv("LEAK2", "1")
math.pi = 3
json.dumps = lambda *a, **k: "{}"
builtins.LEAK = True
builtins.print = lambda *a, **k: None
sys.modules["leakmod"] = types.ModuleType("leakmod")
LEAK_GLOBAL = 1
for i in range(20):
    os.dup2(os.open("/dev/null", os.O_RDONLY), 40 + i)
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))
os.chdir("/")
os.umask(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, lambda *a: None)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
os.setpriority(os.PRIO_PROCESS, 0, 10)
os.sched_setaffinity(0, {0})
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(60)
    os._exit(0)
time.sleep(0.05)
sys.stdout.write("poisoned\n")
'''


def test_programs_run_by_the_same_server_share_nothing(pool):
    run(pool, "print('warm-up')")
    before = run(pool, PROBE)
    assert run(pool, POISON) == "poisoned\n"
    after = run(pool, PROBE)
    assert after == before
    assert not (left := slot_leftovers()), describe(left)


def test_a_program_cannot_read_an_earlier_program_from_its_memory(pool):
    """The server never holds a job in its heap, so a program's memory has nothing of the one before."""
    earlier, own = secrets.token_hex(8), secrets.token_hex(8)
    run(pool, f"SECRET = 'LEAKMARK:{earlier}'\nprint(len(SECRET))")
    scan = (r"import ctypes, re" + "\n"
            f"mine = 'LEAKMARK:{own}'\n"
            "found = set()\n"
            "for line in open('/proc/self/maps'):\n"
            "    addr, perms = line.split()[:2]\n"
            "    if perms[0] != 'r' or '[v' in line:\n"
            "        continue\n"
            "    lo, hi = (int(x, 16) for x in addr.split('-'))\n"
            "    try:\n        data = ctypes.string_at(lo, hi - lo)\n    except Exception:\n        continue\n"
            "    found.update(m.decode() for m in re.findall(rb'LEAKMARK:([0-9a-f]{16})', data))\n"
            "print(sorted(found))\n")
    found = run(pool, scan)
    assert own in found  # the scan sees this program's own memory
    assert earlier not in found


def server_pid(pool: SandboxPool) -> int:
    """The host pid of this pool's fork server (pid 2 in its sandbox, running server.py)."""
    uid = int(run(pool, "import os\nprint(os.getuid())"))
    for name in os.listdir("/proc"):
        try:
            if not name.isdigit() or os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if nspid[-1] == "2" and b"/box/server.py" in f.read():
                    return int(name)
        except (OSError, StopIteration):
            continue
    raise AssertionError("no fork server found")


def test_a_dead_or_stopped_server_is_replaced_and_the_next_program_is_scored(pool):
    for sig in (signal.SIGKILL, signal.SIGSTOP):
        pid = server_pid(pool)
        os.kill(pid, sig)
        assert run(pool, "print(input())", "still scored", cpu_s=0.5) == "still scored\n"
        assert server_pid(pool) != pid
    assert not (left := slot_leftovers()), describe(left)


OUTSIDER = """
from assay.sandbox import Job, Limits, SandboxPool, language
SandboxPool(workers=1, fork_server=True).run([Job(language("python"), "import time\\ntime.sleep(60)", "stdio", [{"input": ""}],
                                                 limits=Limits(cpu_s=1, wall_s=90))])
"""


def test_another_processs_sandbox_is_no_leftover_of_ours(pool):
    """A shared machine: another process (not ours: re-parented away, in its own session) runs a sandboxed program under
    the same slot uids. The machine-wide scan sees it; the leftover check, scoped to this process's sandboxes, does not."""
    import subprocess
    import sys

    run(pool, "print('warm-up')")
    src = str(Path(__file__).parents[1] / "src")
    started = subprocess.run(["sh", "-c", f"PYTHONPATH={src} setsid {sys.executable} -c '{OUTSIDER}' >/dev/null 2>&1 & echo $!"],
                             capture_output=True, text=True, check=True).stdout.strip()
    outsider = int(started)
    try:
        deadline = time.monotonic() + 60
        while not (theirs := [p for p in slot_leftovers(root=1) if p not in descendants(os.getpid())]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert theirs, "the outsider's sandboxed program never showed up"
        assert slot_leftovers() == []  # ours: none, while theirs runs
        assert run(pool, "print('ours')") == "ours\n" and slot_leftovers() == []
    finally:
        os.killpg(outsider, signal.SIGKILL)


def test_a_tainted_server_is_replaced_after_the_program_it_ran(pool):
    """Nothing in the sandbox can renice the server (seccomp); if it changes anyway, it is replaced."""
    nice = "import os\nprint(os.getpriority(os.PRIO_PROCESS, 0))"
    pid = server_pid(pool)
    os.setpriority(os.PRIO_PROCESS, pid, 7)  # from outside: the sandbox's filter refuses this
    assert run(pool, nice) == "7\n"  # inherited by the program that was already on its way
    assert run(pool, nice) == f"{os.getpriority(os.PRIO_PROCESS, 0)}\n"  # a fresh server: the priority the test runs at
    assert server_pid(pool) != pid


def test_a_job_needing_larger_limits_gets_a_new_server(pool):
    size = "import os\ns = os.statvfs('/tmp')\nprint(s.f_blocks * s.f_frsize >> 20)"
    assert run(pool, size) == "64\n"
    assert run(pool, size, tmpfs_mb=128) == "128\n"


def test_the_worker_waits_for_cleanup_before_the_next_program(pool):
    """A daemon that outlives its program is gone before the next program starts."""
    daemon = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('started')"
    count = "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:2], " \
            "len([p for p in os.listdir('/proc') if p.isdigit()]))"
    base = run(pool, count)
    for _ in range(3):
        assert run(pool, daemon) == "started\n"
        assert run(pool, count) == base
    deadline = time.monotonic() + 2
    while slot_leftovers() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (left := slot_leftovers()), describe(left)
