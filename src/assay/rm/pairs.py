"""Preference pairs from a built-in task: chosen verified correct, rejected verified wrong.

For each problem of a task's split (`assay.data.tasks`: hash-disjoint train and held-out
splits), the chosen response is the reference answer and the rejected one a wrong integer
of one of four kinds, each checked with the task's own verifier (chosen must score 1,
rejected 0; a candidate that fails is never written):

| kind | the rejected answer |
|---|---|
| `near_miss` | the answer ± 1, ± 2 or ± 10 |
| `carry` | the sum with every carry forgotten (`+`-only problems; the mistake the bundled model was taught), else a near miss |
| `random` | another integer in the answer's range |
| `longer` | length-confounded: a wrong integer with more digits than the answer, drawn from the range of the split's real answers, so its size alone never gives it away |
| `shorter` | a wrong integer with fewer digits (a digit dropped), so that length alone never decides a pair |

The range of real answers is that of the split's first `RANGE_PROBLEMS` problems. A problem
whose answer already has as many digits as the largest real answer cannot have a plausible
longer wrong answer; the drawn `longer` then waits for the next problem that can, so the mix
is kept. The same `(task, split, n, seed)` gives the same file. `assay rm pairs --out FILE` writes it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from assay.data.tasks import make_task
from assay.errors import AssayError
from assay.rewards.base import REWARDS
from assay.types import Sample, Trajectory

KINDS = ("near_miss", "carry", "random", "longer", "shorter")
#: how often each kind is drawn by default
DEFAULT_MIX = {"near_miss": 0.3, "carry": 0.2, "random": 0.1, "longer": 0.25, "shorter": 0.15}
#: problems whose answers give the range a `longer` wrong answer is drawn from
RANGE_PROBLEMS = 2000


def forgotten_carry(nums: list[int]) -> int:
    """The digit-by-digit sum of non-negative integers with every carry dropped (`58+67` → `15`)."""
    width = max(len(str(n)) for n in nums)
    digits = [sum(int(str(n).zfill(width)[i]) for n in nums) % 10 for i in range(width)]
    return int("".join(map(str, digits)))


def answer_range(task: Any, split: str, seed: int) -> tuple[int, int]:
    """`(lowest, highest)` integer answer over the first `RANGE_PROBLEMS` problems of `split`."""
    values = [int(str(s.answer).strip()) for s, _ in zip(task.stream(split, seed), range(RANGE_PROBLEMS))]
    return min(values), max(values)


def longer_plausible(gold: int, lo: int, hi: int, rng: random.Random) -> int | None:
    """A wrong integer in `[lo, hi]` with more characters than `gold`, or None when there is none.

    >>> longer_plausible(63, 0, 198, random.Random(0)) in range(100, 199)
    True
    >>> longer_plausible(104, 0, 198, random.Random(0)) is None
    True
    """
    width = len(str(gold))
    spans = []  # the parts of [lo, hi] whose integers are written with more characters than gold
    if hi >= 10**width:
        spans.append((max(lo, 10**width), hi))
    if lo <= -(10 ** (width - 1)):
        spans.append((lo, min(hi, -(10 ** (width - 1)))))
    spans = [(a, b) for a, b in spans if a <= b]
    if not spans:
        return None
    a, b = rng.choices(spans, [b - a + 1 for a, b in spans])[0]
    return rng.randint(a, b)


def wrong_answer(kind: str, gold: int, sample: Sample, rng: random.Random, span: tuple[int, int] = (0, 0)) -> int | None:
    """One candidate wrong answer of `kind` (the caller checks it is wrong); `longer` needs `span`, the real answers' range,
    and is None when no plausible longer answer exists."""
    if kind == "carry" and set(sample.fields.get("ops", "")) == {"+"} and all(n >= 0 for n in sample.fields.get("nums", [])):
        c = forgotten_carry(sample.fields["nums"])
        if c != gold:
            return c
        kind = "near_miss"  # no carry in this problem
    if kind in ("near_miss", "carry"):
        return gold + rng.choice([-10, -2, -1, 1, 2, 10])
    if kind == "random":
        hi = max(10, 2 * abs(gold))
        return rng.randint(-hi if gold < 0 else 0, hi)
    if kind == "longer":
        return longer_plausible(gold, *span, rng)
    if kind == "shorter":
        s = str(abs(gold))
        if len(s) < 2:
            return gold + rng.choice([-10, 10])  # one digit: nothing to drop
        pos = rng.randrange(len(s))
        value = int(s[:pos] + s[pos + 1 :])
        return -value if gold < 0 else value
    raise AssayError(f"unknown pair kind {kind!r}; known: {', '.join(KINDS)}")


def _verified(reward, sample: Sample, text: str) -> float | None:
    return reward.score(Trajectory(sample, text, [], [], [], True)).score


def build_pairs(task: str = "arithmetic", task_args: dict[str, Any] | None = None, split: str = "train", n: int = 4000, seed: int = 0,
                mix: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """`n` pair rows `{id, prompt, chosen, rejected, subset, answer}` from `split` of `task`.

    Args:
        mix: kind → weight (default `DEFAULT_MIX`); the kind of each row is drawn with these weights.
    """
    mix = dict(mix or DEFAULT_MIX)
    bad = sorted(set(mix) - set(KINDS))
    if bad or not mix or any(w < 0 for w in mix.values()) or sum(mix.values()) <= 0:
        raise AssayError(f"pair kinds {mix}: use weights >= 0 over {', '.join(KINDS)}" + (f" (unknown {bad[0]!r})" if bad else ""))
    t = make_task(task, **(task_args or {}))
    reward = REWARDS.get(t.reward)()
    rng = random.Random(f"rm-pairs:{task}:{split}:{seed}")
    kinds, weights = zip(*mix.items())
    rows: list[dict[str, Any]] = []
    span: tuple[int, int] | None = None
    kind = rng.choices(kinds, weights)[0]
    for sample in t.stream(split, seed):
        if len(rows) == n:
            break
        gold_text = str(sample.answer).strip()
        try:
            gold = int(gold_text)
        except ValueError:
            raise AssayError(f"task {task!r}: answers are not integers ({gold_text[:40]!r}); pairs are built for integer-answer tasks") from None
        if _verified(reward, sample, gold_text) != 1.0:
            raise AssayError(f"task {task!r}: its verifier does not accept its own answer {gold_text!r} for {sample.prompt!r}")
        if kind == "longer" and span is None:
            span = answer_range(t, split, seed)
        for _ in range(20):
            value = wrong_answer(kind, gold, sample, rng, span or (gold, gold))
            if value is None:
                break  # no plausible longer answer for this problem: the kind waits for the next one
            wrong = str(value)
            fits = (kind != "longer" or len(wrong) > len(gold_text)) and (kind != "shorter" or len(wrong) < len(gold_text) or len(gold_text.lstrip("-")) < 2)
            if wrong != gold_text and fits and _verified(reward, sample, wrong) == 0.0:
                rows.append({"id": f"{sample.id}-{len(rows)}", "prompt": sample.prompt, "chosen": gold_text, "rejected": wrong,
                             "subset": kind, "answer": sample.answer})
                kind = rng.choices(kinds, weights)[0]
                break
    if len(rows) < n:
        raise AssayError(f"task {task!r} split {split!r} has only {len(rows)} problems for pairs; ask for fewer (--n {len(rows)})")
    return rows


def write_pairs(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
