"""The fork server: one long-lived, pre-loaded interpreter per sandbox worker, inside bwrap.

Run as `python3 -I -S /box/server.py CTRL_FD CEILINGS` as the worker's slot uid, inside the
same bwrap sandbox (namespaces, read-only root, seccomp filter) that a single program gets;
it is pid 2 of that sandbox. Standard library only. It imports the harness and the modules
programs commonly use, freezes the heap, and then serves one program at a time:

1. It receives `b"run"` and descriptors on the control socket (SCM_RIGHTS): a memfd holding
   the job (program and inputs), the write end of the report pipe, and for check jobs the
   two call pipes. It never reads the job: its own heap holds nothing of any program, so a
   later program, which starts as a copy of this heap, cannot find an earlier one's source.
2. It forks. The child drops the control socket, unblocks signals, moves to `/tmp` and runs
   `harness.run` (limits, compile, one grandchild per case, records straight to the worker).
3. When the child exits, it SIGKILLs every other process of the sandbox (all but bwrap's init
   and itself) until none is left, empties `/tmp` and `/dev/shm` (their entries, extended
   attributes, modes and times), and compares its own rlimits, nice value, CPU affinity,
   scheduling policy and umask with the values it started with. It answers
   `done <wait status> ok|tainted:<what>`; the worker restarts a tainted server.

All blockable signals are blocked here, so a program can only SIGKILL or SIGSTOP the server
(the seccomp filter refuses even those, and rlimit and scheduling calls aimed at pid 2); the
worker restarts a server that dies or stops answering. Each test's process also gets a
stacked filter that protects its own harness the same way (`harness.GUARD`). The server is non-dumpable: no
program can ptrace it, read its memory or open its descriptors.
"""

import ctypes
import gc
import marshal
import os
import resource
import signal
import socket
import stat
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import seccomp  # noqa: E402

sys.path.pop(0)

PRELOAD = ("json", "typing", "re", "collections", "itertools", "functools", "math", "heapq", "bisect",
           "string", "random", "copy", "fractions", "decimal", "statistics", "datetime", "dataclasses",
           "hashlib", "operator", "enum", "abc", "array", "traceback", "textwrap", "unicodedata", "cmath")
"""Modules imported once here; every program finds them loaded (and gets its own copy)."""
SCRATCH = ("/tmp", "/dev/shm")
_MODES = {}
"""The modes of the scratch directories when the server started (restored after each program)."""
RLIMITS = tuple(getattr(resource, n) for n in dir(resource) if n.startswith("RLIMIT_"))


def main():
    ctrl = socket.socket(fileno=int(sys.argv[1]))
    setup(marshal.loads(bytes.fromhex(sys.argv[2])))
    baseline = snapshot()
    ctrl.sendall(b"ready\n")
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctrl, 16, 4)
        except OSError:
            return
        if msg != b"run" or len(fds) not in (2, 4):
            return  # the worker closed the socket, or broke the protocol: stop (it restarts us)
        pid = os.fork()
        if pid == 0:
            job_child(ctrl, fds)
        for fd in fds:
            os.close(fd)
        _, status = os.waitpid(pid, 0)
        clean()
        now = snapshot()
        changed = sorted(k for k in baseline if now[k] != baseline[k])
        ctrl.sendall(f"done {status} {'tainted:' + ','.join(changed) if changed else 'ok'}\n".encode())


def setup(ceilings):
    """Limits, identity and signal state of the server (children start from this), then preload."""
    for name, value in ceilings.items():
        which = getattr(resource, "RLIMIT_" + name.upper())
        resource.setrlimit(which, (value, value))
    for which in (resource.RLIMIT_CORE, resource.RLIMIT_MSGQUEUE):
        resource.setrlimit(which, (0, 0))
    harness.prctl(4, 0)  # PR_SET_DUMPABLE 0
    harness.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    os.chdir("/")
    _MODES.update((p, stat.S_IMODE(os.stat(p).st_mode)) for p in SCRATCH)
    for name in PRELOAD:
        __import__(name)
    harness.json = sys.modules["json"]
    seccomp.warm()
    gc.collect()
    gc.freeze()


def job_child(ctrl, fds):
    """The per-program child: nothing of the server's socket, a clean signal mask, then the harness."""
    code = 0
    try:
        os.close(ctrl.detach())
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        job_fd, chan, *rpc = fds
        with os.fdopen(job_fd, "rb") as f:
            job = marshal.loads(f.read())
        os.setpgid(0, 0)
        os.chdir("/tmp")
        harness.GUARD = guard(os.getpid())
        harness.run(job, chan, tuple(rpc))
    except BaseException:
        harness.print_exception()
        code = 1
    finally:
        os._exit(code)


def guard(me):
    """What each test's process runs first: a stacked filter protecting its harness `me` too."""
    prog = seccomp.program(pids=(1, 2, me))
    if prog is None:
        return None
    load = seccomp.loader(prog)
    return lambda parent: parent == me and load()


def clean():
    """Kill everything but bwrap's init and this server, reap, and empty the scratch directories."""
    me = os.getpid()
    for _ in range(10000):
        others = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        for pid in others:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        harness.reap()
        if not others:
            break
        time.sleep(0.0005)
    for path in SCRATCH:
        wipe(path)


def wipe(path):
    """Remove everything in `path` and reset what a program could set on `path` itself."""
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        remove(entry.path, entry.is_dir(follow_symlinks=False))
    for name in os.listxattr(path):
        try:
            os.removexattr(path, name)
        except OSError:
            pass
    os.chmod(path, _MODES[path])
    os.utime(path, (0, 0))


def remove(path, is_dir):
    if not is_dir:
        os.unlink(path)
        return
    os.chmod(path, 0o700)
    for entry in os.scandir(path):
        remove(entry.path, entry.is_dir(follow_symlinks=False))
    os.rmdir(path)


def snapshot():
    """What a program could have changed in this process and its children would inherit."""
    mask = os.umask(0o022)
    os.umask(mask)
    return {"rlimits": [resource.getrlimit(r) for r in RLIMITS], "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "affinity": sorted(os.sched_getaffinity(0)), "policy": os.sched_getscheduler(0),
            "umask": mask, "cwd": os.getcwd(), "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
            "scratch": [stat.S_IMODE(os.stat(p).st_mode) for p in SCRATCH]}


if __name__ == "__main__":
    main()
