"""Countdown: reach a target from given numbers with + − × ÷ (each number at most once).

The verifier parses the expression itself (no `eval`), evaluates it in exact rational
arithmetic and checks that each number is used at most as often as it is given.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

from assay.data.tasks.base import TASKS, Task
from assay.rewards.base import REWARDS, Reward
from assay.types import RewardResult, Sample, Trajectory

MAX_EXPR_CHARS = 200
_TOKEN = re.compile(r"\s*(\d{1,6}|[-+*/()×÷x])")


@TASKS.register("countdown")
class Countdown(Task):
    """Pick `count` numbers in 1..max_value and a target reachable from some of them.

    The prompt is `3 5 7>22:` (numbers, then the target); the gold answer is one
    expression that reaches it, for example `(7-5)*3+...`.
    """

    reward = "countdown"

    def __init__(self, count: int = 3, max_value: int = 10, heldout_fraction: float = 0.2):
        self.count, self.max_value, self.heldout_fraction = count, max_value, heldout_fraction

    def make(self, rng: random.Random) -> Sample:
        while True:
            nums = [rng.randint(1, self.max_value) for _ in range(self.count)]
            used = rng.sample(nums, rng.randint(2, self.count))
            expr, value = str(used[0]), Fraction(used[0])
            for n in used[1:]:
                op = rng.choice("+-*/")
                if op == "/" and (value % n != 0):
                    op = "+"
                expr = f"({expr}){op}{n}" if op in "*/" and any(c in expr for c in "+-") else f"{expr}{op}{n}"
                value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
            if value.denominator == 1 and 0 < value <= 1000:
                break
        prompt = " ".join(map(str, nums)) + f">{int(value)}:"
        return Sample(id="", prompt=prompt, answer=expr, fields={"nums": nums, "target": int(value)})


class ParseError(ValueError):
    pass


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an arithmetic expression exactly; return its value and the numbers it uses.

    Grammar: expr := term (('+'|'-') term)*; term := factor (('*'|'/') factor)*;
    factor := number | '(' expr ')' | '-' factor. Raises ParseError (also for ÷ 0).
    """
    if len(text) > MAX_EXPR_CHARS:
        raise ParseError("too_long")
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ParseError(f"bad character at {pos}")
        tokens.append({"×": "*", "x": "*", "÷": "/"}.get(m.group(1), m.group(1)))
        pos = m.end()
    used: list[int] = []
    i = 0

    def peek() -> str | None:
        return tokens[i] if i < len(tokens) else None

    def take() -> str:
        nonlocal i
        if i >= len(tokens):
            raise ParseError("unexpected end")
        i += 1
        return tokens[i - 1]

    def expr(depth: int) -> Fraction:
        if depth > 20:
            raise ParseError("too_deep")
        v = term(depth)
        while peek() in ("+", "-"):
            v = v + term(depth) if take() == "+" else v - term(depth)
        return v

    def term(depth: int) -> Fraction:
        v = factor(depth)
        while peek() in ("*", "/"):
            op, rhs = take(), factor(depth)
            if op == "/" and rhs == 0:
                raise ParseError("division_by_zero")
            v = v * rhs if op == "*" else v / rhs
        return v

    def factor(depth: int) -> Fraction:
        t = take()
        if t == "(":
            v = expr(depth + 1)
            if take() != ")":
                raise ParseError("unbalanced")
            return v
        if t == "-":
            return -factor(depth + 1)
        if t.isdigit():
            used.append(int(t))
            return Fraction(int(t))
        raise ParseError(f"unexpected {t!r}")

    if not tokens:
        raise ParseError("empty")
    value = expr(0)
    if i != len(tokens):
        raise ParseError(f"unexpected {tokens[i]!r}")
    return value, used


@REWARDS.register("countdown")
class CountdownReward(Reward):
    """1 when the completion's expression equals the target using only the given numbers.

    Needs the row fields `nums` (list of ints) and `target` (int). Each number may be
    used at most as often as it is given; not all need to be used.
    """

    def score(self, traj: Trajectory) -> RewardResult:
        f = traj.sample.fields
        try:
            nums, target = Counter(int(n) for n in f["nums"]), Fraction(int(f["target"]))
        except (KeyError, TypeError, ValueError):
            return RewardResult(None, info={"reason": "unparseable_gold"})
        try:
            value, used = parse_expression(traj.completion.strip())
        except ParseError as e:
            return RewardResult(0.0, info={"reason": "unparseable", "detail": str(e)})
        if Counter(used) - nums:
            return RewardResult(0.0, info={"reason": "numbers_not_allowed", "used": used})
        ok = value == target
        return RewardResult(float(ok), info={"reason": "correct" if ok else "wrong", "value": str(value)})
