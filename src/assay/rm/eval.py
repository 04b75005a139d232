"""Measuring a reward model on comparisons: pairwise accuracy, best-of-N accuracy, per subset.

* **Pairwise accuracy**: over every (chosen, rejected) combination of every row, the share
  where the chosen response scores strictly higher (a tie counts as wrong).
* **Best-of-N accuracy**: over rows with more than two responses (RewardBench 2's rows: one
  chosen, three rejected), the share where every chosen response scores above every rejected
  one, so picking the top-scored of the N responses picks a chosen one — RewardBench 2's
  accuracy ("RewardBench 2: Advancing Reward Model Evaluation", Malik et al., arXiv 2506.01937).
  A pairwise row is its own best-of-2.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from assay.rm.data import Comparison
from assay.rm.model import Encoder, score_texts


def comparison_metrics(comparisons: list[Comparison], scores: list[tuple[list[float], list[float]]], prefix: str = "eval/") -> dict[str, Any]:
    """Accuracy figures from each comparison's `(chosen scores, rejected scores)`.

    Keys (docs/metrics.md): `{prefix}pair_accuracy`, `{prefix}bt_loss`, `{prefix}pairs`,
    `{prefix}best_of_n_accuracy` and `{prefix}best_of_n_rows` (rows with N > 2 only),
    `{prefix}pair_accuracy/<subset>` for each subset.
    """
    wins, losses, total = 0, 0.0, 0
    by_subset: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    bon_rows, bon_wins = 0, 0
    for c, (cs, rs) in zip(comparisons, scores):
        for a in cs:
            for b in rs:
                win = a > b
                wins += win
                total += 1
                d = a - b
                losses += math.log1p(math.exp(-d)) if d > -30 else -d  # −log σ(d)
                by_subset[c.subset][0] += win
                by_subset[c.subset][1] += 1
        if len(cs) + len(rs) > 2:
            bon_rows += 1
            bon_wins += min(cs) > max(rs)
    out: dict[str, Any] = {f"{prefix}pair_accuracy": wins / total if total else None, f"{prefix}bt_loss": losses / total if total else None,
                           f"{prefix}pairs": total}
    if bon_rows:
        out[f"{prefix}best_of_n_accuracy"] = bon_wins / bon_rows
        out[f"{prefix}best_of_n_rows"] = bon_rows
    if len(by_subset) > 1 or "" not in by_subset:
        for name, (w, n) in sorted(by_subset.items()):
            out[f"{prefix}pair_accuracy/{name or 'none'}"] = w / n
    return out


def score_comparisons(model, encoder: Encoder, comparisons: list[Comparison], batch_size: int = 64) -> list[tuple[list[float], list[float]]]:
    """Every response of every comparison scored, in batches of `batch_size` sequences."""
    items = [(c.prompt, r) for c in comparisons for r in (*c.chosen, *c.rejected)]
    flat = score_texts(model, encoder, items, batch_size)
    out, i = [], 0
    for c in comparisons:
        k, j = len(c.chosen), len(c.chosen) + len(c.rejected)
        out.append((flat[i : i + k], flat[i + k : i + j]))
        i += j
    return out


def evaluate_rm(model, encoder: Encoder, comparisons: list[Comparison], prefix: str = "eval/", batch_size: int = 64) -> dict[str, Any]:
    """Score `comparisons` and return `comparison_metrics` (model in eval mode; its mode is put back)."""
    was_training = model.training
    model.eval()
    try:
        return comparison_metrics(comparisons, score_comparisons(model, encoder, comparisons, batch_size), prefix)
    finally:
        model.train(was_training)


def evaluate_path(path: str, data: str, fields: dict[str, str] | None = None, device: str = "cpu", batch_size: int = 64,
                  threshold: float = 0.5) -> dict[str, Any]:
    """`assay rm eval`: the figures of the reward model at `path` on the comparisons in `data` (keys without a prefix);
    for a process reward model, ProcessBench's first-error F1 on its rows (`assay.rm.prm.evaluate_processbench`)."""
    from assay.rm.data import read_comparisons
    from assay.rm.model import load_rm, read_meta

    if read_meta(path).get("kind") == "prm":
        from assay.rm.prm import evaluate_processbench

        return {"model": str(path), **evaluate_processbench(path, read_meta(path), data, device, batch_size, threshold)}
    comparisons = read_comparisons(data, fields)
    model, tok, meta = load_rm(path, device)
    out = evaluate_rm(model, Encoder(tok, int(meta.get("max_length", 256))), comparisons, prefix="", batch_size=batch_size)
    return {"model": str(path), "data": data, "rows": len(comparisons), **out}
