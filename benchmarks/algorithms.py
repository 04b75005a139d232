"""Compare advantage estimators and losses on a bundled task, same seeds and budget.

    python benchmarks/algorithms.py --steps 200 --out runs/algorithms-benchmark
    python benchmarks/algorithms.py --config examples/sum3.yaml --seeds 3 --out runs/algorithms-sum3

Runs `assay train` once per variant (one after the other, same seed, same steps, same
learning rate, `--threads` torch threads). Each batch of rollouts is split into
`--minibatches` optimizer steps (default 4). With one on-policy step per batch the ratio
is 1 at every update, so ppo_clip and cispo have the same gradient and the losses could
not differ. Then it writes `table.md` (held-out greedy accuracy at start and end, best,
mean train reward over the last 10% of steps, mean `actor/clip_frac`, seconds) and
`heldout_accuracy.png` (held-out accuracy against step, one line per variant). A
variant's run folder is replaced, so a rerun never mixes in an older run's rows.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

VARIANTS = {
    "GRPO": ["algo.advantage=grpo"],
    "Dr.GRPO": ["algo.advantage=dr_grpo", "algo.aggregation=seq-mean-token-sum-norm"],
    "RLOO": ["algo.advantage=rloo"],
    "REINFORCE++": ["algo.advantage=reinforce_pp"],
    "GSPO": ["algo.advantage=grpo", "algo.loss=gspo", "algo.aggregation=seq-mean-token-mean"],
    "CISPO": ["algo.advantage=grpo", "algo.loss=cispo"],
}


def run(name: str, overrides: list[str], out: Path, steps: int, eval_every: int, seed: int, threads: int, minibatches: int,
        config: str | None = None) -> list[dict]:
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    run_name = name.replace("+", "p").replace(".", "") + f"-seed{seed}"
    shutil.rmtree(out / run_name, ignore_errors=True)
    cfg = load_config(config, [*overrides, f"train.steps={steps}", f"train.eval_every={eval_every}", f"seed={seed}",
                             f"output_dir={out}", f"run_name={run_name}", "train.save_every=0", f"train.threads={threads}",
                             f"algo.minibatches={minibatches}"])
    result = Trainer(cfg).fit(progress=True)
    return read_metrics(result.run_dir / "metrics.jsonl")


def summarise(name: str, rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    train = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    tail = train[-max(1, len(train) // 10):]
    clip = [r["actor/clip_frac"] for r in rows if r.get("actor/clip_frac") is not None]
    return {"variant": name, "start": evals[0][1], "end": evals[-1][1], "best": max(a for _, a in evals),
            "train_reward_tail": sum(tail) / len(tail), "clip_frac": sum(clip) / len(clip) if clip else float("nan"),
            "seconds": sum(r.get("perf/step_s", 0) for r in rows), "curve": evals}


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # Student's t, 97.5th percentile, by dof


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% confidence interval (Student's t; 0 for one value)."""
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, 0.0
    sd = (sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) ** 0.5
    return m, T95.get(len(xs) - 1, 1.96) * sd / len(xs) ** 0.5


def ranking(stats: dict[str, tuple[float, float]]) -> str:
    """Variants ranked by mean; those whose interval overlaps the best one's are said to tie with it."""
    order = sorted(stats, key=lambda v: -stats[v][0])
    best_m, best_h = stats[order[0]]
    tied = [v for v in order if stats[v][0] + stats[v][1] >= best_m - best_h]
    rest = [v for v in order if v not in tied]
    line = f"Ranked by held-out accuracy at the end: {' > '.join(order)}. "
    if len(tied) == len(order):
        return line + "Every interval overlaps the best one's: at this budget and number of seeds the variants tie."
    return line + f"{', '.join(tied)} tie at the top (overlapping intervals); {', '.join(rest)} are below them."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0, help="the first seed")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per variant (seed, seed+1, ...); 2 or more gives 95%% intervals")
    ap.add_argument("--config", default=None, help="a run config to train on (its model and task); default: the bundled default run")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per batch of rollouts")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="a subset of the variants")
    ap.add_argument("--out", default="runs/algorithms-benchmark")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = list(range(args.seed, args.seed + args.seeds))
    per: dict[str, list[dict]] = {}
    for n in args.only or VARIANTS:
        per[n] = [summarise(n, run(n, VARIANTS[n], out, args.steps, args.eval_every, seed, args.threads, args.minibatches, args.config))
                  for seed in seeds]
    def cell(n: str, key: str, fmt: str = ".3f") -> str:
        m, h = mean_ci([r[key] for r in per[n]])
        return f"{m:{fmt}} ± {h:{fmt}}" if len(seeds) > 1 else f"{m:{fmt}}"
    lines = ["| variant | held-out start | held-out end | best | train reward (last 10%) | clip frac (mean) | seconds (mean) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {n} | {cell(n, 'start')} | {cell(n, 'end')} | {cell(n, 'best')} | {cell(n, 'train_reward_tail')} | {cell(n, 'clip_frac', '.4f')} "
              f"| {mean_ci([r['seconds'] for r in per[n]])[0]:.0f} |" for n in per]
    table = "\n".join(lines)
    what = f"{args.steps} steps, seeds {seeds}, {args.minibatches} minibatches, config {args.config or 'the default run (tiny-arith)'}"
    verdict = ranking({n: mean_ci([r["end"] for r in per[n]]) for n in per}) if len(seeds) > 1 else ""
    (out / "table.md").write_text(f"{what}\n\n{table}\n\n{verdict}\n" if verdict else f"{what}\n\n{table}\n")
    (out / "results.json").write_text(json.dumps({n: rs for n, rs in per.items()}, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for n, rs in per.items():
        steps = [s for s, _ in rs[0]["curve"]]
        curves = [[a for _, a in r["curve"]] for r in rs if len(r["curve"]) == len(steps)]
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(len(steps))]
        line, = ax.plot(steps, mean, marker="o", label=n)
        if len(curves) > 1:
            ax.fill_between(steps, [min(c[i] for c in curves) for i in range(len(steps))], [max(c[i] for c in curves) for i in range(len(steps))],
                            color=line.get_color(), alpha=0.15)
    ax.set(xlabel="step", ylabel="held-out greedy accuracy", title=what if len(what) < 70 else what[:67] + "...")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "heldout_accuracy.png")
    print(table)
    if verdict:
        print(verdict)


if __name__ == "__main__":
    main()
