"""Compare advantage estimators and losses on the bundled default task, same seed and budget.

    python benchmarks/algorithms.py --steps 200 --out runs/algorithms-benchmark

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


def run(name: str, overrides: list[str], out: Path, steps: int, eval_every: int, seed: int, threads: int, minibatches: int) -> list[dict]:
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    run_name = name.replace("+", "p").replace(".", "")
    shutil.rmtree(out / run_name, ignore_errors=True)
    cfg = load_config(None, [*overrides, f"train.steps={steps}", f"train.eval_every={eval_every}", f"seed={seed}",
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads per run")
    ap.add_argument("--minibatches", type=int, default=4, help="optimizer steps per batch of rollouts")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="a subset of the variants")
    ap.add_argument("--out", default="runs/algorithms-benchmark")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [summarise(n, run(n, VARIANTS[n], out, args.steps, args.eval_every, args.seed, args.threads, args.minibatches))
               for n in (args.only or VARIANTS)]
    lines = ["| variant | held-out start | held-out end | best | train reward (last 10%) | clip frac (mean) | seconds |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['start']:.3f} | {r['end']:.3f} | {r['best']:.3f} | {r['train_reward_tail']:.3f} | {r['clip_frac']:.4f} | {r['seconds']:.0f} |"
              for r in results]
    table = "\n".join(lines)
    (out / "table.md").write_text(f"{args.steps} steps, seed {args.seed}, {args.minibatches} minibatches, bundled model tiny-arith\n\n{table}\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for r in results:
        ax.plot([s for s, _ in r["curve"]], [a for _, a in r["curve"]], marker="o", label=r["variant"])
    ax.set(xlabel="step", ylabel="held-out greedy accuracy", title=f"tiny-arith, {args.steps} steps, seed {args.seed}, {args.minibatches} minibatches")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "heldout_accuracy.png")
    print(table)


if __name__ == "__main__":
    main()
