"""The trusted side of a fork server: start it, hand it programs, restart it on any fault.

Each sandbox worker owns one `ForkServer`: a bwrap sandbox (the same flags, seccomp filter
and slot uid as a sandbox per program) whose pid 2 is `server.py`, a pre-loaded interpreter
that forks a fresh child per program. Interpreter and bwrap start-up are paid once per
worker instead of once per program. The worker talks to it over a socket pair:

- `run`: the job (program, inputs, limits; never expected values) goes in a memfd, with the
  write end of a fresh report pipe and, for check tests, the two call pipes; the records
  come straight from the program's harness to this process, as with a fresh sandbox;
- `done <status> ok|tainted:<what>`: the server's answer once the program and everything
  it started are dead and the scratch directories are empty.

The server is restarted (a fresh bwrap, a fresh tmpfs, every process of the slot uid
killed) when it dies, does not answer in time, answers anything but `ok`, when a program ran
past its deadline or flooded its report, and when a job needs larger limits than the
running server was started with. A job whose program never started (the server was gone)
is retried once on a fresh server; a program that killed or stopped the server while it
ran keeps its own result (its missing records make it a crash).

    >>> ceilings(Limits(memory_mb=512, compile_memory_mb=2048, nproc=8), uid=61000)["rlimits"]["as"] >> 20
    2048
"""

from __future__ import annotations

import marshal
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

from assay.sandbox import isolation, seccomp
from assay.sandbox.runner import (HARNESS_PYTHON, SANDBOX_ENV, Job, Limits, ProgramResult, ReportStream, RpcPipes,
                                  build_result, drive, harness_source, job_spec, report_cap)

START_TIMEOUT_S = 30.0
"""Seconds a new server may take to load before the start counts as failed."""
DONE_TIMEOUT_S = 5.0
"""Seconds the server may take, after a program's records ended, to clean up and answer."""
_MIN_AS = 256 << 20


def ceilings(limits: Limits, uid: int) -> dict[str, Any]:
    """The server's own hard limits and tmpfs size: what a job with `limits` needs at most.

    Every program lowers its limits from these in its own process (rlimits only go down).
    """
    spec = job_spec(Job({"kind": "python", "source": "main.py"}, "", "stdio", [], limits=limits), uid, forked=True)
    lim = spec["rlimits"]
    return {"rlimits": {"nproc": lim["nproc"], "fsize": lim["fsize"], "nofile": max(lim["nofile"], 64),
                        "as": max(lim["as"], lim["compile_as"], _MIN_AS)},
            "tmpfs": limits.tmpfs_mb << 20}


def covers(have: dict[str, Any], need: dict[str, Any]) -> bool:
    return have["tmpfs"] >= need["tmpfs"] and all(have["rlimits"][k] >= v for k, v in need["rlimits"].items())


def merged(have: dict[str, Any] | None, need: dict[str, Any]) -> dict[str, Any]:
    if have is None:
        return need
    return {"rlimits": {k: max(v, have["rlimits"][k]) for k, v in need["rlimits"].items()},
            "tmpfs": max(have["tmpfs"], need["tmpfs"])}


