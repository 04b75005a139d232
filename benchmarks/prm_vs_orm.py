"""Best-of-N on held-out problems: a process reward model (min reduce) against an outcome reward model.

Both reward models start from the bundled `tiny-arith` model and get the same training time:

* the process reward model on Monte Carlo step labels of the bundled model's own solutions
  (`assay rm label-steps --steps chars:1`: each digit of an answer is a step, "Math-Shepherd:
  Verify and Reinforce LLMs Step-by-step without Human Annotations", arXiv 2312.08935),
  a solution scored by its weakest step (`reduce: min`, the min-form credit of "Stop
  Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for Reasoning",
  arXiv 2504.15275);
* the outcome reward model on `assay rm pairs` preference pairs (Bradley–Terry).

Then N=8 solutions of each held-out problem are sampled with the bundled model (temperature 1),
verified with the task's verifier, and each reward model picks one of the first N; verified
accuracy of the pick at N = 1, 2, 4, 8 (for N < 8 averaged over the 8/N disjoint groups of N
of each problem). Also reported: pass@N (any right, the ceiling), majority vote and the PRM's
other reduces. Writes a JSON file and a PNG plot.

    OMP_NUM_THREADS=1 python benchmarks/prm_vs_orm.py --out benchmarks/results-prm-vs-orm.json --plot docs/img/prm-vs-orm.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

NS = (1, 2, 4, 8)


def train(overrides: list[str]) -> Path:
    from assay.rm.config import load_rm_config
    from assay.rm.train import train_rm

    return train_rm(load_rm_config(None, overrides)).model_dir


def pick_accuracy(scores: list[list[float]], right: list[list[bool]], n: int) -> float:
    """Mean verified accuracy of the top-scored solution of each disjoint group of `n` (ties: the first)."""
    hits, groups = 0.0, 0
    for s, r in zip(scores, right):
        for g in range(0, len(s) - n + 1, n):
            best = max(range(g, g + n), key=lambda i: (s[i], -i))
            hits += r[best]
            groups += 1
    return hits / groups


def vote_accuracy(answers: list[list[str]], right: list[list[bool]], n: int) -> float:
    """Mean verified accuracy of the most common answer of each disjoint group of `n` (ties: the first)."""
    hits, groups = 0.0, 0
    for a, r in zip(answers, right):
        for g in range(0, len(a) - n + 1, n):
            counts = Counter(a[g : g + n])
            hits += r[max(range(g, g + n), key=lambda j: (counts[a[j]], -j))]
            groups += 1
    return hits / groups


def train_both(args: argparse.Namespace, work: Path) -> tuple[list[dict], float, Path, Path]:
    """Step labels and pairs from the training split, then the two reward models: `(label rows, labelling seconds, PRM, ORM)`."""
    from assay.rm.label_steps import label_steps, write_rows
    from assay.rm.pairs import build_pairs, write_pairs

    t0 = time.perf_counter()
    steps_file, pairs_file = work / "steps.jsonl", work / "pairs.jsonl"
    rows = label_steps("tiny-arith", "arithmetic", split="train", problems=args.label_problems, samples=2, rollouts=args.rollouts,
                       steps="chars:1", seed=args.seed)
    write_rows(steps_file, rows)
    label_seconds = time.perf_counter() - t0
    write_pairs(pairs_file, build_pairs("arithmetic", split="train", n=args.pairs, seed=args.seed))
    common = ["model=tiny-arith", f"output_dir={work}", "train.steps=100000", f"train.time_limit={args.seconds}", "train.eval_every=0",
              "train.save_every=0", "train.threads=1", "optim.lr=2e-4", f"seed={args.seed}"]
    prm_dir = train(["kind=prm", f"data.path={steps_file}", "run_name=prm", *common])
    orm_dir = train([f"data.path={pairs_file}", "run_name=orm", *common])
    return rows, label_seconds, prm_dir, orm_dir


def sample_heldout(problems: int, seed: int) -> tuple[list, list[list[bool]]]:
    """8 solutions of each of `problems` held-out problems (temperature 1) and whether each is verified right."""
    from assay.data.tasks import make_task
    from assay.models import load_policy
    from assay.rewards.base import REWARDS
    from assay.rollout.base import SamplingParams, make_sampler

    task = make_task("arithmetic")
    verifier = REWARDS.get(task.reward)()
    chosen = [s for _, s in zip(range(problems), task.stream("heldout", seed))]
    policy, tok = load_policy("tiny-arith")
    sampler = make_sampler("torch", policy, tok, None, "cpu")
    trajs = sampler.generate(chosen, max(NS), SamplingParams(max_new_tokens=8, temperature=1.0), torch.Generator().manual_seed(seed))
    sampler.close()
    return trajs, [[r.score == 1.0 for r in verifier(trajs[i * 8 : (i + 1) * 8])] for i in range(len(chosen))]


def pick_all(trajs: list, right: list[list[bool]], prm_dir: Path, orm_dir: Path) -> dict[str, dict[int, float]]:
    """Verified accuracy at each N of every way of picking: PRM reduces, outcome RM, majority vote, pass@N."""
    from assay.rm.model import Encoder, load_rm, score_texts
    from assay.rm.prm import REDUCES, StepEncoder, reduce_steps, score_completions

    items = [(t.sample.prompt, t.completion) for t in trajs]
    prm, prm_tok, prm_meta = load_rm(prm_dir)
    per_step = score_completions(prm, StepEncoder(prm_tok, int(prm_meta["max_length"])), items, "chars:1")
    orm, orm_tok, orm_meta = load_rm(orm_dir)
    orm_scores = score_texts(orm, Encoder(orm_tok, int(orm_meta["max_length"])), items)

    def grouped(flat: list) -> list[list]:
        return [flat[i * 8 : (i + 1) * 8] for i in range(len(right))]

    prm_by = {h: grouped([reduce_steps([s for s, _ in st], h) if st else -1.0 for st in per_step]) for h in REDUCES}
    answers = grouped([t.completion.strip() for t in trajs])
    return {
        "prm_min": {n: pick_accuracy(prm_by["min"], right, n) for n in NS},
        "orm": {n: pick_accuracy(grouped(orm_scores), right, n) for n in NS},
        "majority_vote": {n: vote_accuracy(answers, right, n) for n in NS},
        "pass_at_n": {n: pick_accuracy([[float(x) for x in r] for r in right], right, n) for n in NS},
        **{f"prm_{h}": {n: pick_accuracy(prm_by[h], right, n) for n in NS} for h in ("mean", "last", "prod")},
    }


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    styles = {"prm_min": ("PRM (min)", "o-"), "orm": ("outcome RM", "s-"), "majority_vote": ("majority vote", "^--"), "pass_at_n": ("pass@N (ceiling)", "k:")}
    for key, (label, style) in styles.items():
        ax.plot(NS, [result["accuracy"][key][n] for n in NS], style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(NS, [str(n) for n in NS])
    ax.set_xlabel("N solutions per problem")
    ax.set_ylabel("verified accuracy of the pick")
    ax.set_title(f"Best-of-N, bundled task, {result['heldout_problems']} held-out problems")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="runs/prm-vs-orm", help="where data and the two reward models are written")
    ap.add_argument("--label-problems", type=int, default=3000, help="training problems for step labels (2 solutions each)")
    ap.add_argument("--rollouts", type=int, default=8, help="K rollouts per step prefix")
    ap.add_argument("--pairs", type=int, default=20000, help="preference pairs for the outcome model")
    ap.add_argument("--seconds", type=float, default=120, help="training time of each reward model")
    ap.add_argument("--heldout", type=int, default=300, help="held-out problems for best-of-N")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results-prm-vs-orm.json")
    ap.add_argument("--plot", default="docs/img/prm-vs-orm.png")
    args = ap.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows, label_seconds, prm_dir, orm_dir = train_both(args, work)
    trajs, right = sample_heldout(args.heldout, args.seed)
    result = {
        "heldout_problems": len(right), "label_rows": len(rows), "label_steps": sum(len(r["steps"]) for r in rows),
        "label_seconds": round(label_seconds, 1), "train_seconds_each": args.seconds, "pairs": args.pairs, "seed": args.seed,
        "prm": json.loads((prm_dir / "assay_rm.json").read_text()), "orm": json.loads((orm_dir / "assay_rm.json").read_text()),
        "accuracy": pick_all(trajs, right, prm_dir, orm_dir),
        "wall_seconds": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["accuracy"], indent=1))
    plot(result, args.plot)


if __name__ == "__main__":
    main()
