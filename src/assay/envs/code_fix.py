"""The `code-fix` environment and task: write a program, read the test report, revise it.

Each turn the model submits a program (found in its turn the way the `code` verifier finds
it: `extract`); the program runs in the sandbox against the row's tests (`assay.sandbox`,
through `assay.rewards.code.CodeReward`, the same verifier that scores single-turn code). When
every test passes the episode ends; otherwise the model is shown a report, at most
`max_chars` characters, and may try again, up to `max_attempts` submissions:

    2/3 tests passed (wrong_answer).
    failed: assert f(7) == 23
    error: ZeroDivisionError: division by zero

Failing tests are named by their text (an assert, `fn(args) == expected` for a call test, the
input of a stdio test, `check(entry_point)` for a check test); `error:` lines are the last
line of each distinct error: what failing tests wrote to stderr (the exception, for Python)
or the compile error, each already bounded by the verifier. The tests shown are the ones
scored: this is repair against known tests, the set-up of "Teaching Large Language Models to
Self-Debug" (Chen et al., 2023), not a held-out measure.

**What is scored: the last program submitted**, not the best one. Turn k's reward is
`score_k − score_{k−1}` (the verifier's score of the k-th program minus that of the one before,
0 before the first), so the episode's reward, the sum of its turns' rewards, is the last
program's score however the episode ends (all tests passing, `max_attempts`, or a budget of
the rollout loop: `max_turns`, context, time). A revision that breaks a passing program loses
what it had; the per-turn differences are the turn rewards `turn_grpo` builds its returns from, and
`info["progress"]` (the fraction of tests passing) is what `turn_progress` reads. A program
the verifier cannot score (sandbox failure, a malformed row) ends the episode with reward None.

The task (`data.task: code-fix`) is a bundled set of small procedural Python problems
(`FAMILIES`: a function `f` from a one-line statement, with assert tests and a reference
solution in `fields["reference"]`); any code dataset with a `tests` field (`data.format: mbpp`,
`humaneval`, `apps`) works with the environment too.

    >>> names_of({"kind": "assert", "cases": ["assert f(1) == 2"]})
    ['assert f(1) == 2']
"""

from __future__ import annotations

import json
import random
from typing import Any, Callable

from assay.data.tasks.base import TASKS, Task
from assay.envs.base import ENVS, Environment, Step
from assay.errors import AssayError
from assay.rewards.code import CodeReward
from assay.types import RewardResult, Sample, Trajectory

NAME_CHARS = 80
"""A test's name is cut to this many characters."""


def names_of(tests: Any) -> list[str]:
    """One name per test of a row's `tests` field, in the order the verifier reports them (`info["passed"]`)."""
    groups = json.loads(tests) if isinstance(tests, str) else tests
    names: list[str] = []
    for g in groups if isinstance(groups, list) else [groups]:
        kind, cases = g.get("kind"), g.get("cases") or []
        if kind == "assert":
            names += [str(c).strip() for c in cases]
        elif kind == "call":
            names += [f"{g.get('fn')}({', '.join(map(repr, c.get('args', [])))}) == {c.get('expected')!r}" for c in cases]
        elif kind == "stdio":
            names += [f"stdin {str(c.get('input', ''))!r}" for c in cases]
        elif kind == "check":
            names.append(f"check({g.get('entry_point')})")
    return [n[:NAME_CHARS] for n in names]


def report(result: RewardResult, names: list[str], extract: str, max_chars: int) -> str:
    """The test report a model is shown after a program that did not pass, at most `max_chars` characters."""
    info = result.info
    stage = info.get("stage", "runtime_error")
    if stage == "no_code":
        text = "no program found" + (": write it in a ```python block" if extract.startswith("fenced") else "")
    else:
        lines = [f"{info.get('n_passed', 0)}/{info.get('n_tests', 0)} tests passed ({stage})."]
        lines += [f"failed: {n}" for n, ok in zip(names, info.get("passed", [])) if not ok]
        errors = [info.get("compile_error", "")] + list(info.get("errors", []))
        lasts = [e.strip().splitlines()[-1].strip() for e in errors if e.strip()]
        lines += [f"error: {e}" for e in dict.fromkeys(lasts)]  # each distinct error's last line, in order
        text = "\n".join(lines)
    return text if len(text) <= max_chars else text[: max_chars - 3] + "..."


