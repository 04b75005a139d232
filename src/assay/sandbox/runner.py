"""Running one untrusted program, with all its test cases, in one sandbox.

The trusted side of the harness protocol (`harness.py`): write the program, the harness and
the job (inputs only) to a fresh directory, start `bwrap` as the worker's slot uid with
resource limits, stream the harness's records with a byte cap and a wall-clock deadline,
SIGKILL the whole tree when either is exceeded, and parse the records defensively: nothing
the program prints can raise here.

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

from assay.sandbox import isolation

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
        result: the raw JSON text of a call/expression result, or None.
    """

    status: str = "missing"
    rc: int = 0
    sig: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    stdout: bytes = b""
    stderr: str = ""
    result: str | None = None


@dataclass
class ProgramResult:
    """The outcome of one sandboxed program.

    Attributes:
        compiled: False when the program did not compile (syntax error for Python).
        compile_error: the compiler's message, truncated.
        cases: one record per test case, in order `[N]`.
        status: "ok", "timeout" (whole-program deadline), "output_limit", or "sandbox_error"
            (the infrastructure failed: not the program's fault).
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
        mode: "stdio", "call" or "exprs".
        cases: per-case inputs `[N]`: {"input": str} | {"args", "kwargs"} | {"exprs": [str]}.
        fn: function name for "call" mode.
        setup: trusted code run after the program and before expressions ("exprs" mode).
        limits: the resource limits.
    """

    lang: dict[str, Any]
    source: str
    mode: str
    cases: list[dict[str, Any]]
    fn: str = ""
    setup: str = ""
    limits: Limits = field(default_factory=Limits)

    def deadline_s(self) -> float:
        """Wall seconds the whole sandbox may run: compile + every case + start-up margin."""
        lim = self.limits
        compile_s = 1.5 * lim.compile_cpu_s + 1 if self.lang.get("compile") else 0.0
        return compile_s + len(self.cases) * (float(lim.wall_s or 0) + 0.1) + 3.0


def run_job(job: Job, iso: isolation.Isolation, uid: int) -> ProgramResult:
    """Run `job` in a sandbox as `uid`; never raises for anything the program does."""
    box = tempfile.mkdtemp(prefix="assay-box-")
    scratch = tempfile.mkdtemp(prefix="assay-tmp-") if iso.kind == "none" else ""
    start = time.monotonic()
    try:
        write_box(box, job, uid, pid_namespace=iso.kind == "bwrap")
        if scratch and os.geteuid() == 0:
            os.chown(scratch, uid, uid)
        argv = command(job, iso, box, scratch)
        raw, status, error = execute(argv, job, uid, scratch or None)
    except OSError as e:
        return ProgramResult(status="sandbox_error", error=f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(box, ignore_errors=True)
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        isolation.clear_uid(uid)
    result = parse_records(raw, len(job.cases))
    result.wall_s = round(time.monotonic() - start, 6)
    if status != "ok":
        result.status, result.error = status, error
    elif not raw.startswith(b'{"t": "start"}'):  # sent before the harness reads the program
        result.status, result.error = "sandbox_error", f"the sandbox did not start: {error}"
    elif b'"t": "compile"' not in raw:  # the program's source crashed the harness's compiler
        result.compile_error = result.compile_error or "the harness died while compiling the program"
    return result


def write_box(box: str, job: Job, uid: int, pid_namespace: bool = True) -> None:
    """The program, the harness and the job (inputs and limits only), readable by the slot uid."""
    lim = job.limits
    rlimits = {"nproc": isolation.nproc_limit(lim.nproc, uid), "fsize": lim.fsize_mb << 20, "nofile": lim.nofile,
               "as": lim.memory_mb << 20, "compile_as": lim.compile_memory_mb << 20}
    spec = {"lang": job.lang, "source": job.lang["source"], "mode": job.mode, "cases": job.cases,
            "fn": job.fn, "setup": job.setup, "cpu_s": lim.cpu_s, "wall_s": lim.wall_s,
            "out_cap": lim.output_bytes, "compile_cpu_s": lim.compile_cpu_s,
            "compile_wall_s": 1.5 * lim.compile_cpu_s + 1, "rlimits": rlimits, "own_pid_namespace": pid_namespace}
    files = {"job.marshal": marshal.dumps(spec), job.lang["source"]: job.source.encode("utf-8", "surrogatepass"),
             "harness.py": _harness_source()}
    for name, data in files.items():
        with open(os.path.join(box, name), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(box, name), 0o644)
    os.chmod(box, 0o755)


_HARNESS: bytes | None = None


def _harness_source() -> bytes:
    global _HARNESS
    if _HARNESS is None:
        with open(HARNESS_PATH, "rb") as f:
            _HARNESS = f.read()
    return _HARNESS


def command(job: Job, iso: isolation.Isolation, box: str, scratch: str) -> list[str]:
    """The argv that starts the harness: inside bwrap, or bare under the unsafe opt-out."""
    python = job.lang.get("harness_python", HARNESS_PYTHON)
    if iso.kind == "bwrap":
        prefix = isolation.bwrap_prefix(str(iso.bwrap), box, job.limits.tmpfs_mb << 20, SANDBOX_ENV)
        return prefix + [python, "-I", "-S", "/box/harness.py", "/box"]
    return [python, "-I", "-S", os.path.join(box, "harness.py"), box]


def execute(argv: list[str], job: Job, uid: int, cwd: str | None) -> tuple[bytes, str, str]:
    """Start `argv` as `uid`; return (report bytes, status, error).

    The resource limits are set by the harness on itself before any program code runs (no
    `preexec_fn`, so the worker can use vfork); this side enforces the deadline and the cap.
    """
    lim = job.limits
    kw: dict[str, Any] = {}
    if os.geteuid() == 0:
        kw = {"user": uid, "group": uid, "extra_groups": []}
    env = SANDBOX_ENV | ({"TMPDIR": cwd, "HOME": cwd} if cwd else {})
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=cwd or "/", env=env, start_new_session=True, **kw)
    cap = len(job.cases) * (lim.output_bytes * 4 // 3 + 8192) + (1 << 16)
    raw, err, status = stream(proc, cap, time.monotonic() + job.deadline_s())
    _kill_tree(proc)
    message = {"timeout": "program exceeded its deadline", "output_limit": "program exceeded its output cap"}
    return raw, status, message.get(status, err.decode(errors="replace")[:500])


def stream(proc: subprocess.Popen, cap: int, deadline: float) -> tuple[bytes, bytes, str]:
    """Read stdout (up to `cap`) and stderr (first 4 KiB) until EOF or `deadline`."""
    sel = selectors.DefaultSelector()
    assert proc.stdout is not None and proc.stderr is not None
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    out, err, status = bytearray(), bytearray(), "ok"
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            status = "timeout"
            break
        for key, _ in sel.select(timeout=min(left, 0.5)):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
            elif key.fileobj is proc.stdout:
                out += chunk
                if len(out) > cap:
                    status = "output_limit"
            elif len(err) < 4096:
                err += chunk
        if status != "ok":
            break
    sel.close()
    return bytes(out), bytes(err), status


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
