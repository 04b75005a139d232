"""Throughput of the sandbox: trivial Python programs, and programs with 10 tests each.

    python benchmarks/sandbox_throughput.py [--workers N] [--programs 100]

Prints programs/s and tests/s for (1) one-test trivial programs straight through the
`SandboxPool` and (2) through the `code` reward (extraction, sandbox, grading in the parent),
then (3) 10-test programs through the reward. Every program runs in its own bwrap sandbox.
"""

from __future__ import annotations

import argparse
import os
import time

from assay.rewards.code import CodeReward
from assay.sandbox import Job, SandboxPool, language
from assay.sandbox.pool import default_workers
from assay.types import Sample, Trajectory

TRIVIAL = "print(int(input()) + 1)"


def bench_pool(pool: SandboxPool, n: int) -> tuple[float, float]:
    jobs = [Job(language("python"), TRIVIAL, "stdio", [{"input": str(i)}]) for i in range(n)]
    start = time.perf_counter()
    results = pool.run(jobs)
    secs = time.perf_counter() - start
    assert all(r.cases[0].stdout == f"{i + 1}\n".encode() for i, r in enumerate(results)), "wrong outputs"
    return n / secs, n / secs


def bench_reward(reward: CodeReward, n: int, n_tests: int) -> tuple[float, float]:
    tests = {"kind": "stdio", "cases": [{"input": str(j), "output": str(j + 1)} for j in range(n_tests)]}
    batch = [Trajectory(Sample(str(i), "add one", None, {"tests": tests}), f"```python\n{TRIVIAL}\n```",
                        [], [], [], True) for i in range(n)]
    start = time.perf_counter()
    out = reward(batch)
    secs = time.perf_counter() - start
    assert all(r.score == 1.0 for r in out), "a correct program did not pass"
    return n / secs, n * n_tests / secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--programs", type=int, default=100)
    args = ap.parse_args()
    pool = SandboxPool(workers=args.workers)
    reward = CodeReward(mode="all", workers=args.workers)
    bench_pool(pool, 2 * args.workers)  # warm-up: workers started, harness cached
    bench_reward(reward, 2 * args.workers, 1)
    print(f"cores={len(os.sched_getaffinity(0))} workers={args.workers} programs={args.programs}")
    for name, (progs, tests) in [
        ("trivial, pool", bench_pool(pool, args.programs)),
        ("trivial, code reward", bench_reward(reward, args.programs, 1)),
        ("10 tests, code reward", bench_reward(reward, max(10, args.programs // 2), 10)),
    ]:
        print(f"{name:<24} {progs:7.1f} programs/s {tests:8.1f} tests/s")
    pool.close()


if __name__ == "__main__":
    main()
