"""The in-sandbox harness: compiles the program once, then forks one child per test case.

This file runs inside the sandbox with only the standard library (it never imports assay),
in one of two ways: as `python3 -I -S /box/harness.py BOX` in a fresh sandbox per program
(it reads `BOX/job.marshal`, and its stdout is the report channel), or imported by the fork
server (`server.py`), whose per-program child calls `run(job, channel, rpc)` with the job read
from a memfd. The job is plain data written by the trusted parent (marshal, because it
imports in no time) and holds the program and its *inputs* only: expected outputs never
enter the sandbox, and the trusted parent compares what comes back. The harness makes
itself non-dumpable, so a test's code cannot ptrace it or open its `/proc/<pid>/fd` to forge
records, and each child closes the harness's report channel before the untrusted code runs.
The harness is a child-subreaper: after each case it SIGKILLs every process still below it
(a test's daemons), so nothing of one case lives into the next.

Job fields: `lang` (`kind` "python" to exec the program in the forked child, or "exec" to
run `run` after an optional `compile` argv), `source` (file name in BOX), `program` (the
source bytes, for kind "python"), `mode` ("stdio"; "call" with `fn`; "exprs" with an
optional trusted `setup`; "check" with `fn`, whose one case serves calls over the `rpc`
pipes), `cases` (one dict each: `input`, or `args`/`kwargs`, or `exprs`), `cpu_s`, `wall_s`,
`out_cap`, `compile_cpu_s`, `compile_wall_s`, `rlimits` (nproc, fsize, nofile, as,
compile_as: set by the harness on itself before any program code runs, so every process of
the sandbox inherits them), and `rpc` (fd numbers, fresh-sandbox path only).

Records, one JSON object per line on the report channel:
    {"t": "start"}
    {"t": "compile", "ok": bool, "err": base64}
    {"t": "case", "i": int, "st": "ok"|"exit"|"signal"|"timeout"|"output_limit",
     "rc": int, "sig": int, "wall": s, "cpu": s, "out": base64, "err": base64, "res": base64|None}
    {"t": "done"}
Every string in a record is base64, so records are written without the json module. `res` is
None ("no result") unless the test's process wrote one complete result line and exited 0: a
program that exits, is killed or closes its result pipe before answering has no result.
Call and expression results are JSON in a tagged encoding that accepts only exact plain
types (an `int` subclass with a rigged `__eq__` is refused): lists as lists, `{"T": [...]}`
tuples, `{"S": [...], "f": bool}` sets, `{"D": [[k, v], ...]}` dicts, `{"B": hex}` bytes;
floats include NaN and the infinities.

Check mode ("check"): the program's module runs once, then its child answers calls on the
`rpc` pipes until the parent closes them. Requests are 4-byte big-endian lengths followed by
marshal `(args, kwargs)` from the trusted parent; replies are JSON lines:
`{"k": "ready"}` once the program loaded and defines `fn`, then per call `{"k": "r", "v":
value}`, `{"k": "e", "n": builtin exception name, "m": message}` or `{"k": "bad", "m": why}`
(a result that is not plain data).
"""

import binascii
import builtins
import marshal
import os
import resource
import select
import signal
import sys
import time

ERR_CAP = 4096
MSG_CAP = 1000
MAX_DEPTH = 200
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36
_EXCEPTIONS = tuple(c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, Exception))
"""The real builtin exception classes, taken before any program runs (a program may rebind names)."""
GUARD = None
"""Set by the fork server: `GUARD(pid)` loads a seccomp filter on this process that protects `pid`
(the harness) as the sandbox's own filter protects pid 2. Called in each test's child."""


def main():
    box = sys.argv[1]
    with open(os.path.join(box, "job.marshal"), "rb") as f:
        job = marshal.loads(f.read())
    chan = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.close(devnull)
    run(job, chan, tuple(job.get("rpc") or ()))


