"""Process reward models: a score per step, trained with binary cross-entropy on step labels.

A process reward model is the same Hugging Face sequence classifier as the outcome model
(`assay.rm.model`: a causal LM's transformer and a one-output `score` head), read at every
step boundary instead of only at the end: the prefix prompt + steps 1..k is scored at the
token that ends step k, and σ(logit) is the chance that step k is right. The completion is
tokenised piece by piece (step 1, then separator + step 2, ...), so every step ends on a
token boundary; `score_steps` cuts a completion the same way. Without EOS appended, the
classifier's own forward (its pooling at the last token) gives the last step's logit, so the
saved folder loads with `AutoModelForSequenceClassification` and scores a whole solution as
its last step.

    loss = mean over the batch's steps of BCE(σ(logit_k), y_k),   y_k ∈ [0, 1]

the objective of "Let's Verify Step by Step" (Lightman et al., arXiv 2305.20050) with the
soft labels of "Math-Shepherd: Verify and Reinforce LLMs Step-by-step without Human
Annotations" (Wang et al., arXiv 2312.08935).

A solution's score from its step scores (`reduce`): `min` by default, the min-form credit of
"Stop Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for Reasoning"
(Cheng et al., arXiv 2504.15275): the value of step k is V_k = min_{j≥k} r_j instead of
Σ_{j≥k} γ^{j−k} r_j, so a solution is worth V_1 = min_j r_j, its weakest step; `mean`, `last`
(the final step's score, the outcome-like reading) and `prod` (the product of step
probabilities, as "Let's Verify Step by Step" ranks solutions) are the alternatives.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from assay.errors import AssayError
from assay.rewards.steps import REDUCES, min_form_returns, reduce_steps  # noqa: F401  (re-exported: defined there, with no torch)
from assay.rm.model import pad_right, render_prompt
from assay.rm.steps import StepRow, completion_pieces


class StepEncoder:
    """Token ids of (prompt, step pieces) with the index of the token that ends each piece."""

    def __init__(self, tokenizer, max_length: int):
        self.tok, self.max_length = tokenizer, max_length
        self._prompts: dict[str, list[int]] = {}

    def ids(self, prompt: str | list[dict[str, Any]], pieces: list[str]) -> tuple[list[int], list[int]]:
        """`(token ids, end position of each piece)`; a sequence over `max_length` loses tokens from its start
        (a step whose end is cut off gets position −1 and is left out)."""
        text = render_prompt(self.tok, prompt)
        ids = self._prompts.get(text)
        if ids is None:
            ids = self._prompts[text] = self.tok(text, add_special_tokens=False)["input_ids"]
            if len(self._prompts) > 100_000:
                self._prompts.clear()
        ids, ends = list(ids), []
        for piece in pieces:
            ids += self.tok(piece, add_special_tokens=False)["input_ids"]
            ends.append(len(ids) - 1)
        cut = max(0, len(ids) - self.max_length)
        return ids[cut:], [e - cut if e >= cut else -1 for e in ends]

    def batch(self, items: list[tuple[Any, list[str]]], device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Right-padded `input_ids` `[M, L]`, `attention_mask` `[M, L]`, and each row's step end positions."""
        rows, ends = zip(*(self.ids(p, pieces) for p, pieces in items))
        ids, mask = pad_right(rows, self.tok.pad_token_id)
        return ids.to(device), mask.to(device), list(ends)


def step_logits(model, ids: torch.Tensor, mask: torch.Tensor, ends: list[list[int]]) -> list[torch.Tensor]:
    """Per-step logits, one tensor `[S_i]` per row: the score head on the hidden state at each step's last token."""
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state  # [M, L, H]
    logits = model.score(hidden)[..., 0].float()  # [M, L]
    return [logits[i, torch.tensor([e for e in row if e >= 0], dtype=torch.long, device=ids.device)] for i, row in enumerate(ends)]


