"""Compare advantage estimators and losses on the bundled default task, same seed and budget.

    python benchmarks/algorithms.py --steps 300 --out benchmarks/results/algorithms

Runs `assay train` once per variant (one after the other, same seed, same steps, same
learning rate), then writes `table.md` (held-out greedy accuracy at start and end, best,
mean train reward over the last 10% of steps, seconds) and `heldout_accuracy.png`
(held-out accuracy against step, one line per variant).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

VARIANTS = {
    "GRPO": ["algo.advantage=grpo"],
    "Dr.GRPO": ["algo.advantage=dr_grpo", "algo.aggregation=seq-mean-token-sum-norm"],
    "RLOO": ["algo.advantage=rloo"],
    "REINFORCE++": ["algo.advantage=reinforce_pp"],
    "GSPO": ["algo.advantage=grpo", "algo.loss=gspo", "algo.aggregation=seq-mean-token-mean"],
    "CISPO": ["algo.advantage=grpo", "algo.loss=cispo"],
}


def run(name: str, overrides: list[str], out: Path, steps: int, eval_every: int, seed: int) -> list[dict]:
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.train.rl import Trainer

    cfg = load_config(None, [*overrides, f"train.steps={steps}", f"train.eval_every={eval_every}", f"seed={seed}",
                             f"output_dir={out}", f"run_name={name.replace('+', 'p').replace('.', '')}", "train.save_every=0"])
    result = Trainer(cfg).fit(progress=True)
    return read_metrics(result.run_dir / "metrics.jsonl")


def summarise(name: str, rows: list[dict]) -> dict:
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    train = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    tail = train[-max(1, len(train) // 10):]
    return {"variant": name, "start": evals[0][1], "end": evals[-1][1], "best": max(a for _, a in evals),
            "train_reward_tail": sum(tail) / len(tail), "seconds": sum(r.get("perf/step_s", 0) for r in rows), "curve": evals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="a subset of the variants")
    ap.add_argument("--out", default="benchmarks/results/algorithms")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [summarise(n, run(n, VARIANTS[n], out, args.steps, args.eval_every, args.seed)) for n in (args.only or VARIANTS)]
    lines = ["| variant | held-out start | held-out end | best | train reward (last 10%) | seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['start']:.3f} | {r['end']:.3f} | {r['best']:.3f} | {r['train_reward_tail']:.3f} | {r['seconds']:.0f} |" for r in results]
    table = "\n".join(lines)
    (out / "table.md").write_text(f"{args.steps} steps, seed {args.seed}, bundled model tiny-arith\n\n{table}\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in results:
        ax.plot([s for s, _ in r["curve"]], [a for _, a in r["curve"]], marker="o", label=r["variant"])
    ax.set(xlabel="step", ylabel="held-out greedy accuracy", title=f"tiny-arith, {args.steps} steps, seed {args.seed}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "heldout_accuracy.png")
    print(table)


if __name__ == "__main__":
    main()
