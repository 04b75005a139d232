"""The batch executor: scores a batch concurrently, one failure fails one item.

* `kind == "cpu"` rewards run in worker processes (`assay.workers.WorkerPool`, the one pool
  assay has; forkserver by default, fork on request). Each worker's **main thread** scores
  one item at a time, so verifiers that time out with `signal.alarm` (math-verify) work.
  Items go out in small chunks and each result streams back as soon as it is ready; the
  pool holds a deadline for the item a worker is on; past it the worker is killed
  (SIGKILL) and restarted, only that item fails and the rest of its chunk is sent again. A
  worker that dies (segfault, `os._exit`, out of memory) fails only its current item too.
* `kind == "io"` rewards run on an asyncio loop under a concurrency limit, each item with
  a deadline (`ascore(traj)` when the reward has it, else `score` in a thread; a thread
  that never returns cannot be killed, only abandoned).
* `workers=0` scores CPU rewards inline in this process, with no deadline (tests, tiny
  rewards).
* `kind == "batch"` rewards get the whole batch in one `reward(batch)` call in this process,
  whatever `workers` says: the model judges of `assay.rewards.judge` (they see groups whole,
  run their own concurrency and bound their own time, a per-request timeout that leaves an
  item unscored) and the learned reward models `rm` and `prm` (batched forwards of one loaded
  model; no per-item deadline, which a forward pass does not need).

A failed item scores `failure_score` (None: leave it out of baselines) with the reason in
`error` and `info["reason"]` (`raised`, `timeout`, `crashed`); a result whose reward set
`error` with score None keeps None. Counts since the last call are in `stats()`, with
the counters of any reward in the tree that has a `stats()` of its own (`reward_stats`:
a judge's requests, retries and cache hits).

    >>> from assay.rewards.math import MathReward
    >>> from assay.types import Sample, Trajectory
    >>> batch = [Trajectory(Sample(str(i), "", "4"), r"\\boxed{4}", [], [], [], True) for i in range(3)]
    >>> with RewardExecutor(MathReward(), workers=0) as ex:
    ...     [r.score for r in ex.score(batch)]
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import pickle
import time
from typing import Any, Iterator

from assay.errors import AssayError
from assay.rewards.base import Reward, score_safely
from assay.types import RewardResult, Trajectory
from assay.workers import WorkerFailure, WorkerPool

_COUNTERS = ("items", "failures", "timeouts", "crashes", "raised", "none", "restarts")


def load_reward(reward_bytes: bytes) -> Reward:
    """In a worker, once: the reward it scores with, warmed (a model loaded before any item's clock starts)."""
    reward = pickle.loads(reward_bytes)
    for r in _rewards(reward):
        warm = getattr(r, "warm", None)
        if callable(warm):
            warm()
    return reward


def score_item(reward_traj: tuple[Reward, Trajectory]) -> RewardResult:
    """In a worker, per item: one result, a reward's exception turned into a failed result."""
    reward, traj = reward_traj
    return score_safely(reward, traj)


def _preload(reward: Reward) -> list[str]:
    """Modules the forkserver should import once: the reward's, its children's, their `preload`."""
    return [m for m in _modules(reward) if m != "__main__"]


def gives_verdicts(reward: Reward) -> bool:
    """Whether `reward`'s scores are verdicts: it and every reward inside it declare `verdict` (a composition
    holding a reward model, or a transform over a judge, does not)."""
    return all(getattr(r, "verdict", True) for r in _rewards(reward))


def _rewards(reward: Reward) -> Iterator[Reward]:
    """A reward and every reward inside it (attributes, lists, tuples and dicts of them, and dataclasses
    such as a rubric's criteria holding them), each once."""
    seen, todo = set(), [reward]
    while todo:
        r = todo.pop()
        if id(r) in seen:
            continue
        seen.add(id(r))
        yield r
        todo += _inside(vars(r).values())


def _inside(values: Any) -> list[Reward]:
    """The rewards among a reward's attribute values: one level into lists, tuples and dicts, and into a
    dataclass's fields (a rubric's `Criterion.reward`); never deeper (a reward's data tables are not walked)."""
    out: list[Reward] = []
    for v in values:
        for x in v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(x, Reward):
                out.append(x)
            elif dataclasses.is_dataclass(x) and not isinstance(x, type):
                out += [y for f in dataclasses.fields(x) if isinstance(y := getattr(x, f.name, None), Reward)]
    return out


def _modules(reward: Reward) -> list[str]:
    """The modules of a reward, of the rewards inside it, and their `preload` lists."""
    return list(dict.fromkeys(m for r in _rewards(reward) for m in (type(r).__module__, *getattr(r, "preload", ()))))


def reward_stats(reward: Reward) -> dict[str, float]:
    """The summed `stats()` counters of a reward and the rewards inside it (a judge's requests, say).

    Only rewards scored in this process count: `batch` and `io` rewards, or any reward with
    `workers=0`. A CPU reward in worker processes keeps its counters there.
    """
    out: dict[str, float] = {}
    for r in _rewards(reward):
        stats = getattr(r, "stats", None)
        if callable(stats):
            for k, v in stats().items():
                out[k] = out.get(k, 0.0) + float(v)
    return out


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
        self._pool: WorkerPool | None = None
        self._final = False  # closed for good: see `close`
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._seconds = 0.0

    # ---------------------------------------------------------------- public

    def score(self, batch: list[Trajectory]) -> list[RewardResult]:
        """One `RewardResult` per trajectory, in order; never raises for a reward's fault."""
        start = time.perf_counter()
        if not batch:
            return []
        kind = getattr(self.reward, "kind", "cpu")
        if kind == "io":
            results = self._run_async(batch)
        elif self.workers == 0 or kind == "batch":
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
        out.update(reward_stats(self.reward))
        self._counts, self._seconds = dict.fromkeys(_COUNTERS, 0), 0.0
        return out

    def start(self) -> "RewardExecutor":
        """Start the worker processes now rather than at the first batch (a server is ready when it says so)."""
        if self.workers > 0 and getattr(self.reward, "kind", "cpu") == "cpu":
            self._start_pool()
        return self

    def close(self, final: bool = False) -> None:
        """Stop the workers and threads; the executor restarts them if used again, unless `final`.

        `final` is for a server stopping under a batch: a batch that starts after it raises
        instead of starting new workers while the process exits.
        """
        self._final = self._final or final
        if self._pool is not None:
            self._pool.close()
            self._pool = None
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

    def _start_pool(self) -> WorkerPool:
        if self._final:
            raise AssayError("the reward executor was closed for good")
        if self._pool is None:
            try:
                reward_bytes = pickle.dumps(self.reward)
            except Exception as e:
                raise AssayError(f"reward {type(self.reward).__name__} cannot be pickled for worker processes ({e}); use a callable class, not a closure, or workers=0") from None
            method = self.start_method
            if method == "forkserver" and any(m == "__main__" for m in _modules(self.reward)):
                method = "fork"  # a class defined in a script cannot be imported by a forkserver child
            self._pool = WorkerPool("assay.rewards.executor:score_item", self.workers, "assay.rewards.executor:load_reward", (reward_bytes,),
                                    start_method=method, preload=("assay.rewards.base", "assay.rewards.executor", *_preload(self.reward)),
                                    name="reward worker (loading the reward)")
        return self._pool

    def _score_pool(self, batch: list[Trajectory]) -> list[RewardResult]:
        pool = self._start_pool()
        restarts = pool.restarts
        out = pool.stream(batch, self.timeout, self.chunk)
        self._counts["restarts"] += pool.restarts - restarts
        results = []
        for r in out:
            if isinstance(r, WorkerFailure):  # the worker timed out or died ("raised" is counted by `_finish`)
                if r.reason in ("timeout", "crashed"):
                    self._counts["timeouts" if r.reason == "timeout" else "crashes"] += 1
                r = RewardResult.failed(r.error, reason=r.reason, seconds=r.seconds)
            results.append(r)
        return results

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
