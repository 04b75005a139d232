"""Running one untrusted program, with all its test cases, in a sandbox.

The trusted side of the harness protocol (`harness.py`). This module holds what both ways of
running a program share: the job and its limits, the plain spec that enters the sandbox
(inputs only), reading the harness's records with a byte cap and a deadline, driving a
check test's calls (`check.py`) while the program runs, and parsing the records
defensively: nothing the program prints can raise here. It also runs a program the first
way, in a fresh sandbox of its own (`run_job`): write the program, the harness and the job
to a fresh directory, start `bwrap` as the worker's slot uid, stream, SIGKILL the whole tree.
The second way, a fork server per worker, is `forkserver.py`.

    >>> from assay.sandbox.runner import Limits
    >>> Limits(cpu_s=1.0).wall_s
    2.5
"""

from __future__ import annotations

import json
import marshal
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from assay.sandbox import check, isolation, seccomp

HARNESS_PATH = os.path.join(os.path.dirname(__file__), "harness.py")
HARNESS_PYTHON = "/usr/bin/python3"
"""The interpreter of the in-sandbox harness (and of Python programs): the system Python, under
the read-only `/usr`, not the project's virtual environment."""
SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@dataclass
class Limits:
    """Resource limits of one sandboxed program.

    Attributes:
        cpu_s: CPU seconds per test case (RLIMIT_CPU of each test's process).
        wall_s: wall-clock seconds per test case; None means 2 × cpu_s + 0.5.
        memory_mb: address-space limit of every process (RLIMIT_AS), MiB.
        nproc: processes and threads the slot uid may have at once (RLIMIT_NPROC).
        fsize_mb: largest file a process may write (RLIMIT_FSIZE), MiB.
        nofile: open file descriptors per process (RLIMIT_NOFILE).
        tmpfs_mb: size of the scratch directory `/tmp`, MiB.
        output_bytes: stdout (or result) bytes per test case before the test is stopped.
        compile_cpu_s: CPU seconds for the compile step of compiled languages.
        compile_memory_mb: address-space limit while compiling, MiB.
    """

    cpu_s: float = 2.0
    wall_s: float | None = None
    memory_mb: int = 512
    nproc: int = 8
    fsize_mb: int = 16
    nofile: int = 64
    tmpfs_mb: int = 64
    output_bytes: int = 1 << 20
    compile_cpu_s: float = 20.0
    compile_memory_mb: int = 2048

    def __post_init__(self) -> None:
        if self.wall_s is None:
            self.wall_s = 2 * self.cpu_s + 0.5


@dataclass
class CaseRecord:
    """What the harness reported about one test case (all fields are plain and bounded).

    Attributes:
        status: "ok", "exit" (non-zero exit), "signal", "timeout", "output_limit" or
            "missing" (no record: the program killed the harness or the sandbox was stopped).
        rc, sig: exit code and terminating signal of the test's process.
        wall, cpu: seconds, measured by the harness.
        stdout: the test's standard output (at most `Limits.output_bytes`).
        stderr: the first 4 KiB of its standard error.
        result: the raw JSON text of a call/expression result, or None (no result).
        check: for a check test, the verdict of `check.run_check` (None: the test never ran).
        calls: for a check test, the calls it made to the program.
        note: for a check test, the verdict's message.
    """

    status: str = "missing"
    rc: int = 0
    sig: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    stdout: bytes = b""
    stderr: str = ""
    result: str | None = None
    check: str | None = None
    calls: int = 0
    note: str = ""


