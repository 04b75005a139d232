"""Multi-step integer arithmetic: `12+34-5=` → `41`; `arithmetic_steps` writes one line per operation."""

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
        return self.check(traj.completion.strip(), traj.sample.answer)

    @staticmethod
    def check(pred: str, answer) -> RewardResult:
        """The verdict on `pred` (already stripped) against the reference `answer`."""
        gold = str(answer).strip() if answer is not None else ""
        if not _INT.fullmatch(gold):
            return RewardResult(None, info={"reason": "unparseable_gold"})
        if not _INT.fullmatch(pred):
            return RewardResult(0.0, info={"reason": "no_answer", "extracted": pred[:40]})
        ok = int(pred) == int(gold)
        return RewardResult(float(ok), info={"reason": "correct" if ok else "wrong", "extracted": pred})


@TASKS.register("arithmetic_steps")
class ArithmeticSteps(Arithmetic):
    """`arithmetic` solved in steps: one line per operation on the running result, the last line ending in the answer.

    `12+34+56=` → `12+34=46\n46+56=102`. The gold `answer` is the final value;
    `fields["steps"]` holds the running results, and `solution(sample)` the reference text, so
    a process reward model has lines to judge (`assay rm label-steps --steps newline`).
    Verified by `arithmetic_steps`: the `arithmetic` verifier on what follows the last `=`
    of the last line (the whole line when it has none).

    Args: as `arithmetic`, with `terms` defaulting to 4 (three steps).
    """

    reward = "arithmetic_steps"

    def __init__(self, terms: int = 4, max_value: int = 99, ops: str = "+", heldout_fraction: float = 0.2):
        super().__init__(terms, max_value, ops, heldout_fraction)

    def make(self, rng: random.Random) -> Sample:
        s = super().make(rng)
        nums, ops = s.fields["nums"], s.fields["ops"]
        value, steps = nums[0], []
        for o, n in zip(ops, nums[1:]):
            value = value + n if o == "+" else value - n if o == "-" else value * n
            steps.append(value)
        s.fields["steps"] = steps
        return s

    @staticmethod
    def solution(sample: Sample) -> str:
        """The reference solution: `running result op number = new result`, one line per operation."""
        nums, ops, steps = sample.fields["nums"], sample.fields["ops"], sample.fields["steps"]
        return "\n".join(f"{a}{o}{n}={v}" for a, o, n, v in zip([nums[0], *steps], ops, nums[1:], steps))


@REWARDS.register("arithmetic_steps")
class ArithmeticStepsReward(Reward):
    """1 when the last non-blank line of the completion ends in `=ANSWER` (or is the answer), else 0.

    The `arithmetic` verifier on the text after the last `=` of the last line (earlier lines are
    the working and are not checked; a wrong step carries into the answer). An empty completion scores 0.
    """

    def score(self, traj: Trajectory) -> RewardResult:
        lines = [ln.strip() for ln in traj.completion.splitlines() if ln.strip()]
        return ArithmeticReward.check(lines[-1].rpartition("=")[2].strip() if lines else "", traj.sample.answer)


_EQUATION = re.compile(r"\s*(-?\d{1,30})\s*([+\-*])\s*(-?\d{1,30})\s*=\s*(-?\d{1,30})\s*")


@REWARDS.register("arithmetic_step_check")
class ArithmeticStepCheck(Reward):
    """A process reward that pays per correct-looking step: each non-blank line scores 1 when it is an equation
    `a op b = c` that holds, else 0; the score is the steps' `reduce` (`sum` by default).

    It checks each line on its own, not that the line continues the solution, so with `reduce: sum` a policy earns
    more by writing more (or the same) true equations: the gameable process reward of `assay lab prm-hacking`. The
    fixes the lab compares are transforms on its steps (`step_clip`, `step_delta`, `step_cap`), `reduce: min` (the
    min-form credit of Cheng et al., "Stop Summation: Min-Form Credit Assignment Is All Process Reward Model Needs for
    Reasoning", arXiv:2504.15275) and gating on the outcome verifier (`gate`).

    Args:
        reduce: `sum`, `min`, `mean`, `last` or `prod` of the step scores.
    """

    verdict = False  # a sum of step scores says nothing about whether the answer is right

    def __init__(self, reduce: str = "sum"):
        from assay.rewards.steps import REDUCES

        if reduce not in REDUCES:
            raise ValueError(f"reduce {reduce!r}: use one of {', '.join(REDUCES)}")
        self.reduce = reduce

    def score(self, traj: Trajectory) -> RewardResult:
        from assay.rewards.steps import reduce_steps

        steps, spans, at = [], [], 0
        for line in traj.completion.split("\n"):
            if line.strip():
                m = _EQUATION.fullmatch(line)
                ok = m is not None and _holds(int(m[1]), m[2], int(m[3]), int(m[4]))
                steps.append(float(ok))
                spans.append((at, at + len(line)))
            at += len(line) + 1
        if not steps:
            return RewardResult(0.0, info={"reason": "no_steps"})
        return RewardResult(reduce_steps(steps, self.reduce), steps=steps, spans=spans,
                            info={"reason": "all_steps_hold" if all(steps) else "a_step_fails"})


def _holds(a: int, op: str, b: int, c: int) -> bool:
    return (a + b if op == "+" else a - b if op == "-" else a * b) == c