def prm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean binary cross-entropy of step logits `[S]` against step labels in [0, 1] `[S]`, with its `rm/*` metrics.

    `rm/accuracy` is the share of steps where σ(logit) > 0.5 agrees with label ≥ 0.5. The objective of "Let's Verify
    Step by Step" (arXiv 2305.20050) with the soft labels of "Math-Shepherd" (arXiv 2312.08935).
    """
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    with torch.no_grad():
        p = torch.sigmoid(logits)
        metrics = {"rm/loss": loss.item(), "rm/accuracy": ((p > 0.5) == (labels >= 0.5)).float().mean().item(),
                   "rm/label_mean": labels.mean().item(), "rm/score_mean": p.mean().item(), "rm/steps": float(labels.numel())}
    return loss, metrics


def _row_logits(model, encoder: StepEncoder, rows: list[StepRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat step logits `[S]` of `rows` and their labels `[S]` (steps cut off by `max_length` left out)."""
    device = next(model.parameters()).device
    ids, mask, ends = encoder.batch([(r.prompt, r.pieces()) for r in rows], device)
    per_row = step_logits(model, ids, mask, ends)
    labels = [y for r, e in zip(rows, ends) for y, pos in zip(r.labels, e) if pos >= 0]
    return torch.cat(per_row), torch.tensor(labels, dtype=torch.float32, device=device)


def train_step(model, encoder: StepEncoder, rows: list[StepRow], cfg, weights, sched) -> dict[str, float]:
    """One optimizer step (`weights`: the run's `MasterWeights`) on step-labelled `rows`; returns its `rm/*` metrics."""
    logits, labels = _row_logits(model, encoder, rows)
    loss, metrics = prm_loss(logits, labels)
    weights.zero_grad()
    weights.backward(loss)
    metrics["rm/lr"] = weights.optimizer.param_groups[0]["lr"]
    metrics.update(weights.step_with_metrics(cfg.optim.grad_clip, "rm/"))
    sched.step()
    return metrics


def predict_first_error(scores: list[float], threshold: float = 0.5) -> int:
    """Index of the first step scored below `threshold`, −1 when none is (ProcessBench's prediction)."""
    return next((i for i, s in enumerate(scores) if s < threshold), -1)


def first_error_f1(predicted: list[int], labels: list[int]) -> dict[str, float | None]:
    """ProcessBench's figures from predicted and true first-error indices (−1: no error).

    `error_accuracy`: share of erroneous samples whose first wrong step is found exactly;
    `correct_accuracy`: share of correct samples predicted to have no error; `f1`: their
    harmonic mean ("ProcessBench: Identifying Process Errors in Mathematical Reasoning",
    Zheng et al., arXiv 2412.06559).

    >>> first_error_f1([2, -1, -1, 0], [2, 1, -1, -1])
    {'error_accuracy': 0.5, 'correct_accuracy': 0.5, 'f1': 0.5}
    """
    err = [p == y for p, y in zip(predicted, labels) if y != -1]
    ok = [p == -1 for p, y in zip(predicted, labels) if y == -1]
    a_err = sum(err) / len(err) if err else None
    a_ok = sum(ok) / len(ok) if ok else None
    f1 = None
    if a_err is not None and a_ok is not None:
        f1 = 2 * a_err * a_ok / (a_err + a_ok) if a_err + a_ok else 0.0
    return {"error_accuracy": a_err, "correct_accuracy": a_ok, "f1": f1}


@torch.no_grad()
def score_rows(model, encoder: StepEncoder, rows: list[StepRow], batch_size: int = 64) -> list[list[float]]:
    """σ(logit) of every step of every row, `batch_size` rows per forward (a step cut off by `max_length`: nan)."""
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        ids, mask, ends = encoder.batch([(r.prompt, r.pieces()) for r in chunk], device)
        for e, lg in zip(ends, step_logits(model, ids, mask, ends)):
            probs = iter(torch.sigmoid(lg).tolist())
            out.append([next(probs) if pos >= 0 else math.nan for pos in e])
    return out


