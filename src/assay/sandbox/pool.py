"""A pool of worker processes that survives anything a job does.

`WorkerPool` runs `target(job)` in N long-lived worker processes (started with "spawn",
so a trainer's threads and CUDA state are never forked). Each job has a deadline: a worker
that does not answer in time, or dies, is killed and replaced, and that job gets a
`WorkerFailure`; the batch goes on. `SandboxPool` is a `WorkerPool` whose workers each own
one slot uid and are child-subreapers (measured on these machines: zombies of the sandbox's
init otherwise pile up and exhaust `RLIMIT_NPROC`).

    >>> pool = WorkerPool("operator:neg", workers=1)
    >>> pool.map([1, 2], [5.0, 5.0])
    [-1, -2]
    >>> pool.close()
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from assay.errors import AssayError
from assay.processes import main_script_hidden
from assay.registry import load_path
from assay.sandbox import isolation
from assay.sandbox.forkserver import ForkServer
from assay.sandbox.runner import HARNESS_PYTHON, Job, Limits, ProgramResult, run_job


@dataclass
class WorkerFailure:
    """A job whose worker died, hung past its deadline, or raised."""

    error: str


class _Worker:
    def __init__(self, ctx: Any, target: str, setup: str | None, setup_args: tuple) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, target, setup, setup_args), daemon=True)
        with main_script_hidden():  # the user's script is not run again in the worker
            self.proc.start()
        child.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def _worker_main(conn: Connection, target: str, setup: str | None, setup_args: tuple) -> None:
    fn: Callable[[Any], Any] = load_path(target)  # type: ignore[assignment]
    state = load_path(setup)(*setup_args) if setup else None  # type: ignore[operator]
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = fn(job) if state is None else fn((state, job))
        except Exception as e:  # a job bug fails one item; the worker goes on
            out = WorkerFailure(f"{type(e).__name__}: {e}")
        conn.send(out)


class WorkerPool:
    """N worker processes running `target` (a `module:function` path) on jobs; thread-safe.

    Any number of threads may call `map` at once: each job takes the next idle worker, so
    one-item calls from many threads (an I/O reward executor) keep every worker busy.

    Args:
        target: `module:function` called as `fn(job)`, or `fn((state, job))` with `setup`.
        workers: number of processes.
        setup: optional `module:function` run once in each worker; its return is the state.
        setup_args: arguments of `setup` (picklable).
    """

    def __init__(self, target: str, workers: int = 2, setup: str | None = None, setup_args: tuple = ()) -> None:
        self._ctx = mp.get_context("spawn")
        self._spec = (target, setup, setup_args)
        self._workers = [self._spawn() for _ in range(max(1, workers))]
        self._idle: queue.Queue[int] = queue.Queue()
        for w in range(len(self._workers)):
            self._idle.put(w)
        self._threads = ThreadPoolExecutor(len(self._workers), thread_name_prefix="assay-pool")
        atexit.register(self.close)

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, *self._spec)

    def map(self, jobs: list[Any], deadlines: list[float]) -> list[Any]:
        """Results in job order; a job past its deadline (seconds) or whose worker died fails."""
        if len(jobs) == 1:
            return [self.run_one(jobs[0], deadlines[0])]
        return list(self._threads.map(self.run_one, jobs, deadlines))

    def run_one(self, job: Any, deadline: float) -> Any:
        """Run one job on the next idle worker, waiting at most `deadline` seconds for it."""
        w = self._idle.get()
        try:
            conn = self._workers[w].conn
            conn.send(job)
            if conn.poll(deadline):
                return conn.recv()
            self._replace(w)
            return WorkerFailure("worker did not answer before the job's deadline")
        except (EOFError, OSError) as e:
            self._replace(w)
            return WorkerFailure(f"worker died: {type(e).__name__}")
        finally:
            self._idle.put(w)

    def _replace(self, w: int) -> None:
        self._workers[w].kill()
        self._workers[w] = self._spawn()

    def close(self) -> None:
        for worker in getattr(self, "_workers", []):
            worker.kill()
        self._workers = []
        if hasattr(self, "_threads"):
            self._threads.shutdown(wait=False)

    def __len__(self) -> int:
        return len(self._workers)


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
