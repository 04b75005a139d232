"""The sandbox's worker slots: `assay.workers.WorkerPool` workers that each own one slot uid.

Each worker claims a uid of its own and becomes a child-subreaper (measured on these
machines: zombies of the sandbox's init otherwise pile up and exhaust `RLIMIT_NPROC`); a
worker that hangs past a job's deadline or dies is killed and replaced by the pool, and that
job becomes a `sandbox_error` result.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from assay.errors import AssayError
from assay.sandbox import isolation
from assay.sandbox.forkserver import ForkServer
from assay.sandbox.runner import HARNESS_PYTHON, Job, Limits, ProgramResult, run_job
from assay.workers import WorkerFailure, WorkerPool

__all__ = ["SandboxPool", "SlotState", "WorkerFailure", "WorkerPool", "default_workers", "shared_pool"]


@dataclass
class SlotState:
    """What a sandbox worker holds: the isolation, its own uid, that uid's lock, its fork server."""

    iso: isolation.Isolation
    uid: int
    lock_fd: int | None
    server: ForkServer | None = None


def sandbox_setup(unsafe_no_sandbox: bool, fork_server: bool = True) -> SlotState:
    """Run once per sandbox worker: detect isolation, claim a uid, become a subreaper.

    With `fork_server` (and bwrap), Python programs go to a fork server, started on first use.
    """
    iso = isolation.detect(unsafe_no_sandbox)
    uid, fd = isolation.claim_slot_uid()
    isolation.kill_uid(uid)  # leftovers of a previous holder of this uid
    isolation.become_subreaper()
    server = ForkServer(iso, uid) if fork_server and iso.kind == "bwrap" else None
    return SlotState(iso, uid, fd, server)


def sandbox_run(state_job: tuple[SlotState, Job]) -> ProgramResult:
    state, job = state_job
    if state.server is not None and job.lang["kind"] == "python":
        return state.server.run(job)
    return run_job(job, state.iso, state.uid)


class SandboxPool:
    """Runs many sandboxed programs at once, one per worker slot.

    Args:
        workers: slots (default: `default_workers()`).
        unsafe_no_sandbox: run WITHOUT isolation when no sandbox exists (explicit opt-out).
        fork_server: run Python programs in each worker's fork server (default); False starts
            a fresh bwrap sandbox per program (the slower path, kept for comparison).
    """

    def __init__(self, workers: int | None = None, unsafe_no_sandbox: bool = False, fork_server: bool = True) -> None:
        isolation.detect(unsafe_no_sandbox)  # refuse here, in the caller, with a clear message
        if not os.access(HARNESS_PYTHON, os.X_OK):
            raise AssayError(f"the sandbox runs its harness with {HARNESS_PYTHON}, which is missing; "
                             "run scripts/install-sandbox.sh")
        n = workers or default_workers()
        self.fork_server = fork_server
        self._pool = WorkerPool("assay.sandbox.pool:sandbox_run", n, "assay.sandbox.pool:sandbox_setup",
                                (unsafe_no_sandbox, fork_server))

    def run(self, jobs: list[Job]) -> list[ProgramResult]:
        """One `ProgramResult` per job; a worker failure becomes status "sandbox_error". Thread-safe."""
        out = self._pool.map(jobs, [j.deadline_s() + 10.0 for j in jobs])
        return [r if isinstance(r, ProgramResult) else ProgramResult(status="sandbox_error", error=r.error)
                for r in out]

    def close(self) -> None:
        self._pool.close()

    def __len__(self) -> int:
        return len(self._pool)


def default_workers(limits: Limits | None = None) -> int:
    """Two slots per usable core (a sandbox spends much of its life waiting on the kernel), but
    no more than keep slots × nproc × memory within 80 % of RAM, the worst case of a fork and
    memory bomb in every slot at once."""
    lim = limits or Limits()
    ram_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
    by_memory = int(0.8 * ram_mb // (lim.nproc * lim.memory_mb))
    return max(1, min(2 * len(os.sched_getaffinity(0)), by_memory))


_SHARED: dict[tuple[int | None, bool, bool], SandboxPool] = {}
_SHARED_LOCK = threading.Lock()


def shared_pool(workers: int | None = None, unsafe_no_sandbox: bool = False, fork_server: bool = True) -> SandboxPool:
    """The process's `SandboxPool` for these settings, created on first use."""
    key = (workers, unsafe_no_sandbox, fork_server)
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = SandboxPool(workers, unsafe_no_sandbox, fork_server)
        return _SHARED[key]
