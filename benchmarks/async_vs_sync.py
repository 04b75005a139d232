"""The main job synchronous (`rollout.max_staleness=0`) against asynchronous (`=1`), held-out accuracy against wall time.

    python benchmarks/async_vs_sync.py --seeds 0 1 2 --out runs/async-vs-sync

Runs `assay train` (the main job: 200 steps, held-out evaluation every 20) once per seed and
mode, each in its own process, the modes alternating (sync seed 0, async seed 0, sync seed
1, ...) so a change in the machine's load falls on both. Same budget: the same steps, the
same prompts and completions per step, the same `--threads` (default 0, the main job's own:
the cores other processes leave free, re-read every step). The target is
the synchronous runs' mean final held-out accuracy (the main job's); a run's time to it is
`perf/wall_s` (seconds since the run began, evaluations included) of its first evaluation at
or above it. Writes `results.json`, `table.md` and `heldout_vs_time.png` (every run's
held-out accuracy against wall time, both modes on one plot) to `--out`; `--docs` also copies
the figure to docs/img/async-vs-sync.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

MODES = {"sync": 0, "async": 1}


def run(mode: str, seed: int, out: Path, steps: int, threads: int, extra: list[str]) -> list[dict]:
    from assay.report.metrics import read_metrics

    name = f"{mode}-s{seed}"
    shutil.rmtree(out / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "assay.cli", "train", "--no-progress", f"output_dir={out}", f"run_name={name}", f"seed={seed}",
           f"train.steps={steps}", f"train.threads={threads}", f"rollout.max_staleness={MODES[mode]}", "train.save_every=0", *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return read_metrics(out / name / "metrics.jsonl")


def curve(rows: list[dict]) -> list[tuple[float, float, int]]:
    """(wall seconds, held-out accuracy, step) of every evaluation."""
    return [(r["perf/wall_s"], r["eval/accuracy"], r["step"]) for r in rows if r.get("eval/accuracy") is not None]


def time_to(points: list[tuple[float, float, int]], target: float) -> tuple[float, int] | None:
    return next(((t, s) for t, a, s in points if a >= target - 1e-9), None)


def summarise(curves: dict[str, dict[int, list]], step_s: dict[str, dict[int, float]]) -> dict:
    target = statistics.mean(c[-1][1] for c in curves["sync"].values())
    out: dict = {"target": target, "modes": {}}
    for mode, by_seed in curves.items():
        reached = {s: time_to(c, target) for s, c in by_seed.items()}
        times = [r[0] for r in reached.values() if r is not None]
        out["modes"][mode] = {
            "seeds": {s: {"final_accuracy": c[-1][1], "wall_s": c[-1][0], "time_to_target_s": reached[s] and reached[s][0],
                          "steps_to_target": reached[s] and reached[s][1], "median_step_s": step_s[mode][s]} for s, c in by_seed.items()},
            "time_to_target_mean_s": statistics.mean(times) if len(times) == len(reached) else None,
            "time_to_target_range_s": [min(times), max(times)] if times else None,
            "wall_mean_s": statistics.mean(c[-1][0] for c in by_seed.values()),
        }
    return out


def table(summary: dict) -> str:
    lines = [f"target: {summary['target']:.3f} (mean final held-out accuracy of the synchronous runs)", "",
             "| mode | seed | final held-out | time to target (s) | steps to target | whole run (s) | median step (s) |", "|---|---|---|---|---|---|---|"]
    for mode, m in summary["modes"].items():
        for seed, r in m["seeds"].items():
            t = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
            lines.append(f"| {mode} | {seed} | {r['final_accuracy']:.3f} | {t} | {r['steps_to_target'] or '-'} | {r['wall_s']:.1f} | {r['median_step_s']:.3f} |")
    for mode, m in summary["modes"].items():
        rng = m["time_to_target_range_s"]
        mean = "n/a (a seed never reached it)" if m["time_to_target_mean_s"] is None else f"{m['time_to_target_mean_s']:.1f} s"
        lines.append(f"\n{mode}: time to target, mean over seeds {mean}" + (f", range {rng[0]:.1f}–{rng[1]:.1f} s" if rng else "")
                     + f"; whole run {m['wall_mean_s']:.1f} s")
    return "\n".join(lines) + "\n"


def plot(curves: dict[str, dict[int, list]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"sync": "tab:blue", "async": "tab:orange"}
    for mode, by_seed in curves.items():
        for i, (seed, c) in enumerate(sorted(by_seed.items())):
            ax.plot([t for t, _, _ in c], [a for _, a, _ in c], marker=".", color=colours[mode], alpha=0.8,
                    label=f"{mode} (max_staleness={MODES[mode]})" if i == 0 else None)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.3f}")
    ax.set_xlabel("wall time (s), evaluations included")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_ylim(max(0.0, min(a for c in curves["sync"].values() for _, a, _ in c) - 0.02), 1.005)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="train.threads of every run (default 0, the main job's: the free cores)")
    p.add_argument("--out", type=Path, default=Path("runs/async-vs-sync"))
    p.add_argument("--docs", action="store_true", help="also copy the plot to docs/img/async-vs-sync.png")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    curves: dict[str, dict[int, list]] = {m: {} for m in MODES}
    step_s: dict[str, dict[int, float]] = {m: {} for m in MODES}
    for seed in args.seeds:
        for mode in MODES:
            rows = run(mode, seed, args.out, args.steps, args.threads, args.overrides)
            curves[mode][seed] = curve(rows)
            step_s[mode][seed] = statistics.median(r["perf/step_s"] for r in rows if "perf/step_s" in r)
            print(f"{mode} seed {seed}: final {curves[mode][seed][-1][1]:.3f} at {curves[mode][seed][-1][0]:.1f} s", file=sys.stderr)
    summary = summarise(curves, step_s)
    summary["curves"] = {m: {s: c for s, c in by.items()} for m, by in curves.items()}
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "table.md").write_text(table(summary))
    plot(curves, summary["target"], args.out / "heldout_vs_time.png")
    if args.docs:
        shutil.copy(args.out / "heldout_vs_time.png", Path(__file__).parents[1] / "docs" / "img" / "async-vs-sync.png")
    print(table(summary))


if __name__ == "__main__":
    main()
