"""Held-out accuracy of the same `assay train` run under two rollout backends, on one plot.

    assay train rollout.backend=torch run_name=curve-torch      # .venv-engine/bin/assay for both
    assay train rollout.backend=vllm run_name=curve-vllm
    python benchmarks/engine_curves.py runs/curve-torch runs/curve-vllm --out docs/img/engines-heldout.png

Prints each run's held-out greedy accuracy at every evaluation and its largest per-step
mean |learner − sampler| logprob gap (`mismatch/abs_diff_mean`, when the run logged it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from assay.report.metrics import read_metrics


def curve(run: Path) -> tuple[list[int], list[float], float | None]:
    rows = read_metrics(run / "metrics.jsonl")
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if r.get("eval/accuracy") is not None]
    gaps = [r["mismatch/abs_diff_mean"] for r in rows if "mismatch/abs_diff_mean" in r]
    return [s for s, _ in evals], [a for _, a in evals], max(gaps) if gaps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders")
    p.add_argument("--out", required=True, help="PNG to write")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in map(Path, args.runs):
        import yaml

        backend = yaml.safe_load((run / "config.yaml").read_text())["rollout"]["backend"]
        steps, acc, gap = curve(run)
        ax.plot(steps, acc, marker="o", ms=3, label=f"rollout.backend={backend}")
        print(f"{run.name} ({backend}): " + ", ".join(f"{s}:{a:.3f}" for s, a in zip(steps, acc))
              + (f"; largest step mean |Δ logprob| {gap:.2e}" if gap is not None else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("assay train (bundled task, seed 0): torch sampler vs vLLM engine", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