@dataclass
class ProgramResult:
    """The outcome of one sandboxed program.

    Attributes:
        compiled: False when the program did not compile (syntax error for Python).
        compile_error: the compiler's message, truncated.
        cases: one record per test case, in order `[N]`.
        status: "ok", "timeout" (whole-program deadline), "output_limit", "sandbox_error"
            (the infrastructure failed: not the program's fault) or "test_error" (the row's
            check test cannot run; not the program's fault either).
        error: what went wrong, when status is not "ok".
        wall_s: seconds the whole sandbox ran.
    """

    compiled: bool = False
    compile_error: str = ""
    cases: list[CaseRecord] = field(default_factory=list)
    status: str = "ok"
    error: str = ""
    wall_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Job:
    """One program to run: the language (a dict from `languages.LANGUAGES`), source and cases.

    Attributes:
        lang: {"kind": "python"|"exec", "source": file name, "compile": argv|None, "run": argv}.
        source: the program text.
        mode: "stdio", "call", "exprs" or "check".
        cases: per-case inputs `[N]`: {"input": str} | {"args", "kwargs"} | {"exprs": [str]} | {} (check).
        fn: function name for "call" and "check" modes.
        setup: trusted code run after the program and before expressions ("exprs" mode).
        limits: the resource limits.
        check: the check test ("check" mode; one case). It stays in the trusted parent.
    """

    lang: dict[str, Any]
    source: str
    mode: str
    cases: list[dict[str, Any]]
    fn: str = ""
    setup: str = ""
    limits: Limits = field(default_factory=Limits)
    check: check.CheckSpec | None = None

    def deadline_s(self) -> float:
        """Wall seconds the whole sandbox may run: compile + every case + start-up margin."""
        lim = self.limits
        compile_s = 1.5 * lim.compile_cpu_s + 1 if self.lang.get("compile") else 0.0
        return compile_s + len(self.cases) * (float(lim.wall_s or 0) + 0.1) + 3.0


def job_spec(job: Job, uid: int, forked: bool = False) -> dict[str, Any]:
    """What enters the sandbox: the program, inputs and limits; never expected values or the check.

    `forked`: the job runs in a fork server's child, one more process of the slot uid.
    """
    lim = job.limits
    nproc = isolation.nproc_limit(lim.nproc, uid) + int(forked)
    rlimits = {"nproc": nproc, "fsize": lim.fsize_mb << 20, "nofile": lim.nofile, "as": lim.memory_mb << 20,
               "compile_as": lim.compile_memory_mb << 20}
    spec = {"lang": job.lang, "source": job.lang["source"], "mode": job.mode, "cases": job.cases,
            "fn": job.fn, "setup": job.setup, "cpu_s": lim.cpu_s, "wall_s": lim.wall_s,
            "out_cap": lim.output_bytes, "compile_cpu_s": lim.compile_cpu_s,
            "compile_wall_s": 1.5 * lim.compile_cpu_s + 1, "rlimits": rlimits}
    if job.lang["kind"] == "python":
        spec["program"] = job.source.encode("utf-8", "surrogatepass")
    return spec


class RpcPipes:
    """The two pipes of a check test: requests to the program, replies from it."""

    def __init__(self) -> None:
        self.req_r, self.req_w = os.pipe()
        self.rep_r, self.rep_w = os.pipe()
        self._open = {self.req_r, self.req_w, self.rep_r, self.rep_w}

    def child_ends(self) -> tuple[int, int]:
        return self.req_r, self.rep_w

    def close_child_ends(self) -> None:
        self._close(self.req_r, self.rep_w)

    def close(self) -> None:
        self._close(self.req_w, self.rep_r)

    def _close(self, *fds: int) -> None:
        """Close each fd once (a number closed twice could belong to a newer descriptor)."""
        for fd in fds:
            if fd in self._open:
                self._open.discard(fd)
                _close(fd)


