"""Reducing a process reward's step scores to one score (no torch): what the `prm` reward and the rule-based
process rewards (`arithmetic_step_check`) share."""

from __future__ import annotations

import math

from assay.errors import AssayError

REDUCES = ("min", "mean", "last", "prod", "sum")


def min_form_returns(scores: list[float]) -> list[float]:
    """PURE's min-form values V_k = min_{j≥k} r_j of step rewards `[S]` ("Stop Summation", arXiv 2504.15275).

    >>> min_form_returns([0.9, 0.2, 0.7, 0.8])
    [0.2, 0.2, 0.7, 0.8]
    """
    out, low = [], math.inf
    for r in reversed(scores):
        low = min(low, r)
        out.append(low)
    return out[::-1]


def reduce_steps(scores: list[float], how: str = "min") -> float:
    """One score for a solution from its step scores `[S]`: `min` (= V_1 of `min_form_returns`), `mean`, `last`, `prod` or `sum`.

    `min` is the min-form credit of "Stop Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for
    Reasoning" (arXiv 2504.15275); `prod` the solution score of "Let's Verify Step by Step" (arXiv 2305.20050).

    `sum` pays per step, so more (and repeated) steps pay more: the form process rewards are hacked through
    (Gao et al., "On Designing Effective RL Reward at Training Time for LLM Reasoning", arXiv:2410.15115); it is here
    to study that (`assay lab prm-hacking`), not to train with.

    >>> [reduce_steps([0.9, 0.5, 0.8], h) for h in REDUCES]
    [0.5, 0.7333333333333334, 0.8, 0.36000000000000004, 2.2]
    """
    if not scores:
        raise ValueError("no steps to reduce")
    if how == "min":
        return min_form_returns(scores)[0]
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "last":
        return scores[-1]
    if how == "prod":
        return math.prod(scores)
    if how == "sum":
        return sum(scores)
    raise AssayError(f"unknown reduce {how!r}; known: {', '.join(REDUCES)}")
