"""The in-sandbox harness: compiles the program once, then forks one child per test case.

This file is copied into the sandbox and run there as `python3 -I -S /box/harness.py BOX`
with only the standard library (it never imports assay). It reads `BOX/job.marshal`
(plain data written by the trusted parent; marshal because it imports in no time), which
holds the program's *inputs* only: expected outputs never enter the sandbox, and the trusted
parent compares what comes back. The harness makes itself non-dumpable, so a test's code
cannot ptrace it or open its `/proc/<pid>/fd` to forge records, and each child closes the
harness's report channel before the untrusted code runs.

Job fields: `lang` (`kind` "python" to exec the source in the forked child, or "exec" to
run `run` after an optional `compile` argv), `source` (file name in BOX), `mode` ("stdio",
"call" with `fn`, or "exprs" with an optional trusted `setup`), `cases` (one dict each:
`input`, or `args`/`kwargs`, or `exprs`), `cpu_s`, `wall_s`, `out_cap`, `compile_cpu_s`,
`compile_wall_s`, `own_pid_namespace`, `rlimits` (nproc, fsize, nofile, as, compile_as: set by the harness on
itself before any program code runs, so every process of the sandbox inherits them).

Records, one JSON object per line on the report channel (the harness's original stdout):
    {"t": "start"}
    {"t": "compile", "ok": bool, "err": base64}
    {"t": "case", "i": int, "st": "ok"|"exit"|"signal"|"timeout"|"output_limit",
     "rc": int, "sig": int, "wall": s, "cpu": s, "out": base64, "err": base64, "res": base64|None}
Every string in a record is base64, so records are written without the json module (whose
import costs more than the rest of a trivial test); `json` is imported only for call and
expression tests.
    {"t": "done"}
Call and expression results are JSON in a tagged encoding that accepts only exact plain
types (an `int` subclass with a rigged `__eq__` is refused): lists as lists, `{"T": [...]}`
tuples, `{"S": [...], "f": bool}` sets, `{"D": [[k, v], ...]}` dicts, `{"B": hex}` bytes.
"""

import binascii
import builtins
import marshal
import os
import resource
import select
import sys
import time

ERR_CAP = 4096
MAX_DEPTH = 200


def main():
    box = sys.argv[1]
    with open(os.path.join(box, "job.marshal"), "rb") as f:
        job = marshal.loads(f.read())
    if job["mode"] != "stdio":
        global json
        import json
    set_limits(job["rlimits"])
    chan = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    make_nondumpable()
    report = Reporter(chan)
    report.send({"t": "start"})
    lang = job["lang"]
    src_path = os.path.join(box, job["source"])
    code, ok = prepare(lang, src_path, job, report)
    if ok:
        for i, case in enumerate(job["cases"]):
            report.send(run_case(i, case, code, lang, job))
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


def make_nondumpable():
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:
        pass


def prepare(lang, src_path, job, report):
    """Compile the program; report it; return (python code object or None, ok)."""
    if lang["kind"] == "python":
        try:
            with open(src_path, "rb") as f:
                code = compile(f.read(), "main.py", "exec")
        except BaseException as e:  # SyntaxError, ValueError (NUL bytes), RecursionError...
            report.send({"t": "compile", "ok": False, "err": b64(f"{type(e).__name__}: {e}"[:ERR_CAP].encode())})
            return None, False
        report.send({"t": "compile", "ok": True, "err": ""})
        return code, True
    if not lang.get("compile"):
        report.send({"t": "compile", "ok": True, "err": ""})
        return None, True
    rec = spawn(lambda fd: exec_child(lang["compile"]), b"", job["compile_cpu_s"], job["compile_wall_s"], 1 << 16,
                job["rlimits"]["compile_as"])
    ok = rec["st"] == "ok"
    err = decode_b64(rec["err"]) or decode_b64(rec["out"])
    if rec["st"] == "timeout":
        err = "compiler timed out\n" + err
    report.send({"t": "compile", "ok": ok, "err": b64(err[:ERR_CAP].encode())})
    return None, ok


def decode_b64(s):
    return binascii.a2b_base64(s).decode("utf-8", "replace")