def run(job, chan, rpc=()):
    """Everything after the job is read: limits, the compile step, every case, the records."""
    if job["mode"] != "stdio":
        global json
        import json
    set_limits(job["rlimits"])
    prctl(_PR_SET_DUMPABLE, 0)
    prctl(_PR_SET_CHILD_SUBREAPER, 1)
    report = Reporter(chan)
    report.send({"t": "start"})
    code, ok = prepare(job, report)
    if ok:
        for i, case in enumerate(job["cases"]):
            report.send(run_case(i, case, code, job, rpc))
    report.send({"t": "done"})


class Reporter:
    def __init__(self, fd):
        self.fd = fd

    def send(self, record):
        data = ("{" + ", ".join(f'"{k}": {to_json(v)}' for k, v in record.items()) + "}\n").encode()
        while data:
            data = data[os.write(self.fd, data):]


def set_limits(lim):
    """Limits every process of the sandbox inherits; the address space is set per child."""
    for which, value in ((resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, lim["nproc"]),
                         (resource.RLIMIT_FSIZE, lim["fsize"]), (resource.RLIMIT_NOFILE, lim["nofile"]),
                         (resource.RLIMIT_AS, max(lim["as"], lim["compile_as"]))):
        resource.setrlimit(which, (value, value))


def to_json(v):
    """JSON of a record value: None, bool, int, finite float, or a base64/identifier string."""
    if v is None:
        return "null"
    if v is True or v is False:
        return "true" if v else "false"
    if type(v) is str:
        return '"' + v + '"'
    return repr(v)


def prctl(option, value):
    try:
        import ctypes

        return ctypes.CDLL(None).prctl(option, value, 0, 0, 0) == 0
    except Exception:
        return False


def prepare(job, report):
    """Compile the program; report it; return (python code object or None, ok)."""
    lang = job["lang"]
    if lang["kind"] == "python":
        try:
            code = compile(job["program"], "main.py", "exec")
        except BaseException as e:  # SyntaxError, ValueError (NUL bytes), RecursionError...
            report.send({"t": "compile", "ok": False, "err": b64(f"{type(e).__name__}: {e}"[:ERR_CAP].encode())})
            return None, False
        report.send({"t": "compile", "ok": True, "err": ""})
        return code, True
    if not lang.get("compile"):
        report.send({"t": "compile", "ok": True, "err": ""})
        return None, True
    rec = spawn(lambda: exec_child(lang["compile"]), b"", job["compile_cpu_s"], job["compile_wall_s"], 1 << 16,
                job["rlimits"]["compile_as"])
    kill_descendants()
    ok = rec["st"] == "ok"
    err = decode_b64(rec["err"]) or decode_b64(rec["out"])
    if rec["st"] == "timeout":
        err = "compiler timed out\n" + err
    report.send({"t": "compile", "ok": ok, "err": b64(err[:ERR_CAP].encode())})
    return None, ok


def decode_b64(s):
    return binascii.a2b_base64(s).decode("utf-8", "replace")


def run_case(i, case, code, job, rpc):
    mode, keep, res = job["mode"], (), None
    if job["lang"]["kind"] != "python":
        body = lambda: exec_child(job["lang"]["run"])  # noqa: E731
    elif mode == "check":
        keep = rpc
        body = lambda: check_child(code, job, rpc)  # noqa: E731
    else:
        res = os.pipe() if mode != "stdio" else None
        keep = (res[1],) if res else ()
        body = lambda: python_child(code, mode, case, job, res[1] if res else None)  # noqa: E731
    stdin = case.get("input", "").encode() if mode == "stdio" else b""
    try:
        rec = spawn(body, stdin, job["cpu_s"], job["wall_s"], job["out_cap"], job["rlimits"]["as"], keep, res)
    except OSError as e:  # cannot fork or make pipes: the test fails, the harness goes on
        rec = {"st": "exit", "rc": 126, "sig": 0, "wall": 0.0, "cpu": 0.0, "out": "",
               "err": b64(f"harness: {e}".encode()), "res": None}
    kill_descendants()
    rec.update({"t": "case", "i": i})
    return rec


def kill_descendants():
    """SIGKILL every process below the harness (a test's daemons reparent here) and reap them."""
    me = os.getpid()
    for _ in range(1000):
        below = descendants(me)
        for pid in below:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        reap()
        if not below:
            return
        time.sleep(0.0005)