def evaluate_prm(model, encoder: StepEncoder, rows: list[StepRow], prefix: str = "eval/", batch_size: int = 64,
                 threshold: float = 0.5) -> dict[str, Any]:
    """Step BCE and accuracy and ProcessBench's first-error F1 of `rows` (model in eval mode; its mode is put back)."""
    was_training = model.training
    model.eval()
    try:
        scores = score_rows(model, encoder, rows, batch_size)
    finally:
        model.train(was_training)
    bce, hits, n = 0.0, 0, 0
    for r, s in zip(rows, scores):
        for y, p in zip(r.labels, s):
            if math.isnan(p):
                continue
            p = min(max(p, 1e-7), 1 - 1e-7)
            bce -= y * math.log(p) + (1 - y) * math.log(1 - p)
            hits += (p > 0.5) == (y >= 0.5)
            n += 1
    pb = first_error_f1([predict_first_error(s, threshold) for s in scores], [r.first_error for r in rows])
    return {f"{prefix}step_bce": bce / n if n else None, f"{prefix}step_accuracy": hits / n if n else None, f"{prefix}steps": n,
            f"{prefix}first_error_f1": pb["f1"], f"{prefix}error_accuracy": pb["error_accuracy"],
            f"{prefix}correct_accuracy": pb["correct_accuracy"]}


@torch.no_grad()
def score_completions(model, encoder: StepEncoder, items: list[tuple[Any, str]], split: str = "newline",
                      batch_size: int = 64) -> list[list[tuple[float, tuple[int, int]]]]:
    """`[(score, (start, end))]` per step of each `(prompt, completion)`; a completion without steps gets `[]`."""
    cut = [completion_pieces(c, split) for _, c in items]
    rows = [(i, p) for i, ((p, _), (pieces, _)) in enumerate(zip(items, cut)) if pieces]
    out: list[list[tuple[float, tuple[int, int]]]] = [[] for _ in items]
    device = next(model.parameters()).device
    for j in range(0, len(rows), batch_size):
        chunk = rows[j : j + batch_size]
        ids, mask, ends = encoder.batch([(p, cut[i][0]) for i, p in chunk], device)
        for (i, _), e, lg in zip(chunk, ends, step_logits(model, ids, mask, ends)):
            probs = iter(torch.sigmoid(lg).tolist())
            out[i] = [(next(probs) if pos >= 0 else math.nan, span) for pos, span in zip(e, cut[i][1])]
    return out


def score_steps(model, tok, prompt: Any, completion: str, split: str = "newline", max_length: int = 256) -> list[tuple[float, tuple[int, int]]]:
    """`[(score, (start, end))]`: the process reward model's σ(logit) at the end of each step of `completion`.

    For example `score_steps(*load_rm("runs/prm")[:2], "7+8=", "15", "chars:1")` gives `[(p1, (0, 1)), (p2, (1, 2))]`.
    The per-step reading of "Let's Verify Step by Step" (arXiv 2305.20050).
    """
    was_training = model.training
    model.eval()
    try:
        return score_completions(model, StepEncoder(tok, max_length), [(prompt, completion)], split)[0]
    finally:
        model.train(was_training)


def evaluate_processbench(path: str, meta: dict[str, Any], data: str, device: str = "cpu", batch_size: int = 64,
                          threshold: float = 0.5) -> dict[str, Any]:
    """`assay rm eval` of the process reward model at `path` on ProcessBench rows (or step-labelled rows): keys without a prefix."""
    from assay.rm.model import load_rm
    from assay.rm.steps import read_processbench

    if not 0.0 < threshold < 1.0:
        raise AssayError(f"--threshold {threshold}: a step is wrong when its score is below this; give a number in (0, 1)")
    rows = read_processbench(data, meta.get("step_separator", "\n"))
    model, tok, _ = load_rm(path, device)
    out = evaluate_prm(model, StepEncoder(tok, int(meta.get("max_length", 256))), rows, prefix="", batch_size=batch_size, threshold=threshold)
    return {"data": data, "rows": len(rows), "erroneous_rows": sum(r.first_error != -1 for r in rows), "threshold": threshold, **out}
