"""The batch executor: scores a batch concurrently, one failure fails one item.

* `kind == "cpu"` rewards run in a pool of worker processes (forkserver by default, fork
  on request). Each worker's **main thread** scores one item at a time, so verifiers that
  time out with `signal.alarm` (math-verify) work. Items go out in small chunks and each
  result streams back as soon as it is ready; the parent holds a deadline for the item a
  worker is on; past it the worker is killed (SIGKILL) and restarted, only that item fails
  and the rest of its chunk is sent again. A worker that dies (segfault, `os._exit`, out
  of memory) fails only its current item too.
* `kind == "io"` rewards run on an asyncio loop under a concurrency limit, each item with
  a deadline (`ascore(traj)` when the reward has it, else `score` in a thread; a thread
  that never returns cannot be killed, only abandoned).
* `workers=0` scores CPU rewards inline in this process, with no deadline (tests, tiny
  rewards).

A failed item scores `failure_score` (None: leave it out of baselines) with the reason in
`error` and `info["reason"]` (`raised`, `timeout`, `crashed`); a result whose reward set
`error` with score None keeps None. Counts since the last call
are in `stats()`.

    >>> from assay.rewards.math import MathReward
    >>> from assay.types import Sample, Trajectory
    >>> batch = [Trajectory(Sample(str(i), "", "4"), r"\\boxed{4}", [], [], [], True) for i in range(3)]
    >>> with RewardExecutor(MathReward(), workers=0) as ex:
    ...     [r.score for r in ex.score(batch)]
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import multiprocessing as mp
import pickle
import signal
import time
from multiprocessing.connection import wait
from typing import Any

from assay.errors import AssayError
from assay.processes import main_script_hidden
from assay.rewards.base import Reward, score_safely
from assay.types import RewardResult, Trajectory

_COUNTERS = ("items", "failures", "timeouts", "crashes", "raised", "none", "restarts")


def _worker_main(conn: Any, reward_bytes: bytes) -> None:
    """A worker process: unpickle the reward, then score items until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    try:
        reward = pickle.loads(reward_bytes)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        for idx, traj in msg:  # a chunk: each result goes back as soon as it is ready
            result = score_safely(reward, traj)
            try:
                conn.send((idx, result))
            except (pickle.PicklingError, TypeError, AttributeError) as e:
                conn.send((idx, RewardResult.failed(f"result cannot be pickled: {e}", reason="raised")))


class _Worker:
    """One worker process, its pipe, and the items sent to it (the first is being scored)."""

    def __init__(self, ctx: Any, reward_bytes: bytes) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, reward_bytes), daemon=True)
        with main_script_hidden():
            self.proc.start()
        child.close()
        self.ready = False
        self.items: collections.deque[int] = collections.deque()
        self.deadline = 0.0
        self.started = 0.0

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Block until the worker has loaded the reward (item deadlines exclude start-up)."""
        if self.ready:
            return
        if not self.conn.poll(timeout):
            raise AssayError(f"reward worker did not start within {timeout:g}s")
        try:
            kind, msg = self.conn.recv()
        except (EOFError, OSError):
            kind, msg = "error", f"worker exited with code {self.proc.exitcode} while loading the reward"
        if kind != "ready":
            raise AssayError(f"reward worker failed to load the reward: {msg}")
        self.ready = True

    def send(self, chunk: list[tuple[int, Trajectory]], timeout: float) -> None:
        """Send items to score in order; the first one's clock starts now."""
        self.conn.send(chunk)
        self.items.extend(i for i, _ in chunk)
        self.started = time.monotonic()
        self.deadline = self.started + timeout

    def done(self, timeout: float) -> None:
        """The first item came back; the next one's clock starts now."""
        self.items.popleft()
        self.started = time.monotonic()
        self.deadline = self.started + timeout

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(2.0)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(0.5)
        self.kill()


def _preload(reward: Reward) -> list[str]:
    """Modules the forkserver should import once: the reward's, its children's, their `preload`."""
    return [m for m in _modules(reward) if m != "__main__"]


def _modules(reward: Reward) -> list[str]:
    """The modules of a reward, of the rewards inside it, and their `preload` lists."""
    mods, seen, todo = [], set(), [reward]
    while todo:
        r = todo.pop()
        if id(r) in seen:
            continue
        seen.add(id(r))
        mods += [type(r).__module__, *getattr(r, "preload", ())]
        for v in vars(r).values():
            todo += [v] if isinstance(v, Reward) else [x for x in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else []) if isinstance(x, Reward)]
    return list(dict.fromkeys(mods))


