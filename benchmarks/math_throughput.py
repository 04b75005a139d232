"""Math-reward throughput: assay's executor against single-process math-verify, in one run.

Scores the same N distinct (reference, completion) pairs (built by
`benchmarks/data/build_math_pairs.py` with several seeds) two ways and prints items/s:

* math-verify: `verify(parse("$gold$"), parse(completion))` in a loop in this process,
  default arguments (its own 5 s timeouts), as most frameworks call it;
* assay: `RewardExecutor(MathReward(), workers=W)`, the pool started and warmed before
  the clock starts (a training run keeps its pool), batches of `--batch` items.

    python benchmarks/math_throughput.py [--n 2400] [--workers 2] [--batch 256] [--inline]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "data"))

from build_math_pairs import build  # noqa: E402

from assay.rewards.executor import RewardExecutor  # noqa: E402
from assay.rewards.math import MathReward  # noqa: E402
from assay.types import Sample, Trajectory  # noqa: E402


def pairs(n: int) -> list[dict]:
    """`n` distinct (reference, completion) pairs (more seeds until there are enough)."""
    out, seen, seed = [], set(), 100
    while len(out) < n:
        for r in build(seed, rounds=1):
            if (r["answer"], r["completion"]) not in seen:
                seen.add((r["answer"], r["completion"]))
                out.append(r)
        seed += 1
    return out[:n]


def time_math_verify(rows: list[dict]) -> float:
    from math_verify import parse, verify

    start = time.perf_counter()
    for r in rows:
        verify(parse(f"${r['answer']}$"), parse(r["completion"]))
    return len(rows) / (time.perf_counter() - start)


def time_assay(rows: list[dict], workers: int, batch: int, timeout: float) -> tuple[float, dict]:
    trajs = [Trajectory(Sample(str(i), "", r["answer"]), r["completion"], [], [], [], True) for i, r in enumerate(rows)]
    with RewardExecutor(MathReward(), workers=workers, timeout=timeout) as ex:
        ex.score(trajs[:4] if workers == 0 else [Trajectory(Sample("w", "", "1"), r"\boxed{(x+1)^2}", [], [], [], True)] * (2 * workers))
        ex.stats()
        start = time.perf_counter()
        for i in range(0, len(trajs), batch):
            ex.score(trajs[i : i + batch])
        rate = len(trajs) / (time.perf_counter() - start)
        return rate, ex.stats()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2400)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=5.0)
    ap.add_argument("--inline", action="store_true", help="also time assay in this process (workers=0), to separate policy from parallelism")
    args = ap.parse_args()
    rows = pairs(args.n)
    print(f"{len(rows)} distinct pairs, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    mv = time_math_verify(rows)
    print(f"math-verify, single process : {mv:8.1f} items/s")
    rate, st = time_assay(rows, args.workers, args.batch, args.timeout)
    print(f"assay executor, {args.workers} workers : {rate:8.1f} items/s  (timeouts {st['reward/executor/timeouts']:.0f}, failures {st['reward/executor/failures']:.0f})")
    print(f"speed-up                    : {rate / mv:8.2f}x")
    if args.inline:
        one, _ = time_assay(rows, 0, args.batch, args.timeout)
        print(f"assay, inline (1 process)   : {one:8.1f} items/s  ({one / mv:.2f}x: the exact/string fast paths alone)")


if __name__ == "__main__":
    main()
