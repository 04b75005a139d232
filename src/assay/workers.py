"""Worker processes with deadlines: the one implementation of start, deadline, kill and restart.

Everything assay runs in child processes with a deadline goes through `WorkerPool`: the
reward executor's CPU workers, the sandbox's slot workers and the SQL reward's query
workers. A worker runs a handler (`target`, called on each job) after an optional
`setup` (called once; its return value is passed to the handler with each job). It tells
the parent when it is ready, so a job's clock never includes start-up. A job that is not
answered before its deadline, or whose worker dies (segfault, `os._exit`, out of memory,
killed from outside), fails alone with a `WorkerFailure`; the worker is killed (SIGKILL) and
replaced. Workers ignore SIGINT: Ctrl-C is the parent's to handle.

Two ways to hand out jobs:

- `map(jobs, deadlines)`: thread-safe; each job takes the next idle worker, so one-item
  calls from many threads keep every worker busy (the sandbox, SQL queries).
- `stream(jobs, deadline)`: one caller; jobs go out in small chunks, the next queued behind
  the one running so a worker never waits for the pool, results come back one by one and
  are read a few at a time (`_Pace`), each job with its own deadline; when a job fails, the
  rest of its worker's queue is sent again elsewhere (the reward executor).

    >>> pool = WorkerPool("operator:neg", workers=1)
    >>> pool.map([1, 2], [5.0, 5.0])
    [-1, -2]
    >>> pool.stream([3, 4], 5.0)
    [-3, -4]
    >>> pool.close()
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterator

from assay.errors import AssayError
from assay.registry import load_path


_PENDING = object()  # a job of `stream` without a result yet


@dataclass
class WorkerFailure:
    """A job whose worker died, hung past its deadline, or raised; `reason` is `timeout`, `crashed` or `raised`."""

    error: str
    reason: str = "raised"
    seconds: float = 0.0


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """Start processes without re-running the user's script in them.

    "spawn" and "forkserver" children import the parent's `__main__` from its file, which
    runs a script that has no `if __name__ == "__main__":` guard a second time (and fails
    with multiprocessing's bootstrapping error). Workers never need `__main__` (a handler
    defined there must use "fork"), so while a child starts, the main module's file is
    hidden and the child skips that import.
    """
    main = sys.modules.get("__main__")
    path, spec = getattr(main, "__file__", None), getattr(main, "__spec__", None)
    if main is None or (path is None and spec is None):
        yield
        return
    try:
        if path is not None:
            del main.__file__
        main.__spec__ = None
        yield
    finally:
        if path is not None:
            main.__file__ = path
        main.__spec__ = spec


def _resolve(obj: Any) -> Any:
    return load_path(obj) if isinstance(obj, str) else obj


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit_with(owner: int, every: float = 1.0) -> None:
    """Exit this worker once the process that owns the pool is gone (killed with SIGKILL, say).

    A worker hung in a job never reads its pipe, so it would not see the owner's end close:
    without this it would outlive the owner, a busy loop burning a core for ever.
    """
    while _alive(owner):
        time.sleep(every)
    os._exit(1)


def _worker_main(conn: Connection, spec: bytes) -> None:
    """A worker: set up, say ready, then answer chunks of `(index, job)` until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        target, setup, setup_args, owner = pickle.loads(spec)
        threading.Thread(target=_exit_with, args=(owner,), name="assay-owner-watch", daemon=True).start()
        fn = _resolve(target)
        state = _resolve(setup)(*setup_args) if setup is not None else None
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for idx, job in chunk:  # each result goes back as soon as it is ready
            try:
                out = fn(job) if setup is None else fn((state, job))
            except Exception as e:  # a job's bug fails that job; the worker goes on
                out = WorkerFailure(f"{type(e).__name__}: {e}")
            try:
                conn.send((idx, out))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                conn.send((idx, WorkerFailure(f"result cannot be pickled: {e}")))


