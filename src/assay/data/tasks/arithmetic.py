"""Multi-step integer arithmetic: `12+34-5=` → `41`."""

from __future__ import annotations

import random
import re

from assay.data.tasks.base import TASKS, Task
from assay.errors import AssayError
from assay.rewards.base import REWARDS, Reward
from assay.types import RewardResult, Sample, Trajectory

_INT = re.compile(r"-?\d{1,30}")


@TASKS.register("arithmetic")
class Arithmetic(Task):
    """Evaluate a left-to-right chain of `terms` integers joined by `ops`.

    Args:
        terms: how many numbers in the expression (2 is plain `a+b`).
        max_value: numbers are drawn from min_value..max_value.
        min_value: the smallest number (1000 with max_value 9999: four-digit numbers).
        ops: the operators to draw from, a subset of `+-*`.
    """

    reward = "arithmetic"

    def __init__(self, terms: int = 2, max_value: int = 99, ops: str = "+", heldout_fraction: float = 0.2, min_value: int = 0):
        if terms < 2 or max_value < 1 or not ops or set(ops) - set("+-*") or not 0 <= min_value <= max_value:
            raise AssayError(f"arithmetic: need terms >= 2, 0 <= min_value <= max_value, max_value >= 1 and ops from '+-*'; "
                             f"got terms={terms}, min_value={min_value}, max_value={max_value}, ops={ops!r}")
        self.terms, self.max_value, self.ops, self.min_value = terms, max_value, ops, min_value
        self.heldout_fraction = heldout_fraction

    def make(self, rng: random.Random) -> Sample:
        nums = [rng.randint(self.min_value, self.max_value) for _ in range(self.terms)]
        ops = [rng.choice(self.ops) for _ in range(self.terms - 1)]
        expr = str(nums[0]) + "".join(o + str(n) for o, n in zip(ops, nums[1:]))
        value = nums[0]
        for o, n in zip(ops, nums[1:]):
            value = value + n if o == "+" else value - n if o == "-" else value * n
        return Sample(id="", prompt=expr + "=", answer=str(value), fields={"nums": nums, "ops": "".join(ops)})


@REWARDS.register("arithmetic")
class ArithmeticReward(Reward):
    """1 when the completion is exactly the integer answer, else 0 (with the reason).

    Strict by design: the whole completion (whitespace stripped) must be one integer;
    `41 or 42`, `41.0` or trailing text score 0. An unparseable reference gives None.
    """

    def score(self, traj: Trajectory) -> RewardResult:
        gold = str(traj.sample.answer).strip() if traj.sample.answer is not None else ""
        if not _INT.fullmatch(gold):
            return RewardResult(None, info={"reason": "unparseable_gold"})
        pred = traj.completion.strip()
        if not _INT.fullmatch(pred):
            return RewardResult(0.0, info={"reason": "no_answer", "extracted": pred[:40]})
        ok = int(pred) == int(gold)
        return RewardResult(float(ok), info={"reason": "correct" if ok else "wrong", "extracted": pred})