def descendants(root):
    """Pids of the live (non-zombie) processes below `root`, from /proc."""
    children = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] != b"Z":
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            out.append(pid)
            todo.append(pid)
    return out


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def spawn(body, stdin, cpu_s, wall_s, out_cap, mem_bytes, keep=(), res=None):
    """Fork a child running `body()`; collect its output with caps and a wall deadline.

    `keep` are descriptors the child keeps (and the harness closes); `res` the result pipe.
    """
    in_fd = os.memfd_create("stdin")
    os.write(in_fd, stdin)
    os.lseek(in_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    try:
        pid = os.fork()
    except OSError:
        for fd in (in_fd, out_r, out_w, err_r, err_w) + tuple(res or ()):
            os.close(fd)
        raise
    if pid == 0:
        child_setup(in_fd, out_w, err_w, keep, cpu_s, mem_bytes)
        try:
            body()
        finally:
            os._exit(70)
    for fd in (in_fd, out_w, err_w) + tuple(keep):
        os.close(fd)
    res_r = res[0] if res else None
    bufs, status = collect(pid, {out_r: out_cap, err_r: ERR_CAP, res_r: out_cap}, start + wall_s, err_r)
    return finish(pid, status, bufs, out_r, err_r, res_r, start)


def child_setup(in_fd, out_w, err_w, keep, cpu_s, mem_bytes):
    os.setpgid(0, 0)
    os.dup2(in_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, 1 << 16)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if GUARD is not None and not GUARD(os.getppid()):
        os._exit(71)  # the harness could not be protected: run nothing
    limit = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))
    resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))


def collect(pid, caps, deadline, err_fd):
    """Read the child's pipes until EOF or the deadline; returns (bytes per fd, status).

    stderr past its cap is dropped; stdout or a result past its cap ends the test.
    """
    caps = {fd: cap for fd, cap in caps.items() if fd is not None}
    bufs = {fd: bytearray() for fd in caps}
    open_fds = set(caps)
    status, exited_at = "ok", None
    while open_fds:
        now = time.monotonic()
        if now >= deadline:
            status = "timeout"
            break
        if exited_at is None and os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > 0.05:
            break  # a background process holds the pipes open; the test is over
        ready, _, _ = select.select(list(open_fds), [], [], min(0.02, deadline - now))
        for fd in ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.discard(fd)
            elif len(bufs[fd]) + len(chunk) <= caps[fd]:
                bufs[fd] += chunk
            elif fd == err_fd:
                bufs[fd] += chunk[: caps[fd] - len(bufs[fd])]
            else:
                status = "output_limit"
                open_fds.clear()
                break
    return bufs, status


def finish(pid, status, bufs, out_r, err_r, res_r, start):
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
    _, wstatus, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    for fd in (out_r, err_r, res_r):
        if fd is not None:
            os.close(fd)
    rc, sig = 0, 0
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
    else:
        rc = os.WEXITSTATUS(wstatus)
    if status == "ok" and sig:
        status = "signal"
    elif status == "ok" and rc:
        status = "exit"
    res = bytes(bufs[res_r]) if res_r is not None else b""
    complete = status == "ok" and res.endswith(b"\n") and res.count(b"\n") == 1
    return {"st": status, "rc": rc, "sig": sig, "wall": round(wall, 6),
            "cpu": round(usage.ru_utime + usage.ru_stime, 6),
            "out": b64(bytes(bufs[out_r])), "err": b64(bytes(bufs[err_r])),
            "res": b64(res[:-1]) if complete else None}


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def exec_child(argv):
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        os.write(2, f"cannot exec {argv[0]}: {e}".encode())
    os._exit(127)


def load_program(code, name):
    """Run the program's module in this child; its globals. Exits the child if the program does."""
    sys.argv = ["main.py"]
    g = {"__name__": name, "__builtins__": builtins, "__file__": "main.py"}
    try:
        exec(code, g)
    except SystemExit as e:
        end(exit_code(e.code))
    except BaseException:
        print_exception()
        end(1)
    return g