class Worker:
    """One worker process, its pipe, and the jobs sent to it (the first is running)."""

    def __init__(self, ctx: Any, spec: bytes, ready_timeout: float, name: str = "worker") -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec), daemon=True)
        with main_script_hidden():
            self.proc.start()
        child.close()
        self.items: collections.deque[int] = collections.deque()
        self.started = self.deadline = 0.0
        self._wait_ready(ready_timeout)

    def _wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout):
            self.kill()
            raise AssayError(f"{self.name} did not start within {timeout:g}s")
        try:
            kind, msg = self.conn.recv()
        except (EOFError, OSError):
            kind, msg = "error", f"the worker exited with code {self.proc.exitcode} while starting"
        if kind != "ready":
            self.kill()
            raise AssayError(f"{self.name} failed to start: {msg}")

    def send(self, chunk: list[tuple[int, Any]], timeout: float) -> None:
        """Queue jobs to run in order after those it has; when it had none, the first one's clock starts now."""
        self.conn.send(chunk)
        if not self.items:
            self.started = time.monotonic()
            self.deadline = self.started + timeout
        self.items.extend(i for i, _ in chunk)

    def done(self, timeout: float) -> None:
        """The first job came back; the next one's clock starts now."""
        self.items.popleft()
        self.started = time.monotonic()
        self.deadline = self.started + timeout

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        with contextlib.suppress(OSError):  # closed already by a thread that saw the worker die
            self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(None)
        self.proc.join(0.5)
        self.kill()


class _Pace:
    """How `stream` keeps workers busy at little cost per job, from the mean job time so far.

    * Queue: a worker is sent more jobs while it has less than `QUEUE` seconds of them
      queued behind the one it runs (one chunk at a time, as before, until jobs are timed,
      and for jobs slower than `QUEUE`), so it never waits for the pool; a chunk of fast jobs
      is as large as `QUEUE` seconds of them. Slow jobs are never queued deep, so the work
      stays balanced between workers.
    * Linger: once a result is ready, the pool waits at most `LINGER` seconds, and at most
      half the work every busy worker has queued, before reading: one wake-up reads several
      results (reading each the moment it is ready costs a wake-up, a poll and the loop's
      bookkeeping per job, as much as a fast job itself), no worker runs dry, and no
      deadline passes unseen for long.
    """

    LINGER = 0.002  # seconds
    QUEUE = 0.01  # seconds of jobs queued ahead on a worker

    def __init__(self, workers: int):
        self.workers, self.began, self.results = workers, time.monotonic(), 0

    def per_job(self) -> float | None:
        """Mean seconds a job takes on a worker; None before each worker could have answered twice."""
        if self.results < 2 * self.workers:
            return None
        return (time.monotonic() - self.began) * self.workers / self.results

    def wants(self, w: "Worker") -> bool:
        """Whether worker w gets another chunk now."""
        per_job = self.per_job()
        return not w.items or (per_job is not None and (len(w.items) - 1) * per_job < self.QUEUE)

    def chunk(self, chunk: int) -> int:
        """Jobs in the next chunk: `chunk`, or `QUEUE` seconds of fast jobs."""
        per_job = self.per_job()
        return chunk if per_job is None else max(chunk, int(self.QUEUE / max(per_job, 1e-6)))

    def linger(self, busy: list["Worker"]) -> float:
        per_job = self.per_job()
        if per_job is None:
            return 0.0
        queued = min(len(w.items) for w in busy) - 1  # the first is running
        return max(0.0, min(self.LINGER, per_job * queued / 2, min(w.deadline for w in busy) - time.monotonic()))


