"""The `code` reward: run the completion's program in the sandbox against the row's tests.

The program is extracted from the completion (by default the last fenced block of the
language), run in `assay.sandbox` once per trajectory with every test case, and graded in
this (trusted) process: expected outputs never enter the sandbox. The row's `tests` field
holds one test group or a list of them:

    {"kind": "stdio",  "cases": [{"input": "1 2\\n", "output": "3\\n"}]}
    {"kind": "call",   "fn": "add", "cases": [{"args": [1, 2], "kwargs": {}, "expected": 3}]}
    {"kind": "assert", "cases": ["assert add(1, 2) == 3"], "setup": "import math"}
    {"kind": "check",  "entry_point": "add", "test": "def check(candidate):\\n    assert candidate(1, 2) == 3\\n",
     "setup": "", "check": "check"}

A check test is one test: its function runs in the trusted parent and calls the program's
function through a proxy whose arguments and results cross the sandbox by value
(`assay.sandbox.check`); `code_datasets` converts HumanEval, MBPP and APPS rows.

`info` carries the per-test pass vector (`passed`), each test's stage (`case_stages`) and
the stage the program reached (`stage`): "no_code", "syntax_error", "compile_error",
"runtime_error", "timeout", "wrong_answer" or "pass" — the worst test decides.

Scoring modes (`mode`):
    all       1 if every test passes, else 0.
    fraction  passed / N.
    verpo     (1 - beta) * 1[all pass] + beta * sum_j w_j pass_j / sum_j w_j, with the
              difficulty weight w_j = 1 - p_j and p_j = (s_j + 1) / (n_j + 2) the running pass
              rate of test j of that prompt (VeRPO: dense verifiable code rewards with
              difficulty weights from execution statistics).
    staged    a tier per stage (`tiers`), so failing programs are ordered by how far they
              got and passing ones get 1 (the staged reward of RLPF, RL from Performance Feedback).
              A test that ends without a result (exits, is killed, closes its output, prints
              nothing, execs another program, runs out of time) is a crash: `runtime_error`,
              or `timeout` when it really spent its CPU or wall time. Tiers must not put
              `timeout`, `no_code`, `syntax_error` or `compile_error` above `runtime_error`,
              so no way of avoiding the tests earns more than a crash.
With `runtime_weight` w > 0 and a reference solution in the row's `reference_field`, a
program that passes everything scores (1 - w) * base + w * min(1, t_ref / t), and any
other program (1 - w) * base, where t is the program's summed per-test wall time and t_ref
the reference's (RLPF, RL from Performance Feedback: correct programs ranked by runtime relative to a
reference). The reference runs once per prompt and is cached.

    >>> extract_code("text ```python\\nprint(1)\\n``` more", "python")
    'print(1)\\n'
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from typing import Any

from assay.errors import AssayError
from assay.rewards.base import REWARDS, Reward
from assay.rewards.code_tests import STAGES, CaseGroup, Graded, Options, Unscorable, grade, parse_tests
from assay.sandbox import grading
from assay.sandbox.languages import language
from assay.sandbox.pool import shared_pool
from assay.sandbox.runner import Limits, ProgramResult
from assay.types import RewardResult, Trajectory

__all__ = ["CodeReward", "extract_code", "hack_flags", "STAGES", "DEFAULT_TIERS", "MODES", "EXTRACT"]
DEFAULT_TIERS = {"no_code": 0.0, "syntax_error": 0.0, "compile_error": 0.0, "runtime_error": 0.1,
                 "timeout": 0.1, "wrong_answer": 0.3, "pass": 1.0}
NO_RESULT_STAGES = ("no_code", "syntax_error", "compile_error", "timeout")
"""Stages in which no test produced a result; their tiers may not exceed the crash tier."""
MODES = ("all", "fraction", "verpo", "staged")
EXTRACT = ("fenced", "fenced_strict", "first_fenced", "raw", "continuation")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)


_FLAGS = {name: re.compile(rx) for name, rx in {
    "early_exit": r"\b(sys\.exit|os\._exit|quit\(|exit\()",
    "eq_override": r"def\s+__(eq|ne|hash)__",
    "introspection": r"_getframe|\binspect\b|gc\.get_(objects|referrers)|f_back|f_locals",
    "module_patching": r"sys\.modules|\bbuiltins\b|__builtins__",
    "signals": r"\bsignal\b|\batexit\b|\bctypes\b|\bptrace\b",
    "processes": r"\bfork\b|\bsubprocess\b|\bos\.kill\b|\bsetsid\b",
}.items()}


def hack_flags(code: str) -> list[str]:
    """Names of reward-hacking patterns the program text contains; a monitor, never a verdict.

    A regex scan (the parent never parses untrusted code): a rising rate of a flag across steps is the signal to look at.

        >>> hack_flags("import sys; sys.exit(0)")
        ['early_exit']
    """
    head = code[:200_000]
    return [name for name, rx in _FLAGS.items() if rx.search(head)]


def extract_code(completion: str, lang: str, how: str = "fenced") -> str | None:
    """The program in `completion`, or None.

    how: "fenced" (last block tagged with the language, else the last untagged block),
    "fenced_strict" (tagged blocks only), "first_fenced" (first block tagged or untagged),
    "raw" (the whole completion), "continuation" (the completion continues a program: its
    last fenced block if it has one, else the whole completion; `CodeReward` puts the row's
    start of the program before it).
    """
    if how == "continuation":
        block = extract_code(completion, lang, "fenced")
        return block if block is not None else extract_code(completion, lang, "raw")
    if how == "raw":
        return completion if completion.strip() else None
    names = language(lang)["fence"]
    blocks = [(tag.strip().lower(), body) for tag, body in _FENCE.findall(completion)]
    tagged = [b for t, b in blocks if t in names]
    untagged = [b for t, b in blocks if not t]
    if how == "first_fenced":
        chosen = [b for t, b in blocks if t in names or not t][:1]
    else:
        chosen = tagged or ([] if how == "fenced_strict" else untagged)
    return chosen[-1] if chosen and chosen[-1].strip() else None


@REWARDS.register("code")
class CodeReward(Reward):
    """Unit-test reward for programs written by the policy, run in the sandbox.

    Args:
        language: language of the program ("python", "cpp", or any `LANGUAGES` entry); a row's
            `language` field overrides it.
        mode: "all", "fraction", "verpo" or "staged" (see the module docstring).
        extract: how the program is found in the completion ("fenced", "fenced_strict",
            "first_fenced", "raw", "continuation": the row's `prefix_field` followed by the
            completion's fenced block or, without one, the completion itself — HumanEval's
            rule, program = prompt + completion; a model that answers with the whole function
            in a fence redefines the prompt's stub).
        whitespace: stdio comparison ("lines", "tokens", "exact").
        float_tol: relative and absolute tolerance for floats in call results.
        cpu_s, memory_mb: per-test CPU seconds and address-space MiB (a group's `cpu_s` overrides).
        max_tests: run at most this many tests per program (None: all).
        tiers: reward per stage for mode "staged" (defaults `DEFAULT_TIERS`).
        verpo_beta: weight of the dense term in mode "verpo".
        runtime_weight: weight of the runtime term (0 disables it).
        reference_field: row field holding the reference solution for the runtime term.
        tests_field: row field holding the tests.
        prefix_field: with extract "continuation", the row field holding the program's start.
        workers: sandbox worker slots (None: one per core).
        unsafe_no_sandbox: run WITHOUT isolation when no sandbox is available (explicit opt-out).
        fork_server: run Python programs in each worker's fork server (default); False starts a
            fresh bwrap sandbox per program (same isolation, slower; kept for comparison).

    `kind` is "io": the reward waits on sandbox workers, so an executor may call `score` from
    many threads at once (the pool is thread-safe); `__call__` on a batch runs it in one go.
    The VeRPO statistics live in this object: score a run's batches with one instance.
    """

    kind = "io"

    def __init__(self, language: str = "python", mode: str = "all", extract: str = "fenced",
                 whitespace: str = "lines", float_tol: float = 1e-6, cpu_s: float = 2.0, memory_mb: int = 512,
                 max_tests: int | None = None, tiers: dict[str, float] | None = None, verpo_beta: float = 0.5,
                 runtime_weight: float = 0.0, reference_field: str = "reference", tests_field: str = "tests",
                 workers: int | None = None, unsafe_no_sandbox: bool = False, fork_server: bool = True,
                 prefix_field: str = "code_prompt") -> None:
        _check("mode", mode, MODES)
        _check("extract", extract, EXTRACT)
        _check("whitespace", whitespace, grading.WHITESPACE_MODES)
        _check_tiers({**DEFAULT_TIERS, **(tiers or {})})
        self.language, self.mode, self.extract, self.whitespace = language, mode, extract, whitespace
        self.float_tol, self.cpu_s, self.memory_mb, self.max_tests = float_tol, cpu_s, memory_mb, max_tests
        self.tiers = {**DEFAULT_TIERS, **(tiers or {})}
        self.verpo_beta, self.runtime_weight, self.reference_field = verpo_beta, runtime_weight, reference_field
        self.tests_field, self.workers, self.unsafe_no_sandbox = tests_field, workers, unsafe_no_sandbox
        self.fork_server, self.prefix_field = fork_server, prefix_field
        self._stats: dict[str, list[list[int]]] = {}  # prompt key -> per test [passes, runs]
        self._ref_runtime: dict[str, float | None] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def score(self, traj: Trajectory) -> RewardResult:
        return self([traj])[0]

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        plans = [self._plan(t) for t in batch]
        refs = self._reference_plans(batch, plans)
        jobs = [g.job for p in plans if isinstance(p, list) for g in p] + [g.job for _, p in refs for g in p]
        pool = shared_pool(self.workers, self.unsafe_no_sandbox, self.fork_server) if jobs else None
        results = iter(pool.run(jobs) if pool else [])
        graded = [[next(results) for _ in p] if isinstance(p, list) else p for p in plans]
        self._record_references(refs, [[next(results) for _ in p] for _, p in refs])
        out = []
        for t, p, r in zip(batch, plans, graded):
            out.append(self._result(t, p, r) if isinstance(p, list) else r)
        return out

    def _limits(self) -> Limits:
        return Limits(cpu_s=self.cpu_s, memory_mb=self.memory_mb)

    def _lang(self, t: Trajectory) -> str:
        return str(t.sample.fields.get("language") or self.language)

    def _plan(self, t: Trajectory) -> list[CaseGroup] | RewardResult:
        """The test groups to run for `t`, or the final result when nothing needs running."""
        try:
            lang = self._lang(t)
            code = extract_code(t.completion, lang, self.extract)
            if code is not None and self.extract == "continuation":
                code = str(t.sample.fields.get(self.prefix_field) or "") + code
            tests = t.sample.fields.get(self.tests_field)
            if tests is None:
                return RewardResult.failed(f"row has no {self.tests_field!r} field", score=None)
            groups = parse_tests(tests, lang, code or "", self._limits(), self.max_tests)
        except AssayError as e:
            return RewardResult.failed(str(e), score=None)
        except (TypeError, ValueError, AttributeError, KeyError) as e:  # a malformed row
            return RewardResult.failed(f"malformed tests: {type(e).__name__}: {e}", score=None)
        if code is None:
            n = sum(len(g.expected) for g in groups)
            return self._scored(t, Graded([False] * n, ["no_code"] * n, "no_code", 0.0), {"extracted": False})
        return groups

    def _result(self, t: Trajectory, groups: list[CaseGroup], results: list[ProgramResult]) -> RewardResult:
        try:
            g = grade(groups, results, Options(self.whitespace, self.float_tol))
        except Unscorable as e:
            what = "sandbox error" if e.stage == "sandbox_error" else "the row's test cannot run"
            return RewardResult.failed(f"{what}: {e}", score=None, stage=e.stage)
        except Exception as e:  # fail closed: whatever broke grading came from the program's output
            return RewardResult.failed(f"grading failed: {type(e).__name__}: {e}", score=0.0, stage="runtime_error")
        return self._scored(t, g, {"extracted": True, "flags": hack_flags(groups[0].job.source)})

    def _scored(self, t: Trajectory, g: Graded, info: dict[str, Any]) -> RewardResult:
        n, k = len(g.passed), sum(g.passed)
        base, weights = self._base_score(t, g)
        components = {"pass_rate": k / n if n else 0.0, "pass_all": float(n > 0 and k == n)}
        score = base
        if self.runtime_weight > 0:
            score, speed = self._with_runtime(t, base, g)
            info["ref_runtime_s"] = self._ref_runtime.get(_prompt_key(t, self.tests_field))
            if speed is not None:
                components["speed"] = speed
        info.update(stage=g.stage, passed=g.passed, case_stages=g.stages, n_tests=n, n_passed=k,
                    language=self._lang(t), mode=self.mode, runtime_s=round(g.runtime_s, 6))
        if weights is not None:
            info["weights"] = [round(w, 4) for w in weights]
        if g.compile_error:
            info["compile_error"] = g.compile_error
        if any(g.detail):
            info["errors"] = [d for d in g.detail if d][:3]
        if g.stage != "pass":
            info["reason"] = g.stage
        return RewardResult(score=score, components=components, info=info)

    def _base_score(self, t: Trajectory, g: Graded) -> tuple[float, list[float] | None]:
        n, k = len(g.passed), sum(g.passed)
        if self.mode == "all":
            return float(n > 0 and k == n), None
        if self.mode == "fraction":
            return (k / n if n else 0.0), None
        if self.mode == "staged":
            return self.tiers.get(g.stage, 0.0), None
        return self._verpo(t, g.passed)

    def _verpo(self, t: Trajectory, passed: list[bool]) -> tuple[float, list[float]]:
        """VeRPO: difficulty weights from running pass rates (before this result), then update."""
        with self._lock:
            stats = self._stats.setdefault(_prompt_key(t, self.tests_field), [[0, 0] for _ in passed])
            if len(stats) != len(passed):
                stats[:] = [[0, 0] for _ in passed]
            weights = [1.0 - (s + 1) / (r + 2) for s, r in stats]
            for s, p in zip(stats, passed):
                s[0] += int(p)
                s[1] += 1
        dense = sum(w for w, p in zip(weights, passed) if p) / sum(weights) if passed else 0.0
        all_pass = float(bool(passed) and all(passed))
        return (1 - self.verpo_beta) * all_pass + self.verpo_beta * dense, weights

    def _with_runtime(self, t: Trajectory, base: float, g: Graded) -> tuple[float, float | None]:
        w = self.runtime_weight
        ref = self._ref_runtime.get(_prompt_key(t, self.tests_field))
        if g.stage != "pass" or ref is None:
            return (1 - w) * base, None
        speed = min(1.0, ref / max(g.runtime_s, 1e-6))
        return (1 - w) * base + w * speed, speed

    def _reference_plans(self, batch: list[Trajectory], plans: list[Any]) -> list[tuple[str, list[CaseGroup]]]:
        """Reference solutions to run this batch: one per prompt whose runtime is not cached."""
        if self.runtime_weight <= 0:
            return []
        todo: dict[str, list[CaseGroup]] = {}
        for t, p in zip(batch, plans):
            key, ref = _prompt_key(t, self.tests_field), t.sample.fields.get(self.reference_field)
            if not isinstance(p, list) or key in self._ref_runtime or key in todo:
                continue
            if not isinstance(ref, str):
                self._ref_runtime[key] = None
                continue
            code = extract_code(ref, self._lang(t), self.extract) or ref
            todo[key] = parse_tests(t.sample.fields[self.tests_field], self._lang(t), code, self._limits(),
                                    self.max_tests)
        return list(todo.items())

    def _record_references(self, refs: list[tuple[str, list[CaseGroup]]], results: list[list[ProgramResult]]) -> None:
        for (key, groups), res in zip(refs, results):
            try:
                g: Graded | None = grade(groups, res, Options(self.whitespace, self.float_tol))
            except Exception:  # a reference we cannot grade gives no runtime term
                g = None
            self._ref_runtime[key] = g.runtime_s if g is not None and g.stage == "pass" else None


def _prompt_key(t: Trajectory, tests_field: str) -> str:
    tests = json.dumps(t.sample.fields.get(tests_field), sort_keys=True, default=str)
    return f"{t.sample.id}:{hashlib.sha1(tests.encode()).hexdigest()[:12]}"


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise AssayError(f"code reward: {name}={value!r} is not one of {', '.join(allowed)}")


def _check_tiers(tiers: dict[str, float]) -> None:
    """Refuse tiers under which avoiding the tests (looping, not compiling...) beats a crash."""
    unknown = sorted(set(tiers) - set(STAGES))
    if unknown:
        raise AssayError(f"code reward: tiers has unknown stages {unknown}; known: {', '.join(STAGES)}")
    above = [s for s in NO_RESULT_STAGES if tiers[s] > tiers["runtime_error"]]
    if above:
        raise AssayError(f"code reward: tiers {above} exceed runtime_error ({tiers['runtime_error']}); "
                         "no way of avoiding the tests may score above a crash")
