"""Concurrent requests scored as one batch: what `assay serve rewards` puts in front of its executor.

A trainer posts many small requests at once (OpenRLHF one per sample, verl one per batch
from several workers). Scoring each alone leaves the reward workers idle between requests
and pays the batch's overhead every time; `Coalescer` gathers the items of the requests
waiting into one `score(items)` call:

* a batch starts `window` seconds after the first request waiting for it arrived, or as soon
  as `max_items` items are waiting, and takes at most half the items waiting: the rest are
  the next batch, which starts (whole, without a window) the moment this one is scored, so
  the workers never wait while replies go out and requests come in (one `score` call at a
  time, on a thread of its own, so the event loop goes on serving while the workers score);
* a request's items are never split between batches (a request larger than `max_items` is a
  batch alone), and each request gets back exactly its own results, in order;
* a `score` that raises fails the requests of that batch with its exception, no others.

    >>> import asyncio
    >>> async def demo():
    ...     c = Coalescer(lambda xs: [x * 10 for x in xs], window=0.01, max_items=8)
    ...     return await asyncio.gather(c([1, 2]), c([3]), c([4, 5, 6]), c([7])), c.batches
    >>> asyncio.run(demo())  # [1, 2] and [3] (half of the 7 items waiting), then the rest
    ([[10, 20], [30], [40, 50, 60], [70]], 2)
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Callable

from assay.jsonhttp import in_thread


class Coalescer:
    """Gathers the items of concurrent calls into batches for `score` (see the module docstring).

    Args:
        score: `items -> results`, one result per item in order; blocking (it runs on a thread).
        window: seconds a batch waits for more requests after its first one arrived.
        max_items: most items in one batch (a larger request is scored alone).
    """

    def __init__(self, score: Callable[[list[Any]], list[Any]], window: float = 0.005, max_items: int = 1024):
        if window < 0 or max_items < 1:
            raise ValueError(f"need window >= 0 and max_items >= 1, got {window}, {max_items}")
        self.score, self.window, self.max_items = score, float(window), int(max_items)
        self.batches = 0  # batches scored
        self._waiting: collections.deque[tuple[list[Any], asyncio.Future, float]] = collections.deque()
        self._count = 0  # items waiting
        self._arrived: asyncio.Event | None = None
        self._runner: asyncio.Task | None = None

    async def __call__(self, items: list[Any]) -> list[Any]:
        """The results of `items`, scored in a batch with whatever else is waiting."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        if self._runner is None or self._runner.done():
            self._arrived = asyncio.Event()
            self._runner = loop.create_task(self._run())
        done = loop.create_future()
        self._waiting.append((items, done, time.monotonic()))
        self._count += len(items)
        self._arrived.set()  # type: ignore[union-attr]
        return await done

    async def _run(self) -> None:
        arrived = self._arrived
        assert arrived is not None
        leftover = False  # requests left by the last batch: they had their window
        while True:
            if not leftover:
                await arrived.wait()
            while not leftover and self._count < self.max_items and (left := self._waiting[0][2] + self.window - time.monotonic()) > 0:
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), left)
                except asyncio.TimeoutError:
                    break
            batch = self._take(everything=leftover)
            leftover = bool(self._waiting)
            if not leftover:
                arrived.clear()
            if batch:
                await self._score(batch)

    def _take(self, everything: bool) -> list[tuple[list[Any], asyncio.Future]]:
        """The waiting requests of the next batch: the oldest first, at least one request, at most `max_items`
        items, and unless `everything`, at most half the items waiting (the rest are the next batch, ready
        the moment this one is scored)."""
        batch: list[tuple[list[Any], asyncio.Future]] = []
        size, most = 0, min(self.max_items, self._count if everything else (self._count + 1) // 2)
        while self._waiting and (not batch or size + len(self._waiting[0][0]) <= most):
            items, done, _ = self._waiting.popleft()
            self._count -= len(items)
            if not done.done():  # its caller was cancelled (the server's drain ended): not scored
                batch.append((items, done))
                size += len(items)
        return batch

    async def _score(self, batch: list[tuple[list[Any], asyncio.Future]]) -> None:
        flat = [x for items, _ in batch for x in items]
        try:
            results = await in_thread(self.score, flat)
            if len(results) != len(flat):
                raise RuntimeError(f"score returned {len(results)} results for {len(flat)} items")
        except Exception as e:
            for _, done in batch:
                if not done.done():
                    done.set_exception(e)
            return
        self.batches += 1
        start = 0
        for items, done in batch:
            if not done.done():
                done.set_result(results[start:start + len(items)])
            start += len(items)