class ForkServer:
    """One worker's fork server (bwrap isolation only); `run` never raises for what a program does.

    Args:
        iso: the isolation (kind "bwrap").
        uid: the worker's slot uid.
    """

    def __init__(self, iso: isolation.Isolation, uid: int) -> None:
        self.iso, self.uid = iso, uid
        self.proc: subprocess.Popen | None = None
        self.ctrl: socket.socket | None = None
        self.ceil: dict[str, Any] | None = None
        self.starts = 0
        self._buf = b""
        self._log: Any = None

    def run(self, job: Job) -> ProgramResult:
        """Run one Python job on the server (started or restarted as needed)."""
        need = ceilings(job.limits, self.uid)
        for attempt in range(2):
            if self.proc is None or self.ceil is None or not covers(self.ceil, need):
                why = self.restart(merged(self.ceil, need))
                if why:
                    return ProgramResult(status="sandbox_error", error=why)
            result, healthy, started = self._run_once(job)
            if not healthy:
                self.stop()
            if started or attempt:
                return result
        return result

    def restart(self, ceil: dict[str, Any]) -> str:
        """Stop any running server and start one with `ceil`; "" on success, else why it failed."""
        self.stop()
        box = tempfile.mkdtemp(prefix="assay-forkserver-")
        ours, theirs = socket.socketpair()
        sc_fd = seccomp.memfd()
        try:
            for name in ("server.py", "harness.py", "seccomp.py"):
                with open(os.path.join(box, name), "wb") as f:
                    f.write(harness_source(name))
                os.chmod(os.path.join(box, name), 0o644)
            os.chmod(box, 0o755)
            self.proc = self._spawn(box, theirs.fileno(), sc_fd, ceil)
            self.ctrl, self.ceil, self._buf = ours, ceil, b""
            self.starts += 1
            line = self._line(START_TIMEOUT_S)
        except OSError as e:
            line = f"{type(e).__name__}: {e}"
        finally:
            theirs.close()
            if sc_fd is not None:
                os.close(sc_fd)
            shutil.rmtree(box, ignore_errors=True)  # loaded by now; the server never reads /box again
        if line == "ready":
            return ""
        log = self._log_tail()
        self.stop()
        ours.close()
        return f"the fork server did not start: {line or 'no answer'} {log}".strip()

    def _spawn(self, box: str, ctrl_fd: int, sc_fd: int | None, ceil: dict[str, Any]) -> subprocess.Popen:
        prefix = isolation.bwrap_prefix(str(self.iso.bwrap), box, ceil["tmpfs"], SANDBOX_ENV, sc_fd)
        argv = prefix + [HARNESS_PYTHON, "-I", "-S", "/box/server.py", str(ctrl_fd),
                         marshal.dumps(ceil["rlimits"]).hex()]
        kw: dict[str, Any] = {"user": self.uid, "group": self.uid, "extra_groups": []} if os.geteuid() == 0 else {}
        fds = (ctrl_fd,) if sc_fd is None else (ctrl_fd, sc_fd)
        self._log = tempfile.TemporaryFile(prefix="assay-forkserver-log-")
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
                                cwd="/", env=SANDBOX_ENV, start_new_session=True, pass_fds=fds, **kw)

    def _log_tail(self) -> str:
        """The last lines bwrap or the server wrote to stderr (why a start failed)."""
        if self._log is None:
            return ""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 600))
        return self._log.read().decode(errors="replace").strip()

    def stop(self) -> None:
        """Kill the server's sandbox and every process of the slot uid; reap."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
            self.proc = None
        if self.ctrl is not None:
            self.ctrl.close()
            self.ctrl = None
        if self._log is not None:
            self._log.close()
            self._log = None
        isolation.clear_uid(self.uid)

    def _run_once(self, job: Job) -> tuple[ProgramResult, bool, bool]:
        """(result, server still healthy, the program started)."""
        start = time.monotonic()
        deadline = start + job.deadline_s()
        rep_r, rep_w = os.pipe()
        rpc = RpcPipes() if job.mode == "check" else None
        job_fd = os.memfd_create("assay-job", 0)
        try:
            os.write(job_fd, marshal.dumps(job_spec(job, self.uid, forked=True)))
            os.lseek(job_fd, 0, os.SEEK_SET)
            assert self.ctrl is not None
            socket.send_fds(self.ctrl, [b"run"], [job_fd, rep_w, *(rpc.child_ends() if rpc else ())])
        except OSError as e:
            self._close_all(rep_r, rpc)
            return ProgramResult(status="sandbox_error", error=f"fork server: {e}"), False, False
        finally:
            os.close(job_fd)
            os.close(rep_w)
            if rpc is not None:
                rpc.close_child_ends()
        stream = ReportStream(rep_r, report_cap(job), deadline)
        outcome = drive(job, stream, rpc, deadline)
        self._close_all(rep_r, rpc)
        healthy = stream.status == "ok" and self._line(DONE_TIMEOUT_S).endswith(" ok")
        result = build_result(bytes(stream.out), stream.status, "the fork server ended", job, outcome, start)
        return result, healthy, stream.out.startswith(b'{"t": "start"}')

    @staticmethod
    def _close_all(rep_r: int, rpc: RpcPipes | None) -> None:
        os.close(rep_r)
        if rpc is not None:
            rpc.close()

    def _line(self, timeout: float) -> str:
        """The server's next line on the control socket ("" on EOF or timeout)."""
        deadline = time.monotonic() + timeout
        assert self.ctrl is not None
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not select.select([self.ctrl], [], [], left)[0]:
                    return ""
                chunk = self.ctrl.recv(4096)
            except OSError:
                return ""
            if not chunk:
                return ""
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode(errors="replace")

    def close(self) -> None:
        self.stop()
