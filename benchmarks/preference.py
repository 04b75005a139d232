"""GRPO, online DPO, offline DPO and best-of-N SFT on the bundled task at equal sampled completions (docs/preference.md).

Every method starts from the bundled `tiny-arith` policy, is scored by the task's own verifier
and draws the same number of completions: `--steps` × 16 prompts × 8 completions, the prompts
in the same seeded order.

* `grpo`: `assay train` as it comes (GRPO, one update a step).
* `online_dpo`: `assay train algo.objective=dpo`: each step's groups give pairs (best against
  worst, ties dropped), one DPO update a step, the reference the policy as the step began.
* `raft`: `assay train algo.objective=raft`: SFT on each group's best verified-right completion.
* `offline_dpo`: `assay po pairs` samples every completion from the starting model at once and
  pairs them the same way; `assay po train` then makes the same number of DPO updates, one
  pass over the pairs, with the reference kept at the starting model.

Each run is its own process (`assay` on the command line). Held-out greedy accuracy on the
task's 500 held-out problems every `--eval-every` steps. The x-axes: completions behind the
updates made so far (offline DPO: behind the pairs it has trained on) and wall time spent
sampling, scoring and updating (from the runs' own `perf/step_s` and `po/step_seconds`, plus
the offline pairs' sampling; evaluation and start-up left out). Seeds run interleaved, method
after method, so a busy stretch of a shared machine falls on every method alike.

    PYTHONPATH=src python benchmarks/preference.py --seeds 0 1 2 --steps 100 --out benchmarks/results-preference.json \\
        --plot docs/img/preference.png
    PYTHONPATH=src python benchmarks/preference.py --seeds 0 1 2 --steps 100 --methods offline_ipo offline_dpo_lr1e-5 \\
        --out benchmarks/results-preference-offline.json --plot /tmp/offline.png     # the same pairs, other settings
    PYTHONPATH=src python benchmarks/preference.py --replot benchmarks/results-preference.json \\
        benchmarks/results-preference-offline.json --plot docs/img/preference.png    # both on one plot
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

PROMPTS, GROUP = 16, 8
ONLINE = {"grpo": [], "online_dpo": ["algo.objective=dpo"], "raft": ["algo.objective=raft"]}
COMMON = ["optim.lr=5e-5", "optim.warmup_steps=10", "train.eval_n=500", "train.save_every=0", "train.samples_every=0"]
#: offline variants on the same pairs (not in the default comparison): `--methods offline_ipo offline_dpo_lr1e-5`
OFFLINE = {"offline_dpo": [], "offline_ipo": ["loss=ipo", "loss_args={beta: 1.0}"], "offline_dpo_lr1e-5": ["optim.lr=1e-5"]}
LABELS = {"grpo": "GRPO", "online_dpo": "online DPO", "offline_dpo": "offline DPO (base-model pairs)", "raft": "best-of-N SFT (RAFT)",
          "offline_ipo": "offline IPO, β = 1", "offline_dpo_lr1e-5": "offline DPO, lr 1e-5"}


def assay(*args: str) -> str:
    """Run `assay ARGS` in its own process; its standard output."""
    out = subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"assay {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def online(method: str, seed: int, steps: int, every: int, work: Path) -> dict:
    name = f"{method}-s{seed}"
    assay("train", f"seed={seed}", f"train.steps={steps}", f"train.eval_every={every}", f"output_dir={work}", f"run_name={name}",
          "--no-progress", *COMMON, *ONLINE[method])
    wall, curve = 0.0, []
    for r in rows(work / name):
        wall += r.get("perf/step_s", 0.0)
        if r.get("eval/accuracy") is not None and (not curve or curve[-1][0] != r["step"] * PROMPTS * GROUP):
            curve.append((r["step"] * PROMPTS * GROUP, wall, r["eval/accuracy"]))
    return {"curve": curve}


def offline(method: str, seed: int, steps: int, every: int, work: Path) -> dict:
    name = f"{method}-s{seed}"
    pairs, counted = work / f"pairs-s{seed}.jsonl", work / f"pairs-s{seed}.json"
    if not counted.is_file():  # the variants train on the same pairs as offline_dpo
        counted.write_text(assay("po", "pairs", "--out", str(pairs), "--prompts", str(steps * PROMPTS), "--group-size", str(GROUP),
                                 "--seed", str(seed), "--json"))
    counts = json.loads(counted.read_text())
    sampled = counts["seconds"]  # generating and scoring every completion, before the first update
    n = len(pairs.read_text().splitlines())
    batch = max(1, round(n / steps))  # one pass over the pairs in as many updates as the online runs make
    assay("po", "train", f"data.path={pairs}", "data.eval_fraction=0", f"train.steps={steps}", f"train.batch_size={batch}",
          f"train.eval_every={every}", f"output_dir={work}", f"run_name={name}", "eval.task=arithmetic", "eval.n=500", f"seed={seed}",
          "optim.lr=5e-5", "optim.warmup_steps=10", "train.save_every=0", "--no-progress", *OFFLINE[method])
    per_pair = steps * PROMPTS * GROUP / n  # completions drawn per pair kept
    wall, curve = 0.0, []
    for r in rows(work / name):
        wall += r.get("po/step_seconds", 0.0)
        if r.get("eval/accuracy") is not None:
            curve.append((r["step"] * batch * per_pair, sampled + wall, r["eval/accuracy"]))
    return {"curve": curve, "pairs": n, "batch_size": batch, "sampling_s": sampled}


def summarise(results: dict) -> dict:
    out = {}
    for method, runs in results.items():
        finals = [r["curve"][-1][2] for r in runs]
        walls = [r["curve"][-1][1] for r in runs]
        quarter = [min(r["curve"], key=lambda p: abs(p[0] - r["curve"][-1][0] / 4))[2] for r in runs]
        peak = [max(p[2] for p in r["curve"]) for r in runs]
        out[method] = {"final_mean": sum(finals) / len(finals), "final_min": min(finals), "final_max": max(finals),
                       "quarter_mean": sum(quarter) / len(quarter), "peak_mean": sum(peak) / len(peak), "start": runs[0]["curve"][0][2],
                       "wall_mean": sum(walls) / len(walls), "wall_min": min(walls), "wall_max": max(walls)}
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for method, runs in results.items():
        color = {"grpo": "C0", "online_dpo": "C1", "offline_dpo": "C2", "raft": "C3", "offline_ipo": "C4", "offline_dpo_lr1e-5": "C5"}[method]
        for i, r in enumerate(runs):
            xs, ws, ys = zip(*r["curve"])
            style = {"color": color, "alpha": 0.8, "lw": 1.2, "ls": "--" if method in OFFLINE and method != "offline_dpo" else "-"}
            axes[0].plot(xs, ys, label=LABELS[method] if i == 0 else None, **style)
            axes[1].plot(ws, ys, label=LABELS[method] if i == 0 else None, **style)
    axes[0].set_xlabel("completions sampled (behind the updates so far)")
    axes[1].set_xlabel("wall time: sampling, scoring, updates (s)")
    axes[0].set_ylabel("held-out greedy accuracy (500 problems)")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("tiny-arith on two-number addition, 3 seeds each (one line per seed)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--methods", nargs="+", default=["grpo", "online_dpo", "offline_dpo", "raft"])
    p.add_argument("--workdir", default="runs/preference-bench")
    p.add_argument("--out", default="benchmarks/results-preference.json")
    p.add_argument("--plot", default="docs/img/preference.png")
    p.add_argument("--replot", nargs="+", metavar="JSON", help="no runs: plot the runs of these result files together")
    a = p.parse_args()
    if a.replot:
        merged: dict = {}
        for f in a.replot:
            merged.update(json.loads(Path(f).read_text())["runs"])
        plot(merged, Path(a.plot))
        return
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    results: dict = {m: [] for m in a.methods}
    for seed in a.seeds:
        for method in a.methods:
            t0 = time.perf_counter()
            got = offline(method, seed, a.steps, a.eval_every, work) if method in OFFLINE else online(method, seed, a.steps, a.eval_every, work)
            got["seed"] = seed
            results[method].append(got)
            print(f"{method} seed {seed}: held-out {got['curve'][0][2]:.3f} -> {got['curve'][-1][2]:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    report = {"steps": a.steps, "prompts_per_step": PROMPTS, "group_size": GROUP, "seeds": a.seeds, "summary": summarise(results),
              "runs": results}
    Path(a.out).write_text(json.dumps(report, indent=1))
    plot(results, Path(a.plot))
    for method, s in report["summary"].items():
        print(f"{method:12s} final {s['final_mean']:.3f} [{s['final_min']:.3f}, {s['final_max']:.3f}]  at 1/4 budget {s['quarter_mean']:.3f}  "
              f"peak {s['peak_mean']:.3f}  "
              f"wall {s['wall_mean']:.1f} s [{s['wall_min']:.1f}, {s['wall_max']:.1f}]")


if __name__ == "__main__":
    main()