class RewardExecutor:
    """Scores batches with `reward`, isolating every item's failure.

    Args:
        reward: any `Reward` (picklable when `workers > 0`).
        workers: worker processes for CPU rewards; 0 scores inline in this process.
        timeout: seconds per item before it fails (hard kill and restart for CPU rewards).
        failure_score: score of a failed item; None leaves it out of baselines.
        concurrency: items in flight at once for `kind == "io"` rewards.
        start_method: "forkserver" (default; safe with threads in the parent) or "fork".
        chunk: most items sent to a worker at once (results stream back one by one and
            each item keeps its own deadline; fewer round trips on a busy machine).
    """

    def __init__(self, reward: Reward, workers: int = 2, timeout: float = 5.0, failure_score: float | None = 0.0, *, concurrency: int = 32, start_method: str = "forkserver", chunk: int = 8):
        if workers < 0 or timeout <= 0 or concurrency < 1:
            raise AssayError(f"reward executor: need workers >= 0, timeout > 0, concurrency >= 1; got {workers}, {timeout}, {concurrency}")
        if start_method not in ("forkserver", "fork"):
            raise AssayError(f"reward executor: start_method must be 'forkserver' or 'fork', got {start_method!r}")
        self.reward, self.workers, self.timeout = reward, workers, float(timeout)
        self.failure_score, self.concurrency, self.start_method = failure_score, concurrency, start_method
        self.chunk = max(1, int(chunk))
        self._pool: list[_Worker] = []
        self._reward_bytes: bytes | None = None
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._seconds = 0.0

    # ---------------------------------------------------------------- public

    def score(self, batch: list[Trajectory]) -> list[RewardResult]:
        """One `RewardResult` per trajectory, in order; never raises for a reward's fault."""
        start = time.perf_counter()
        if not batch:
            return []
        if getattr(self.reward, "kind", "cpu") == "io":
            results = self._run_async(batch)
        elif self.workers == 0:
            results = self._score_inline(batch)
        else:
            results = self._score_pool(batch)
        self._seconds += time.perf_counter() - start
        return [self._finish(r) for r in results]

    __call__ = score

    def stats(self) -> dict[str, float]:
        """Counts since the last call, namespaced for metrics (see docs/rewards.md)."""
        out = {f"reward/executor/{k}": float(v) for k, v in self._counts.items()}
        out["reward/executor/items_per_s"] = self._counts["items"] / self._seconds if self._seconds > 0 else 0.0
        self._counts, self._seconds = dict.fromkeys(_COUNTERS, 0), 0.0
        return out

    def close(self) -> None:
        """Stop the workers and threads; the executor restarts them if used again."""
        for w in self._pool:
            w.stop()
        self._pool = []
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def __enter__(self) -> "RewardExecutor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- inline

    def _score_inline(self, batch: list[Trajectory]) -> list[RewardResult]:
        try:
            results = self.reward(batch)
        except Exception as e:  # a reward's own __call__ that raises fails the batch's items, not the caller
            return [RewardResult.failed(f"{type(e).__name__}: {e}", reason="raised") for _ in batch]
        if len(results) != len(batch):
            return [RewardResult.failed(f"reward returned {len(results)} results for {len(batch)} items", reason="raised") for _ in batch]
        return list(results)

    # ---------------------------------------------------------------- process pool

    def _start_pool(self) -> None:
        if self._reward_bytes is None:
            try:
                self._reward_bytes = pickle.dumps(self.reward)
            except Exception as e:
                raise AssayError(f"reward {type(self.reward).__name__} cannot be pickled for worker processes ({e}); use a callable class, not a closure, or workers=0") from None
        method = self.start_method
        if method == "forkserver" and any(m == "__main__" for m in _modules(self.reward)):
            method = "fork"  # a class defined in a script cannot be imported by a forkserver child
        ctx = mp.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(["assay.rewards.base", *_preload(self.reward)])
        self._ctx = ctx
        while len(self._pool) < self.workers:
            self._pool.append(_Worker(ctx, self._reward_bytes))
        for w in self._pool:
            w.wait_ready()

    def _replace(self, w: _Worker) -> None:
        w.kill()
        fresh = _Worker(self._ctx, self._reward_bytes)
        self._pool[self._pool.index(w)] = fresh
        self._counts["restarts"] += 1
        fresh.wait_ready()

    def _score_pool(self, batch: list[Trajectory]) -> list[RewardResult]:
        self._start_pool()
        results: list[RewardResult | None] = [None] * len(batch)
        todo = collections.deque(range(len(batch)))
        while todo or any(w.items for w in self._pool):
            for k in range(len(self._pool)):
                if not self._pool[k].items and todo:
                    self._dispatch(k, batch, todo)
            self._collect(results, todo)
        return [r for r in results if r is not None]

    def _dispatch(self, k: int, batch: list[Trajectory], todo: collections.deque) -> None:
        """Send worker k a chunk: small enough to balance the pool, large enough to save round trips."""
        if not self._pool[k].proc.is_alive():  # died while idle (killed from outside)
            self._replace(self._pool[k])
        size = max(1, min(self.chunk, len(todo) // (2 * len(self._pool))))
        idxs = [todo.popleft() for _ in range(min(size, len(todo)))]
        try:
            self._pool[k].send([(i, batch[i]) for i in idxs], self.timeout)
        except (OSError, ValueError):  # died just now: restart and retry the items
            todo.extendleft(reversed(idxs))
            self._pool[k].items.clear()
            self._replace(self._pool[k])

    def _collect(self, results: list[RewardResult | None], todo: collections.deque) -> None:
        busy = [w for w in self._pool if w.items]
        if not busy:
            return
        now = time.monotonic()
        ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], max(0.0, min(w.deadline for w in busy) - now)))
        for w in busy:
            try:
                while w.items and w.conn.poll():
                    idx, results[idx] = w.conn.recv()
                    w.done(self.timeout)
            except (EOFError, OSError):
                pass
            if not w.items:
                continue
            now = time.monotonic()
            if w.proc.sentinel in ready or not w.proc.is_alive():
                self._fail_first(w, results, todo, f"worker crashed (exit code {w.proc.exitcode})", "crashed", now)
            elif now >= w.deadline:
                self._fail_first(w, results, todo, f"timeout after {self.timeout:g}s (worker killed and restarted)", "timeout", now)

    def _fail_first(self, w: _Worker, results: list[RewardResult | None], todo: collections.deque, error: str, reason: str, now: float) -> None:
        """Fail the item the worker was on, put the rest of its chunk back, restart it."""
        idx = w.items.popleft()
        results[idx] = RewardResult.failed(error, reason=reason, seconds=round(now - w.started, 3))
        self._counts["timeouts" if reason == "timeout" else "crashes"] += 1
        todo.extendleft(reversed(w.items))
        w.items.clear()
        self._replace(w)

    # ---------------------------------------------------------------- asyncio

    def _run_async(self, batch: list[Trajectory]) -> list[RewardResult]:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self._score_async(batch))
        with concurrent.futures.ThreadPoolExecutor(1) as ex:  # called from async code: use a loop of our own
            return ex.submit(asyncio.run, self._score_async(batch)).result()

    async def _score_async(self, batch: list[Trajectory]) -> list[RewardResult]:
        if self._threads is None:
            self._threads = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="assay-reward")
        sem = asyncio.Semaphore(self.concurrency)
        return await asyncio.gather(*(self._one_async(t, sem) for t in batch))

    async def _one_async(self, traj: Trajectory, sem: asyncio.Semaphore) -> RewardResult:
        async with sem:
            start = time.perf_counter()
            ascore = getattr(self.reward, "ascore", None)
            if ascore is not None:
                work = ascore(traj)
            else:
                work = asyncio.get_running_loop().run_in_executor(self._threads, score_safely, self.reward, traj)
            try:
                return await asyncio.wait_for(work, self.timeout)
            except asyncio.TimeoutError:
                self._counts["timeouts"] += 1
                return RewardResult.failed(f"timeout after {self.timeout:g}s", reason="timeout", seconds=round(time.perf_counter() - start, 3))
            except Exception as e:
                return RewardResult.failed(f"{type(e).__name__}: {e}", reason="raised")

    # ---------------------------------------------------------------- bookkeeping

    def _finish(self, r: RewardResult) -> RewardResult:
        self._counts["items"] += 1
        if r.error is not None:
            self._counts["failures"] += 1
            if r.score is not None:  # a reward that itself said None ("cannot score") keeps None
                r.info.setdefault("reason", "raised")
                r.score = self.failure_score
            if r.info.get("reason") == "raised":
                self._counts["raised"] += 1
        if r.score is None:
            self._counts["none"] += 1
        return r
