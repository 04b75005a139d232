"""Reward-health monitors, logged every step, and control rewards to run side by side.

`reward_health` turns one step's results into namespaced metrics (every key is defined in
docs/rewards.md). The control rewards `random` and `format_only` carry no information
about correctness: if a run trained on them gains as much as the real one, the gains do
not come from the signal (the spurious-rewards study, Shao et al., 2025, "Spurious
Rewards: Rethinking Training Signals in RLVR", arXiv:2506.10947).

    >>> from assay.types import RewardResult
    >>> m = reward_health([RewardResult(1.0), RewardResult(1.0), RewardResult(0.0), RewardResult(None)], [0, 0, 1, 1], [3, 5, 9, 2])
    >>> m["reward/mean"], m["reward/none"], m["reward/saturated_group_frac"], m["reward/zero_var_group_frac"]
    (0.6666666666666666, 1.0, 0.5, 1.0)
"""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter, defaultdict

from assay.rewards.base import REWARDS, Reward
from assay.rewards.math import as_text, find_boxes
from assay.types import RewardResult, Trajectory

_INTEGER = re.compile(r"-?[0-9]{1,30}")


def _mean(xs: list[float]) -> float:
    """The mean; NaN (logged as null) for no values: an unscored batch is never averaged as 0."""
    return sum(xs) / len(xs) if xs else math.nan


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(_mean([(x - m) ** 2 for x in xs])) if xs else math.nan