def run_case(i, case, code, lang, job):
    mode = job["mode"]
    if lang["kind"] == "python":
        body = lambda res_fd: python_child(code, mode, case, job, res_fd)  # noqa: E731
    else:
        body = lambda res_fd: exec_child(lang["run"])  # noqa: E731
    stdin = case.get("input", "").encode() if mode == "stdio" else b""
    try:
        rec = spawn(body, stdin, job["cpu_s"], job["wall_s"], job["out_cap"], job["rlimits"]["as"],
                    want_result=mode != "stdio")
    except OSError as e:  # cannot fork or make pipes: the test fails, the harness goes on
        rec = {"st": "exit", "rc": 126, "sig": 0, "wall": 0.0, "cpu": 0.0, "out": "",
               "err": b64(f"harness: {e}".encode()), "res": None}
    if job["own_pid_namespace"]:
        kill_leftovers()
    rec.update({"t": "case", "i": i})
    return rec


def kill_leftovers():
    """SIGKILL every process of this sandbox but its init and the harness (daemons of a test).

    Only inside bwrap's pid namespace: outside it, kill(-1) would reach the user's processes.
    """
    try:
        os.kill(-1, 9)
    except OSError:
        pass


def spawn(body, stdin, cpu_s, wall_s, out_cap, mem_bytes, want_result=False):
    """Fork a child running `body(res_fd)`; collect its output with caps and a wall deadline."""
    in_fd = os.memfd_create("stdin")
    os.write(in_fd, stdin)
    os.lseek(in_fd, 0, os.SEEK_SET)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    res_r, res_w = os.pipe() if want_result else (None, None)
    start = time.monotonic()
    try:
        pid = os.fork()
    except OSError:
        for fd in (in_fd, out_r, out_w, err_r, err_w, res_r, res_w):
            if fd is not None:
                os.close(fd)
        raise
    if pid == 0:
        child_setup(in_fd, out_w, err_w, res_w, cpu_s, mem_bytes)
        try:
            body(res_w)
        finally:
            os._exit(70)
    for fd in (in_fd, out_w, err_w, res_w):
        if fd is not None:
            os.close(fd)
    bufs, status = collect(pid, {out_r: out_cap, err_r: ERR_CAP, res_r: out_cap}, start + wall_s, err_r)
    return finish(pid, status, bufs, out_r, err_r, res_r, start)


def child_setup(in_fd, out_w, err_w, res_w, cpu_s, mem_bytes):
    os.setpgid(0, 0)
    os.dup2(in_fd, 0)
    os.dup2(out_w, 1)
    os.dup2(err_w, 2)
    keep = res_w if res_w is not None else -1
    for fd in range(3, 1024):
        if fd != keep:
            try:
                os.close(fd)
            except OSError:
                pass
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
    res = bytes(bufs[res_r]) if res_r is not None else None
    return {"st": status, "rc": rc, "sig": sig, "wall": round(wall, 6),
            "cpu": round(usage.ru_utime + usage.ru_stime, 6),
            "out": b64(bytes(bufs[out_r])), "err": b64(bytes(bufs[err_r])),
            "res": b64(res) if res is not None and status == "ok" else None}


def b64(data):
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def exec_child(argv):
    try:
        os.execv(argv[0], argv)
    except OSError as e:
        os.write(2, f"cannot exec {argv[0]}: {e}".encode())
    os._exit(127)


def python_child(code, mode, case, job, res_fd):
    """Run the program in this forked child; in call/exprs mode, send back its values."""
    sys.argv = ["main.py"]
    g = {"__name__": "__main__", "__builtins__": builtins, "__file__": "main.py"}
    if mode != "stdio":
        g["__name__"] = "solution"
    rc = 0
    try:
        exec(code, g)
        if mode != "stdio":
            values = evaluate(mode, case, job, g)
            send_result(res_fd, json.dumps(values))
    except SystemExit as e:
        rc = exit_code(e.code)
    except BaseException:
        import traceback

        traceback.print_exc()
        rc = 1
    flush_std()
    os._exit(rc)


def evaluate(mode, case, job, g):
    if mode == "call":
        fn = g.get(job["fn"])
        if fn is None:
            raise NameError(f"the program defines no {job['fn']!r}")
        return encode(fn(*case.get("args", []), **case.get("kwargs", {})), 0)
    if job.get("setup"):
        exec(compile(job["setup"], "<setup>", "exec"), g)
    return [encode(eval(compile(src, "<test>", "eval"), g), 0) for src in case["exprs"]]


def send_result(fd, text):
    data = text.encode()
    while data:
        data = data[os.write(fd, data):]


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


def flush_std():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


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