def python_child(code, mode, case, job, res_fd):
    """Run the program in this forked child; in call/exprs mode, send back its values."""
    g = load_program(code, "__main__" if mode == "stdio" else "solution")
    if mode == "stdio":
        end(0)
    try:
        values = evaluate(mode, case, job, g)
        text = json.dumps(values)
    except SystemExit as e:
        end(exit_code(e.code))
    except BaseException:
        print_exception()
        end(1)
    write_all(res_fd, text.encode() + b"\n")
    end(0)


def evaluate(mode, case, job, g):
    if mode == "call":
        fn = find_function(g, job["fn"])
        return encode(fn(*case.get("args", []), **case.get("kwargs", {})), 0)
    if job.get("setup"):
        exec(compile(job["setup"], "<setup>", "exec"), g)
    return [encode(eval(compile(src, "<test>", "eval"), g), 0) for src in case["exprs"]]


def find_function(g, name):
    """The program's function `name`: a module-level callable, else a method of `Solution()`."""
    fn = g.get(name)
    if fn is None and isinstance(g.get("Solution"), type):
        fn = getattr(g["Solution"](), name, None)
    if not callable(fn):
        raise NameError(f"the program defines no function {name!r}")
    return fn


def check_child(code, job, rpc):
    """Check mode: load the program, say ready, then answer the parent's calls until EOF."""
    req, rep = rpc
    g = load_program(code, "solution")
    try:
        fn = find_function(g, job["fn"])
    except BaseException:
        print_exception()
        end(1)
    write_all(rep, b'{"k": "ready"}\n')
    while True:
        frame = read_frame(req)
        if frame is None:
            end(0)
        args, kwargs = marshal.loads(frame)
        write_all(rep, answer(fn, args, kwargs).encode() + b"\n")


def answer(fn, args, kwargs):
    """One reply line: the call's value, the builtin exception it raised, or why it has none."""
    try:
        value = fn(*args, **kwargs)
    except SystemExit as e:
        end(exit_code(e.code))
    except BaseException as e:
        name = builtin_exception(e)
        if name is None:  # KeyboardInterrupt, GeneratorExit...: the program ends without a result
            end(1)
        return json.dumps({"k": "e", "n": name, "m": message(e)})
    try:
        return json.dumps({"k": "r", "v": encode(value, 0)})
    except (TypeError, ValueError, RecursionError) as e:
        return json.dumps({"k": "bad", "m": message(e)})


def builtin_exception(e):
    """Name of the first real builtin Exception class in the MRO of e's class ("Exception" at worst)."""
    try:
        for cls in type(e).__mro__:
            for known in _EXCEPTIONS:
                if cls is known:
                    return known.__name__
    except BaseException:
        return "Exception"
    return None


def message(e):
    try:
        return str(e)[:MSG_CAP]
    except BaseException:
        return ""


def read_frame(fd):
    head = read_exact(fd, 4)
    if head is None:
        return None
    return read_exact(fd, int.from_bytes(head, "big"))


def read_exact(fd, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def write_all(fd, data):
    while data:
        data = data[os.write(fd, data):]


def print_exception():
    try:
        import traceback

        traceback.print_exc()
    except BaseException:
        pass


def end(rc):
    """Flush the program's stdio and leave this child now (no atexit, no finally of the program)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(rc)


def exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(str(code) + "\n")
    except Exception:
        pass
    return 1


def encode(v, depth):
    """Exact plain types only, in the tagged encoding described at the top of this file."""
    if depth > MAX_DEPTH:
        raise ValueError("result nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is float or t is str:
        return v
    if t is list:
        return [encode(x, depth + 1) for x in v]
    if t is tuple:
        return {"T": [encode(x, depth + 1) for x in v]}
    if t is set or t is frozenset:
        return {"S": [encode(x, depth + 1) for x in v], "f": t is frozenset}
    if t is dict:
        return {"D": [[encode(k, depth + 1), encode(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"B": v.hex()}
    raise TypeError(f"non-plain result type {t.__name__}")


if __name__ == "__main__":
    main()