@ENVS.register("code-fix")
class CodeFix(Environment):
    """Write a program, read its test report, revise it; the last program submitted is scored (see the module docstring).

    Args:
        max_attempts: submissions per episode (the rollout loop's `max_turns` may end it sooner).
        max_chars: a test report is cut to this many characters.
        extract: how the program is found in a turn (`fenced`, `raw`, ...: `CodeReward`'s `extract`).
        language, mode, cpu_s, memory_mb, tests_field, workers, unsafe_no_sandbox: the `code` verifier's
            arguments (`assay.rewards.code.CodeReward`).
    """

    chat_role = "user"

    def __init__(self, max_attempts: int = 3, max_chars: int = 400, extract: str = "fenced", language: str = "python", mode: str = "all",
                 cpu_s: float = 1.0, memory_mb: int = 512, tests_field: str = "tests", workers: int | None = None,
                 unsafe_no_sandbox: bool = False) -> None:
        if max_attempts < 1 or max_chars < 20:
            raise AssayError(f"env code-fix: need max_attempts >= 1 and max_chars >= 20; got {max_attempts}, {max_chars}")
        self.max_attempts, self.max_chars, self.extract, self.tests_field = max_attempts, max_chars, extract, tests_field
        self.verifier = CodeReward(language=language, mode=mode, extract=extract, cpu_s=cpu_s, memory_mb=memory_mb, tests_field=tests_field,
                                   workers=workers, unsafe_no_sandbox=unsafe_no_sandbox)
        self.sample: Sample | None = None

    def reset(self, sample: Sample) -> str:
        self.sample, self.attempts, self.last = sample, 0, 0.0
        self.names = names_of(sample.fields.get(self.tests_field) or [])
        return sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1].get("content", ""))

    def step(self, action: str) -> Step:
        assert self.sample is not None, "reset first"
        self.attempts += 1
        result = self.verifier([Trajectory(self.sample, action, [], [], [], True)])[0]
        info: dict[str, Any] = {"attempt": self.attempts, "stage": result.info.get("stage"),
                                "progress": result.components.get("pass_rate")}
        if result.score is None:
            return Step("", None, True, {**info, "finish_reason": "unscorable", "error": result.error})
        reward, self.last = result.score - self.last, result.score
        if result.info.get("stage") == "pass":
            return Step("", reward, True, {**info, "finish_reason": "pass"})
        if self.attempts >= self.max_attempts:
            return Step("", reward, True, {**info, "finish_reason": "attempts"})
        return Step(report(result, self.names, self.extract, self.max_chars), reward, False, info)


# -- the bundled task ------------------------------------------------------------------------

#: name → (statement template, reference template, parameter choices, test inputs); `{k}` is the parameter
FAMILIES: dict[str, tuple[str, str, list[Any], list[Any]]] = {
    "affine": ("f(x) returns {k}*x+3.", "def f(x):\n    return {k} * x + 3\n", list(range(2, 10)), [0, 1, 7, -2]),
    "repeat": ("f(s) returns s repeated {k} times.", "def f(s):\n    return s * {k}\n", list(range(2, 6)), ["ab", "", "x"]),
    "sum_over": ("f(xs) returns the sum of the items over {k}.", "def f(xs):\n    return sum(x for x in xs if x > {k})\n",
                 list(range(0, 8)), [[1, 5, 9], [], [8, 8, 2, 10]]),
    "divisible": ("f(n) returns True when {k} divides n.", "def f(n):\n    return n % {k} == 0\n", list(range(2, 8)), [0, 12, 35, 42]),
    "count": ("f(s) returns how many times '{k}' is in s.", "def f(s):\n    return s.count('{k}')\n", list("abcde"),
              ["abcabc", "", "eeda", "bad"]),
    "top": ("f(xs) returns the {k} largest items, largest first.", "def f(xs):\n    return sorted(xs, reverse=True)[:{k}]\n",
            [1, 2, 3], [[3, 1, 2], [5], [4, 9, 9, 0, 7]]),
    "strip": ("f(s) returns s without any '{k}'.", "def f(s):\n    return s.replace('{k}', '')\n", list("xyz"), ["xyzzy", "", "axbx"]),
    "digits": ("f(n) returns the sum of the digits of n times {k}.", "def f(n):\n    return {k} * sum(int(d) for d in str(abs(n)))\n",
               list(range(1, 6)), [0, 123, 9999, -45]),
}


def _reference(code: str) -> Callable[..., Any]:
    """The function `f` a trusted reference template defines (this module's own code, never a model's)."""
    scope: dict[str, Any] = {}
    exec(compile(code, "<reference>", "exec"), scope)  # noqa: S102  (FAMILIES above, not untrusted input)
    return scope["f"]


@TASKS.register("code-fix")
class CodeFixTask(Task):
    """Small procedural Python problems with assert tests and a reference solution (see the module docstring).

    Each problem is one family of `FAMILIES` with one parameter: 42 distinct problems, split
    by the hash of the statement (about a fifth held out).
    """

    reward = "code"

    def __init__(self, heldout_fraction: float = 0.2):
        self.heldout_fraction = heldout_fraction

    def make(self, rng: random.Random) -> Sample:
        name = rng.choice(sorted(FAMILIES))
        statement, reference, choices, inputs = FAMILIES[name]
        k = rng.choice(choices)
        code = reference.format(k=k)
        f = _reference(code)
        cases = [f"assert f({x!r}) == {f(x)!r}" for x in inputs]
        return Sample("", f"Write Python: {statement.format(k=k)}", fields={"tests": {"kind": "assert", "cases": cases},
                                                                            "reference": code, "family": name})