def _close(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class ReportStream:
    """Reads the harness's records from `fd` with a byte cap and a deadline (and 4 KiB of `err_fd`)."""

    def __init__(self, fd: int, cap: int, deadline: float, err_fd: int | None = None) -> None:
        self.fd, self.cap, self.deadline = fd, cap, deadline
        self.out, self.err, self.status = bytearray(), bytearray(), "ok"
        self.sel = selectors.DefaultSelector()
        for f in (fd, err_fd):
            if f is not None:
                self.sel.register(f, selectors.EVENT_READ)

    def read(self, until: bytes | None = None) -> None:
        """Read until a record containing `until` arrived, or every fd ended, the deadline or the cap."""
        while self.sel.get_map() and self.status == "ok":
            if until is not None and until in self.out:
                return
            left = self.deadline - time.monotonic()
            if left <= 0:
                self.status = "timeout"
                break
            for key, _ in self.sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    self.sel.unregister(key.fd)
                elif key.fd == self.fd:
                    self.out += chunk
                    if len(self.out) > self.cap:
                        self.status = "output_limit"
                elif len(self.err) < 4096:
                    self.err += chunk

    def close(self) -> None:
        self.sel.close()


def report_cap(job: Job) -> int:
    return len(job.cases) * (job.limits.output_bytes * 4 // 3 + 8192) + (1 << 16)


def drive(job: Job, stream: ReportStream, rpc: RpcPipes | None, deadline: float) -> check.Outcome | None:
    """Read the records to the end; for a check test, run the check once the program compiled."""
    outcome = None
    if rpc is not None and job.check is not None:
        stream.read(until=b'"t": "compile"')
        if stream.status == "ok" and b'"t": "compile", "ok": true' in stream.out:
            cap = job.limits.output_bytes * 4 // 3 + 8192
            outcome = check.run_check(job.check, check.Channel(rpc.req_w, rpc.rep_r, deadline, cap))
        rpc.close()
    stream.read()
    stream.close()
    return outcome


def build_result(raw: bytes, status: str, err: str, job: Job, outcome: check.Outcome | None,
                 started: float) -> ProgramResult:
    """The `ProgramResult` of a finished run, from its records and what the parent saw."""
    result = parse_records(raw, len(job.cases))
    result.wall_s = round(time.monotonic() - started, 6)
    message = {"timeout": "program exceeded its deadline", "output_limit": "program exceeded its output cap"}
    if status != "ok":
        result.status, result.error = status, message.get(status, err)
    elif not raw.startswith(b'{"t": "start"}'):  # sent before the harness reads the program
        result.status, result.error = "sandbox_error", f"the sandbox did not start: {err}"
    elif b'"t": "compile"' not in raw:  # the program's source crashed the harness's compiler
        result.compile_error = result.compile_error or "the harness died while compiling the program"
    if outcome is not None and result.cases:
        case = result.cases[0]
        case.check, case.calls, case.note = outcome.verdict, outcome.calls, outcome.message
        if outcome.verdict == "test_error":
            result.status, result.error = "test_error", outcome.message
    return result


def run_job(job: Job, iso: isolation.Isolation, uid: int) -> ProgramResult:
    """Run `job` in a fresh sandbox of its own as `uid`; never raises for anything the program does."""
    box = tempfile.mkdtemp(prefix="assay-box-")
    scratch = tempfile.mkdtemp(prefix="assay-tmp-") if iso.kind == "none" else ""
    start = time.monotonic()
    rpc = RpcPipes() if job.mode == "check" else None
    try:
        write_box(box, job, uid, rpc)
        if scratch and os.geteuid() == 0:
            os.chown(scratch, uid, uid)
        raw, status, error, outcome = execute(job, iso, box, scratch, uid, rpc)
    except OSError as e:
        return ProgramResult(status="sandbox_error", error=f"{type(e).__name__}: {e}")
    finally:
        if rpc is not None:
            rpc.close_child_ends()
            rpc.close()
        shutil.rmtree(box, ignore_errors=True)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        isolation.clear_uid(uid)
    return build_result(raw, status, error, job, outcome, start)


def write_box(box: str, job: Job, uid: int, rpc: RpcPipes | None = None) -> None:
    """The program, the harness and the job (inputs and limits only), readable by the slot uid."""
    spec = job_spec(job, uid)
    if rpc is not None:
        spec["rpc"] = list(rpc.child_ends())
    files = {"job.marshal": marshal.dumps(spec), job.lang["source"]: job.source.encode("utf-8", "surrogatepass"),
             "harness.py": harness_source()}
    for name, data in files.items():
        with open(os.path.join(box, name), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(box, name), 0o644)
    os.chmod(box, 0o755)


_SOURCES: dict[str, bytes] = {}


def harness_source(name: str = "harness.py") -> bytes:
    """The bytes of an in-sandbox file of this package (`harness.py`, `server.py`), cached."""
    if name not in _SOURCES:
        with open(os.path.join(os.path.dirname(HARNESS_PATH), name), "rb") as f:
            _SOURCES[name] = f.read()
    return _SOURCES[name]


def command(job: Job, iso: isolation.Isolation, box: str, seccomp_fd: int | None) -> list[str]:
    """The argv that starts the harness: inside bwrap, or bare under the unsafe opt-out."""
    python = job.lang.get("harness_python", HARNESS_PYTHON)
    if iso.kind == "bwrap":
        prefix = isolation.bwrap_prefix(str(iso.bwrap), box, job.limits.tmpfs_mb << 20, SANDBOX_ENV, seccomp_fd)
        return prefix + [python, "-I", "-S", "/box/harness.py", "/box"]
    return [python, "-I", "-S", os.path.join(box, "harness.py"), box]


def execute(job: Job, iso: isolation.Isolation, box: str, scratch: str, uid: int,
            rpc: RpcPipes | None) -> tuple[bytes, str, str, check.Outcome | None]:
    """Start the harness as `uid` and drive it; return (records, status, error, check outcome).

    The resource limits are set by the harness on itself before any program code runs (no
    `preexec_fn`, so the worker can use vfork); this side enforces the deadline and the cap.
    """
    kw: dict[str, Any] = {"user": uid, "group": uid, "extra_groups": []} if os.geteuid() == 0 else {}
    env = SANDBOX_ENV | ({"TMPDIR": scratch, "HOME": scratch} if scratch else {})
    sc_fd = seccomp.memfd() if iso.kind == "bwrap" else None
    pass_fds = tuple(fd for fd in (sc_fd, *(rpc.child_ends() if rpc else ())) if fd is not None)
    try:
        proc = subprocess.Popen(command(job, iso, box, sc_fd), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=scratch or "/", env=env, start_new_session=True,
                                pass_fds=pass_fds, **kw)
    finally:
        _close(*(fd for fd in (sc_fd,) if fd is not None))
    if rpc is not None:
        rpc.close_child_ends()
    assert proc.stdout is not None and proc.stderr is not None
    deadline = time.monotonic() + job.deadline_s()
    stream = ReportStream(proc.stdout.fileno(), report_cap(job), deadline, proc.stderr.fileno())
    outcome = drive(job, stream, rpc, deadline)
    _kill_tree(proc)
    return bytes(stream.out), stream.status, stream.err.decode(errors="replace")[:500], outcome


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's session (bwrap's pid namespace goes with it) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()
    isolation.reap_children()


def parse_records(raw: bytes, n_cases: int) -> ProgramResult:
    """Turn the harness's report into a `ProgramResult`; unknown or malformed lines are skipped."""
    result = ProgramResult(cases=[CaseRecord() for _ in range(n_cases)])
    seen: set[int] = set()
    for line in raw.split(b"\n"):
        rec = _load(line)
        if rec is None:
            continue
        if rec.get("t") == "compile":
            result.compiled = rec.get("ok") is True
            result.compile_error = _b64_text(rec.get("err"))
        elif rec.get("t") == "case":
            i = rec.get("i")
            if type(i) is int and 0 <= i < n_cases:
                result.cases[i] = CaseRecord(status="missing") if i in seen else _case(rec)
                seen.add(i)
    return result


def _load(line: bytes) -> dict[str, Any] | None:
    if not line.startswith(b"{"):
        return None
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return rec if isinstance(rec, dict) else None


def _b64_text(value: Any) -> str:
    import binascii

    try:
        return binascii.a2b_base64(str(value or ""), strict_mode=True)[:4096].decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        return ""


def _case(rec: dict[str, Any]) -> CaseRecord:
    import binascii

    def num(key: str) -> float:
        v = rec.get(key, 0)
        return float(v) if type(v) in (int, float) else 0.0

    try:
        stdout = binascii.a2b_base64(str(rec.get("out", "")), strict_mode=True)
        res = rec.get("res")
        result = binascii.a2b_base64(res, strict_mode=True).decode("utf-8", "replace") if isinstance(res, str) else None
    except (binascii.Error, ValueError):
        return CaseRecord(status="missing")
    status = rec.get("st")
    if status not in ("ok", "exit", "signal", "timeout", "output_limit"):
        status = "missing"
    return CaseRecord(status=status, rc=int(num("rc")), sig=int(num("sig")), wall=num("wall"), cpu=num("cpu"),
                      stdout=stdout, stderr=_b64_text(rec.get("err")), result=result)
