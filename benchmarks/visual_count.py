"""`examples/visual-count.yaml` with the pictures and with them blanked: does RL on the bundled VLM learn to look?

    python benchmarks/visual_count.py --seeds 0 1 2 --out runs/visual-count --docs

Runs the example once per seed and arm, each in its own process, the arms alternating (pictures
seed 0, blank seed 0, ...) so a change in the machine's load falls on both. The `blank` arm is the
same run with `data.task_args.blank=true`: every picture, training and held-out, is black, the
questions and answers unchanged, so whatever it gains is what a policy can learn without seeing.
Writes `results.json`, `table.md` and `heldout.png` (held-out accuracy per step, both arms, and the
pictures arm's accuracy on the same questions about other rows' pictures) to `--out`; `--docs` also
copies the figure to docs/img/visual-count.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]
ARMS = {"pictures": [], "blank": ["data.task_args.blank=true"]}


def run(arm: str, seed: int, out: Path, extra: list[str]) -> list[dict]:
    from assay.report.metrics import read_metrics

    name = f"{arm}-s{seed}"
    shutil.rmtree(out / name, ignore_errors=True)
    cmd = [sys.executable, "-m", "assay.cli", "train", str(ROOT / "examples" / "visual-count.yaml"), "--no-progress", f"output_dir={out}",
           f"run_name={name}", f"seed={seed}", "train.save_every=0", *ARMS[arm], *extra]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return read_metrics(out / name / "metrics.jsonl")


def evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("eval/accuracy") is not None]


def summarise(runs: dict[str, dict[int, list[dict]]]) -> dict:
    out: dict = {}
    for arm, by_seed in runs.items():
        seeds = {}
        for seed, rows in by_seed.items():
            e = evals(rows)
            seeds[seed] = {"start": e[0]["eval/accuracy"], "end": e[-1]["eval/accuracy"], "best": max(r["eval/accuracy"] for r in e),
                           "end_shuffled": e[-1].get("eval/accuracy_shuffled_images"), "wall_s": e[-1]["perf/wall_s"],
                           "alarms": [r["alarm"] for r in rows if r.get("alarm")]}
        gains = [s["end"] - s["start"] for s in seeds.values()]
        out[arm] = {"seeds": seeds, "gain_mean": statistics.mean(gains), "gain_min": min(gains), "gain_max": max(gains),
                    "wall_mean_s": statistics.mean(s["wall_s"] for s in seeds.values())}
    return out


def table(summary: dict) -> str:
    lines = ["| arm | seed | held-out at start | at end | best | end, other rows' pictures | wall (s) | alarms |", "|---|---|---|---|---|---|---|---|"]
    for arm, a in summary.items():
        for seed, s in a["seeds"].items():
            shuffled = "-" if s["end_shuffled"] is None else f"{s['end_shuffled']:.3f}"
            lines.append(f"| {arm} | {seed} | {s['start']:.3f} | {s['end']:.3f} | {s['best']:.3f} | {shuffled} | {s['wall_s']:.0f} | "
                         f"{'; '.join(s['alarms']) or 'none'} |")
    for arm, a in summary.items():
        lines.append(f"\n{arm}: gain {a['gain_mean']:+.3f} on average (from {a['gain_min']:+.3f} to {a['gain_max']:+.3f}), "
                     f"{a['wall_mean_s']:.0f} s a run")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    style = {"pictures": ("tab:blue", "with the pictures"), "blank": ("tab:red", "pictures blanked")}
    for arm, by_seed in runs.items():
        colour, label = style[arm]
        for i, (seed, rows) in enumerate(sorted(by_seed.items())):
            e = evals(rows)
            ax.plot([r["step"] for r in e], [r["eval/accuracy"] for r in e], marker=".", color=colour, alpha=0.8, label=label if i == 0 else None)
            if arm == "pictures":
                ax.plot([r["step"] for r in e], [r["eval/accuracy_shuffled_images"] for r in e], linestyle=":", color=colour, alpha=0.6,
                        label="with the pictures: asked about another row's picture" if i == 0 else None)
    ax.set(xlabel="step", ylabel="held-out greedy accuracy", ylim=(0, 1.005))
    ax.legend(loc="center right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", type=Path, default=Path("runs/visual-count"))
    p.add_argument("--docs", action="store_true", help="also copy the plot to docs/img/visual-count.png")
    p.add_argument("overrides", nargs="*", help="more key=value overrides for every run")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[int, list[dict]]] = {arm: {} for arm in ARMS}
    for seed in args.seeds:
        for arm in ARMS:
            runs[arm][seed] = rows = run(arm, seed, args.out, args.overrides)
            e = evals(rows)
            print(f"{arm} seed {seed}: {e[0]['eval/accuracy']:.3f} -> {e[-1]['eval/accuracy']:.3f} in {e[-1]['perf/wall_s']:.0f} s", file=sys.stderr)
    summary = summarise(runs)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "table.md").write_text(table(summary))
    plot(runs, args.out / "heldout.png")
    if args.docs:
        shutil.copy(args.out / "heldout.png", ROOT / "docs" / "img" / "visual-count.png")
    print(table(summary))


if __name__ == "__main__":
    main()
