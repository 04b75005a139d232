"""Measuring a reward model on comparisons: pairwise accuracy, best-of-N accuracy, per subset.

* **Pairwise accuracy**: over every (chosen, rejected) combination of every row, the share
  where the chosen response scores strictly higher (a tie counts as wrong).
* **Best-of-N accuracy**: over rows with more than two responses (RewardBench 2's rows: one
  chosen, three rejected), the share where every chosen response scores above every rejected
  one, so picking the top-scored of the N responses picks a chosen one — RewardBench 2's
  accuracy ("RewardBench 2: Advancing Reward Model Evaluation", Malik et al., arXiv 2506.01937).
  A pairwise row is its own best-of-2.
* **Calibration**: read as a Bradley–Terry model, a score gap d says "the higher-scored
  response is preferred with probability σ(|d|)". Pairs are binned by that confidence
  (`CALIBRATION_BINS` equal bins over [0.5, 1]); in a calibrated model each bin's accuracy
  equals its mean confidence. The expected calibration error is the pair-weighted mean gap
  between the two ("On Calibration of Modern Neural Networks", Guo et al., ICML 2017).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from assay.rm.data import Comparison
from assay.rm.model import Encoder, score_texts

#: equal-width confidence bins over [0.5, 1] for the calibration figures
CALIBRATION_BINS = 10


def comparison_metrics(comparisons: list[Comparison], scores: list[tuple[list[float], list[float]]], prefix: str = "eval/",
                       bins: bool = False) -> dict[str, Any]:
    """Accuracy figures from each comparison's `(chosen scores, rejected scores)`.

    Keys (docs/metrics.md): `{prefix}pair_accuracy`, `{prefix}bt_loss`, `{prefix}pairs`,
    `{prefix}best_of_n_accuracy` and `{prefix}best_of_n_rows` (rows with N > 2 only),
    `{prefix}pair_accuracy/<subset>` for each subset, `{prefix}calibration_ece`, and with
    `bins` `{prefix}calibration` (the non-empty bins: mean confidence, accuracy, pairs).
    """
    wins, losses, total = 0, 0.0, 0
    cal = [[0, 0, 0.0] for _ in range(CALIBRATION_BINS)]  # pairs, right, sum of confidence
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
                conf = 1 / (1 + math.exp(-min(abs(d), 30.0)))
                b = cal[min(CALIBRATION_BINS - 1, int((conf - 0.5) * 2 * CALIBRATION_BINS))]
                b[0] += 1
                b[1] += win
                b[2] += conf
                by_subset[c.subset][0] += win
                by_subset[c.subset][1] += 1
        if len(cs) + len(rs) > 2:
            bon_rows += 1
            bon_wins += min(cs) > max(rs)
    out: dict[str, Any] = {f"{prefix}pair_accuracy": wins / total if total else None, f"{prefix}bt_loss": losses / total if total else None,
                           f"{prefix}pairs": total}
    if total:
        out[f"{prefix}calibration_ece"] = sum(abs(r - c) for _, r, c in cal) / total
        if bins:
            out[f"{prefix}calibration"] = [{"confidence": round(c / n, 6), "accuracy": round(r / n, 6), "pairs": n} for n, r, c in cal if n]
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


def evaluate_rm(model, encoder: Encoder, comparisons: list[Comparison], prefix: str = "eval/", batch_size: int = 64,
                bins: bool = False) -> dict[str, Any]:
    """Score `comparisons` and return `comparison_metrics` (model in eval mode; its mode is put back)."""
    was_training = model.training
    model.eval()
    try:
        return comparison_metrics(comparisons, score_comparisons(model, encoder, comparisons, batch_size), prefix, bins)
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
    from assay.rm.model import encoder_for

    comparisons = read_comparisons(data, fields)
    model, tok, meta = load_rm(path, device)
    if meta.get("kind") == "image":
        from assay.images.scorer import decode_comparisons

        decode_comparisons(comparisons, int(meta.get("sample_size", 16)), data)
    out = evaluate_rm(model, encoder_for(tok, meta), comparisons, prefix="", batch_size=batch_size, bins=True)
    return {"model": str(path), "data": data, "rows": len(comparisons), **out}


def plot_calibration(out: dict[str, Any], path: str) -> str:
    """A reliability diagram of `assay rm eval`'s `calibration` bins (accuracy against confidence) saved to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = out.get("calibration") or []
    fig, ax = plt.subplots(figsize=(4.5, 4.2), dpi=120)
    ax.plot([0.5, 1], [0.5, 1], color="0.6", lw=1, ls="--", label="calibrated")
    if bins:
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o-", color="C0",
                label=f"reward model (ECE {out['calibration_ece']:.3f})")
        for b in bins:
            ax.annotate(str(b["pairs"]), (b["confidence"], b["accuracy"]), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set(xlim=(0.48, 1.02), ylim=(0, 1.02), xlabel="confidence σ(|score gap|)", ylabel="share of pairs ordered right",
           title="Calibration (pairs per bin)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