class WorkerPool:
    """N worker processes running `target(job)` (or `target((state, job))` after `setup`); see the module docstring.

    Args:
        target: the handler, a `module:function` path or a picklable callable.
        workers: number of processes.
        setup: optional `module:function` (or callable) run once in each worker; its return is the state.
        setup_args: arguments of `setup` (picklable).
        start_method: "spawn" (default: a trainer's threads and CUDA state are never
            forked), "forkserver" or "fork" (needed for handlers defined in `__main__`).
        preload: modules the forkserver imports once, so each worker starts faster.
        ready_timeout: seconds a worker may take to start.
        name: what a worker is, for messages ("reward worker").
    """

    def __init__(self, target: str | Callable, workers: int = 2, setup: str | Callable | None = None, setup_args: tuple = (), *,
                 start_method: str = "spawn", preload: tuple[str, ...] = (), ready_timeout: float = 120.0, name: str = "worker") -> None:
        if start_method not in ("spawn", "forkserver", "fork"):
            raise AssayError(f"worker pool: start_method must be 'spawn', 'forkserver' or 'fork', got {start_method!r}")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self._spec = pickle.dumps((target, setup, setup_args, os.getpid()))
        self._ready_timeout, self._name = ready_timeout, name
        self._workers: list[Worker] = []
        try:
            for _ in range(max(1, workers)):
                self._workers.append(self._start())
        except BaseException:  # one failed to start: the ones already running go too
            for w in self._workers:
                w.kill()
            raise
        self._idle: queue.Queue[int] = queue.Queue()
        for w in range(len(self._workers)):
            self._idle.put(w)
        self._threads = ThreadPoolExecutor(len(self._workers), thread_name_prefix="assay-pool")
        self._lock = threading.Lock()  # `close` and a restart's swap of a worker never interleave
        self._closed = False
        self._start_error = ""  # why the last restart failed
        self.restarts = 0
        atexit.register(self.close)

    def _start(self) -> Worker:
        return Worker(self._ctx, self._spec, self._ready_timeout, self._name)

    def _replace(self, k: int) -> bool:
        """Kill worker k and start another, unless the pool is closing (its killed workers are not replaced).

        The new worker starts outside the lock: a start can take long (a reward loading its model in
        `setup`), and a `close` from another thread must not wait for it; one that came meanwhile kills it.
        Only the thread that holds worker k (its `run_one`, or the one `stream` caller) replaces it.
        A start that fails (its setup raised, or it was not ready in time) leaves slot k dead and
        returns False: the jobs it would have run fail alone, and the next call tries again.
        """
        with self._lock:
            if self._closed:
                return False
            self._workers[k].kill()
        try:
            w = self._start()
        except AssayError as e:
            self._start_error = str(e)
            return False
        with self._lock:
            if self._closed:
                w.kill()
                return
            self._workers[k] = w
            self.restarts += 1
        return True

    # ---------------------------------------------------------------- one job per worker, many threads

    def map(self, jobs: list[Any], deadlines: list[float]) -> list[Any]:
        """Results in job order; a job past its deadline (seconds) or whose worker died is a `WorkerFailure`."""
        if len(jobs) == 1:
            return [self.run_one(jobs[0], deadlines[0])]
        try:
            return list(self._threads.map(self.run_one, jobs, deadlines))
        except RuntimeError:  # closed under this call: its threads take no more jobs
            if not self._closed:
                raise
            return [WorkerFailure("the worker pool is closed", "crashed") for _ in jobs]

    def run_one(self, job: Any, deadline: float) -> Any:
        """Run one job on the next idle worker, waiting at most `deadline` seconds for it."""
        k = self._idle.get()
        try:
            if self._closed:
                return WorkerFailure("the worker pool is closed", "crashed")
            if not self._workers[k].proc.is_alive() and not self._replace(k):  # a restart that failed before
                return WorkerFailure(f"no worker: {self._start_error}", "crashed")
            w = self._workers[k]
            start = time.monotonic()
            w.conn.send([(0, job)])
            if w.conn.poll(deadline):
                return w.conn.recv()[1]
            self._replace(k)
            return WorkerFailure(f"timeout after {deadline:g}s (worker killed and restarted)", "timeout", round(time.monotonic() - start, 3))
        except (EOFError, OSError) as e:
            self._replace(k)
            return WorkerFailure(f"worker crashed ({type(e).__name__})", "crashed")
        finally:
            self._idle.put(k)

    # ---------------------------------------------------------------- chunks, one caller

    def stream(self, jobs: list[Any], deadline: float, chunk: int = 8) -> list[Any]:
        """Results in job order; each job has `deadline` seconds from when its worker starts it.

        A `close` from another thread ends the call: every job without a result then fails.
        """
        results: list[Any] = [_PENDING] * len(jobs)
        todo = collections.deque(range(len(jobs)))
        dead: set[int] = set()  # slots whose worker could not be started again in this call
        self._pace = _Pace(len(self._workers))
        while (todo or any(w.items for w in self._workers)) and not self._closed:
            for k in range(len(self._workers)):
                if k not in dead and todo and self._pace.wants(self._workers[k]) and not self._dispatch(k, jobs, todo, deadline, chunk):
                    dead.add(k)
            if len(dead) == len(self._workers):  # no worker left: the rest fail alone, never the call
                for i in todo:
                    results[i] = WorkerFailure(f"no worker: {self._start_error}", "crashed")
                todo.clear()
            self._collect(results, todo, deadline, dead)
        return [WorkerFailure("the worker pool was closed before this job finished", "crashed") if r is _PENDING else r for r in results]

    def _dispatch(self, k: int, jobs: list[Any], todo: collections.deque, deadline: float, chunk: int) -> bool:
        """Send worker k a chunk: small enough to balance the pool, large enough to save round trips.
        It goes behind the jobs the worker has, so the worker goes on without waiting for the pool.

        False when worker k is dead and could not be started again (the chunk stays in `todo`).
        """
        if not self._workers[k].proc.is_alive():
            if self._workers[k].items:  # died on a job: `_collect` fails that job, puts the rest back and restarts it
                return True
            if not self._replace(k):  # died while idle (killed from outside)
                return False
        size = max(1, min(self._pace.chunk(chunk), len(todo) // (2 * len(self._workers))))
        idxs = [todo.popleft() for _ in range(min(size, len(todo)))]
        try:
            self._workers[k].send([(i, jobs[i]) for i in idxs], deadline)
        except (OSError, ValueError):  # died just now: the chunk goes back; the jobs it had fail or go back in `_collect`
            todo.extendleft(reversed(idxs))
            return True if self._workers[k].items else self._replace(k)
        return True

    def _collect(self, results: list[Any], todo: collections.deque, deadline: float, dead: set[int]) -> None:
        busy = [w for w in self._workers if w.items]
        if not busy:
            return
        try:
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], max(0.0, min(w.deadline for w in busy) - time.monotonic())))
            if ready and not any(w.proc.sentinel in ready for w in busy):
                time.sleep(self._pace.linger(busy))  # let more results gather: one wake-up reads several
        except (OSError, ValueError):  # a `close` in another thread closed a pipe since the loop's check
            if not self._closed:
                raise
            return
        for w in busy:
            with contextlib.suppress(EOFError, OSError):
                while w.items and w.conn.poll():
                    idx, results[idx] = w.conn.recv()
                    w.done(deadline)
                    self._pace.results += 1
            if not w.items:
                continue
            now = time.monotonic()
            if w.proc.sentinel in ready or not w.proc.is_alive():
                self._fail_first(w, results, todo, dead, WorkerFailure(f"worker crashed (exit code {w.proc.exitcode})", "crashed",
                                                                        round(now - w.started, 3)))
            elif now >= w.deadline:
                self._fail_first(w, results, todo, dead, WorkerFailure(f"timeout after {deadline:g}s (worker killed and restarted)", "timeout",
                                                                        round(now - w.started, 3)))

    def _fail_first(self, w: Worker, results: list[Any], todo: collections.deque, dead: set[int], failure: WorkerFailure) -> None:
        """Fail the job the worker was on, put the rest of its chunk back, restart it (or mark its slot dead)."""
        results[w.items.popleft()] = failure
        todo.extendleft(reversed(w.items))
        w.items.clear()
        k = self._workers.index(w)
        if not self._closed and not self._replace(k):
            dead.add(k)

    def close(self) -> None:
        """Stop every worker (politely, then SIGKILL); a job still running on one fails, its worker not replaced.

        Safe to call twice and from any thread; calls running in other threads end with failures.
        """
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ failed before the pool was whole
            return
        with lock:
            if self._closed:
                return
            self._closed = True
        for w in self._workers:
            w.stop()
        self._threads.shutdown(wait=False)

    def __len__(self) -> int:
        return 0 if self._closed else len(self._workers)