def pearson(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation; 0.0 when either side has no variance or fewer than 2 points."""
    if len(xs) < 2:
        return 0.0
    mx, my = _mean(xs), _mean(ys)
    sx, sy = _std(xs), _std(ys)
    if sx == 0 or sy == 0:
        return 0.0
    return _mean([(x - mx) * (y - my) for x, y in zip(xs, ys)]) / (sx * sy)


def reward_health(results: list[RewardResult], group: list[int], lengths: list[int], high: float = 1.0, low: float = 0.0) -> dict[str, float]:
    """Metrics for one batch of results `[B]` with group index `[B]` and completion lengths `[B]`.

    A group is saturated when all its scored members are ≥ `high`, unsolved when all are
    ≤ `low`, zero-variance when all its scored members are equal (these give GRPO no
    gradient). Failed and None results are counted and left out of every mean.
    """
    if not (len(results) == len(group) == len(lengths)):
        raise ValueError(f"reward_health: results, group and lengths differ in length ({len(results)}, {len(group)}, {len(lengths)})")
    scored = [(r.score, g, n) for r, g, n in zip(results, group, lengths) if r.score is not None and r.error is None]
    scores = [s for s, _, _ in scored]
    out = {
        "reward/mean": _mean(scores),
        "reward/std": _std(scores),
        "reward/count": float(len(results)),
        "reward/failures": float(sum(r.error is not None for r in results)),
        "reward/none": float(sum(r.score is None for r in results)),
        "reward/timeouts": float(sum(r.info.get("reason") == "timeout" for r in results if r.error is not None)),
        "reward/length_corr": pearson(scores, [float(n) for _, _, n in scored]),
    }
    comps: dict[str, list[float]] = defaultdict(list)
    for r in results:
        if r.error is None:
            for k, v in r.components.items():
                if isinstance(v, (int, float)) and v is not None:
                    comps[k].append(float(v))
    for k, vs in sorted(comps.items()):
        out[f"reward/{k}/mean"] = _mean(vs)
    out.update(_group_metrics(scored, high, low))
    checked = [(r.score, float(r.components["verifier"]), g) for r, g in zip(results, group)
               if r.error is None and r.score is not None and isinstance(r.components.get("verifier"), (int, float))]
    if checked:
        out["reward/verifier_disagreement"] = verifier_disagreement(checked)
    reasons = Counter(str(r.info.get("reason")) for r in results if r.info.get("reason") is not None)
    for k, n in sorted(reasons.items()):
        out[f"reward/reason/{k}"] = n / len(results)
    return out


def verifier_disagreement(checked: list[tuple[float, float, int]]) -> float:
    """Share of same-group pairs the verifier tells apart that the reward orders the other way, or ties.

    `checked` holds `(reward, verifier score, group)` per completion; only pairs within one
    group whose verifier scores differ count (NaN when there are none).

    >>> verifier_disagreement([(2.0, 1.0, 0), (1.0, 0.0, 0), (3.0, 0.0, 0), (5.0, 1.0, 1)])
    0.5
    """
    by: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for s, v, g in checked:
        by[g].append((s, v))
    pairs = wrong = 0
    for members in by.values():
        for i, (si, vi) in enumerate(members):
            for sj, vj in members[i + 1 :]:
                if vi != vj:
                    pairs += 1
                    wrong += (si - sj) * (vi - vj) <= 0
    return wrong / pairs if pairs else math.nan


def _group_metrics(scored: list[tuple[float, int, int]], high: float, low: float) -> dict[str, float]:
    by: dict[int, list[float]] = defaultdict(list)
    for s, g, _ in scored:
        by[g].append(s)
    groups = list(by.values())
    if not groups:  # nothing scored: no group statistics at all
        return dict.fromkeys(("reward/saturated_group_frac", "reward/unsolved_group_frac", "reward/zero_var_group_frac"), math.nan)
    n = len(groups)
    return {
        "reward/saturated_group_frac": sum(all(s >= high for s in v) for v in groups) / n,
        "reward/unsolved_group_frac": sum(all(s <= low for s in v) for v in groups) / n,
        "reward/zero_var_group_frac": sum(max(v) - min(v) <= 1e-12 for v in groups) / n,
    }


@REWARDS.register("random")
class RandomReward(Reward):
    """Control: 1 with probability p, else 0, independent of the completion's correctness.

    Deterministic for a given (seed, prompt id, completion), so reruns agree and workers
    need no shared state. The random reward of Shao et al. (2025, arXiv:2506.10947).
    """

    verdict = False  # says nothing about correctness: held-out accuracy is checked by the task's verifier

    def __init__(self, p: float = 0.5, seed: int = 0):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"random: p must be in [0, 1], got {p}")
        self.p, self.seed = p, seed

    def score(self, traj: Trajectory) -> RewardResult:
        key = f"{self.seed}\0{traj.sample.id}\0{as_text(traj.completion)}".encode("utf-8", "surrogatepass")
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
        return RewardResult(float(u < self.p), info={"reason": "control"})


@REWARDS.register("format_only")
class FormatOnlyReward(Reward):
    """Control: 1 when the completion has a non-empty `\\boxed{}` answer (or, with `pattern`, when the whole completion,
    stripped, matches that regular expression), whatever it says.

    The format reward of Shao et al. (2025, arXiv:2506.10947): rewards the answer format only. `pattern` fits it to a
    task whose answers are not boxed (`'-?[0-9]+'`: any integer, for the arithmetic tasks).
    """

    verdict = False  # says nothing about correctness: held-out accuracy is checked by the task's verifier

    def __init__(self, pattern: str | None = None):
        self.pattern = re.compile(pattern) if pattern is not None else None

    def score(self, traj: Trajectory) -> RewardResult:
        text = as_text(traj.completion)
        ok = self.pattern.fullmatch(text.strip()) is not None if self.pattern is not None else any(c.strip() for _, _, c in find_boxes(text))
        return RewardResult(float(ok), info={"reason": "control"})


@REWARDS.register("incorrect_label")
class IncorrectLabel(Reward):
    """Control: 1 when the completion is exactly a wrong integer label, the reference shifted by a per-problem offset.

    The offset is drawn from `offsets` by a hash of (seed, prompt id), so each problem has one fixed wrong label. The
    incorrect-label reward of Shao et al. (2025, arXiv:2506.10947), for tasks with integer answers; a reference that is
    not an integer cannot be scored (None).
    """

    verdict = False  # it rewards a wrong answer: held-out accuracy is checked by the task's verifier

    def __init__(self, offsets: tuple[int, ...] | list[int] = (-10, -2, -1, 1, 2, 10), seed: int = 0):
        if not offsets or any(not isinstance(o, int) or o == 0 for o in offsets):
            raise ValueError(f"incorrect_label: offsets must be non-zero integers, got {offsets!r}")
        self.offsets, self.seed = tuple(offsets), seed

    def label(self, traj: Trajectory) -> int | None:
        """The wrong label of this problem, or None when its reference is not an integer."""
        gold = str(traj.sample.answer).strip()
        if not _INTEGER.fullmatch(gold):
            return None
        h = int.from_bytes(hashlib.blake2b(f"{self.seed}\0{traj.sample.id}".encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")
        return int(gold) + self.offsets[h % len(self.offsets)]

    def score(self, traj: Trajectory) -> RewardResult:
        wrong = self.label(traj)
        if wrong is None:
            return RewardResult(None, info={"reason": "unparseable_gold"})
        text = as_text(traj.completion).strip()
        ok = _INTEGER.fullmatch(text) is not None and int(text) == wrong
        return RewardResult(float(ok), info={"reason": "control"})
