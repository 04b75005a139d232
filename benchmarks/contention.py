"""A GRPO step on a shared machine: idle, then with a busy loop pinned to one core.

Runs assay's bench step (`assay.bench`, the same worker as `assay bench train`) four ways
and reports seconds per step, idle and loaded, and the slowdown:

- `threads=N` fixed (the old default: one torch thread per core, whatever else runs);
- `threads=N` with `OMP_WAIT_POLICY=PASSIVE` (OpenMP threads sleep instead of spinning at barriers);
- `train.threads=0` (assay's default: `assay.threads.ThreadGovernor` follows the free cores);
- `threads=1` (the manual workaround).

    python benchmarks/contention.py --steps 6 --warmup 2 --json runs/contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from assay.bench.config import load_bench_config
from assay.bench.train import available_threads, prepare_model, run_worker

BUSY = "import os\nos.sched_setaffinity(0, {%d})\nwhile True:\n    pass\n"


def busy_loop(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY % core])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each setting, idle and loaded (median reported)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cores = available_threads()
    cfg = load_bench_config(None, steps=args.steps, warmup=args.warmup)
    work = Path(tempfile.mkdtemp(prefix="assay-contention-"))
    model_dir, desc = prepare_model(cfg, work)
    settings = {f"threads={cores} (fixed)": (cores, {}), f"threads={cores}, OMP_WAIT_POLICY=PASSIVE": (cores, {"OMP_WAIT_POLICY": "PASSIVE"}),
                "train.threads=0 (follows free cores)": (0, {}), "threads=1 (fixed)": (1, {})}
    out: dict = {"cores": cores, "model": desc, "config": cfg.model_dump(mode="json"), "settings": {}}
    runs = 0
    for loaded in (False, True):
        for name, (threads, env) in settings.items():
            times = []
            for _ in range(args.repeats):
                runs += 1
                run_dir = work / f"run{runs}"
                run_dir.mkdir()
                hog = busy_loop(cores - 1) if loaded else None
                try:
                    time.sleep(0.5)
                    r = run_worker("assay", cfg, model_dir, run_dir, threads, env_extra=env)
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
                steps = [s["s"] for s in r["steps"][args.warmup :]]
                times.append(sum(steps) / len(steps))
            times.sort()
            out["settings"].setdefault(name, {})["loaded" if loaded else "idle"] = times[len(times) // 2]
            print(f"{'loaded' if loaded else 'idle':>6}  {name:<40} {times[len(times) // 2]:.3f} s/step  (runs: {', '.join(f'{t:.3f}' for t in times)})", flush=True)
    print(f"\n| setting ({cores} cores) | idle s/step | one core busy s/step | slowdown |\n|---|---|---|---|")
    for name, r in out["settings"].items():
        r["slowdown"] = r["loaded"] / r["idle"]
        print(f"| {name} | {r['idle']:.3f} | {r['loaded']:.3f} | {r['slowdown']:.2f}× |")
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
