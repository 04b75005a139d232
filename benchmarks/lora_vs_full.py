"""LoRA (`model.lora`) against full fine-tuning on the main job: held-out accuracy, trainable parameters, peak memory, seconds per step.

    python benchmarks/lora_vs_full.py --seeds 0 1 2 --out runs/lora-vs-full

Runs the main job (`assay train`: 200 steps on the bundled model) once per seed and variant,
each in its own process, the variants alternating. Full fine-tuning keeps the main job's
learning rate; LoRA (r=8, alpha=16, every projection) takes a larger one, as LoRA usually
does (`--lora-lr`, default 1e-3). Peak memory is the process's peak resident set
(`ru_maxrss`), which includes Python, torch and the tokenizer (the same for both); the
fp32 gradients and AdamW moments of the trainable parameters (12 bytes each) are what differs. Writes `results.json` and
`table.md` to `--out`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, statistics, sys
from assay import train
result = train(None, *sys.argv[1:], progress=False)
rows = result.metrics()
steps = [r for r in rows if "perf/step_s" in r]
print(json.dumps({**result.final, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "median_step_s": statistics.median(r["perf/step_s"] for r in steps),
                  "median_update_s": statistics.median(r["perf/update_s"] for r in steps)}))
"""


def variants(lora_lr: float) -> dict[str, list[str]]:
    return {"full": [], "lora": ["model.lora={r: 8, alpha: 16}", f"optim.lr={lora_lr}"]}


def run(name: str, seed: int, overrides: list[str], out: Path, steps: int, threads: int) -> dict:
    shutil.rmtree(out / f"{name}-s{seed}", ignore_errors=True)
    args = [f"output_dir={out}", f"run_name={name}-s{seed}", f"seed={seed}", f"train.steps={steps}", f"train.threads={threads}",
            "train.save_every=0", *overrides]
    p = subprocess.run([sys.executable, "-c", CHILD, *args], check=True, capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[int, dict]]) -> str:
    lines = ["| variant | seed | held-out start | held-out end | trainable params | grads + AdamW (MiB) | peak RSS (MiB) | median step (s) | median update (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, by_seed in results.items():
        for seed, r in by_seed.items():
            lines.append(f"| {name} | {seed} | {r['held-out accuracy at start']:.3f} | {r['held-out accuracy at end']:.3f} | "
                         f"{r['trainable parameters']:,} | {r['trainable parameters'] * 12 / 2**20:.2f} | {r['peak_rss_mib']:.0f} | {r['median_step_s']:.3f} | {r['median_update_s']:.3f} |")
    for name, by_seed in results.items():
        end = [r["held-out accuracy at end"] for r in by_seed.values()]
        lines.append(f"\n{name}: held-out at end {statistics.mean(end):.3f} (range {min(end):.3f}–{max(end):.3f}); median step "
                     f"{statistics.median(r['median_step_s'] for r in by_seed.values()):.3f} s; peak RSS "
                     f"{statistics.median(r['peak_rss_mib'] for r in by_seed.values()):.0f} MiB")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="train.threads (default 0, the main job's)")
    p.add_argument("--lora-lr", type=float, default=1e-3)
    p.add_argument("--out", type=Path, default=Path("runs/lora-vs-full"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict]] = {n: {} for n in variants(args.lora_lr)}
    for seed in args.seeds:
        for name, overrides in variants(args.lora_lr).items():
            results[name][seed] = run(name, seed, overrides, args.out, args.steps, args.threads)
            print(f"{name} seed {seed}: {results[name][seed]['held-out accuracy at end']:.3f}", file=sys.stderr)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
