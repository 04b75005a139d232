"""What a judge costs: pointwise judging through `assay serve model`, cold and cached.

Starts `assay serve model MODEL --port 0` as a subprocess and scores `--items` distinct
completions with a pointwise `judge` (`{completion}+0=`: the bundled model repeats the number,
so every reply parses), at each `--concurrency`, then the same batch again from the cache.
Prints seconds and items per second for each, and the server's request count.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/judge_overhead.py --items 128 --concurrency 1 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from assay.rewards.judge import Judge
from assay.types import Sample, Trajectory


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny-arith")
    p.add_argument("--items", type=int, default=128)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", "model", args.model, "--port", "0", "--max-new-tokens", "8"],
                            stdout=subprocess.PIPE, text=True, env=env)
    url = proc.stdout.readline().split(" on ")[-1].strip()
    try:
        rows = []
        for c in args.concurrency:
            batch = [Trajectory(Sample(str(i), "q"), str(1000 * c + i), [], [], [], True, group=i) for i in range(args.items)]
            judge = Judge(url, api="completions", template="{completion}+0=", low=0, high=10**6, max_tokens=8, concurrency=c)
            for label in ("cold", "cached"):
                t0 = time.perf_counter()
                out = judge(batch)
                s = time.perf_counter() - t0
                scored = sum(r.score is not None for r in out)
                rows.append({"concurrency": c, "pass": label, "seconds": round(s, 3), "items_per_s": round(args.items / s, 1), "scored": scored})
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            requests = json.loads(r.read())["requests"]
        for row in rows:
            print(json.dumps(row))
        print(json.dumps({"server_requests": requests}))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
