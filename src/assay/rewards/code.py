"""The `code` reward: run the completion's program in the sandbox against the row's tests.

The program is extracted from the completion (by default the last fenced block of the
language), run in `assay.sandbox` once per trajectory with every test case, and graded in
this (trusted) process: expected outputs never enter the sandbox. The row's `tests` field
holds one test group or a list of them:

    {"kind": "stdio",  "cases": [{"input": "1 2\\n", "output": "3\\n"}]}
    {"kind": "call",   "fn": "add", "cases": [{"args": [1, 2], "kwargs": {}, "expected": 3}]}
    {"kind": "assert", "cases": ["assert add(1, 2) == 3"], "setup": "import math"}

`info` carries the per-test pass vector (`passed`), each test's stage (`case_stages`) and
the stage the program reached (`stage`): "no_code", "syntax_error", "compile_error",
"runtime_error", "timeout", "wrong_answer" or "pass" — the worst test decides.

Scoring modes (`mode`):
    all       1 if every test passes, else 0.
    fraction  passed / N.
    verpo     (1 - beta) * 1[all pass] + beta * sum_j w_j pass_j / sum_j w_j, with the
              difficulty weight w_j = 1 - p_j and p_j = (s_j + 1) / (n_j + 2) the running pass
              rate of test j of that prompt (VeRPO: dense verifiable code rewards with
              difficulty weights from execution statistics, seed-methods/000.md L14).
    staged    a tier per stage (`tiers`), so failing programs are ordered by how far they
              got and passing ones get 1 (RLPF's staged reward, seed-methods/000.md L46).
With `runtime_weight` w > 0 and a reference solution in the row's `reference_field`, a
program that passes everything scores (1 - w) * base + w * min(1, t_ref / t), and any
other program (1 - w) * base, where t is the program's summed per-test wall time and t_ref
the reference's (RLPF: correct programs ranked by runtime relative to a reference,
seed-methods/000.md L46). The reference runs once per prompt and is cached.

    >>> extract_code("text ```python\\nprint(1)\\n``` more", "python")
    'print(1)\\n'
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from assay.errors import AssayError
from assay.rewards.base import REWARDS, Reward
from assay.sandbox import grading
from assay.sandbox.languages import language
from assay.sandbox.pool import shared_pool
from assay.sandbox.runner import CaseRecord, Job, Limits, ProgramResult
from assay.types import RewardResult, Trajectory

STAGES = ("no_code", "syntax_error", "compile_error", "runtime_error", "timeout", "wrong_answer", "pass")
"""Stages in order of progress; a program's stage is that of its worst test."""
DEFAULT_TIERS = {"no_code": 0.0, "syntax_error": 0.0, "compile_error": 0.0, "runtime_error": 0.1,
                 "timeout": 0.2, "wrong_answer": 0.3, "pass": 1.0}
MODES = ("all", "fraction", "verpo", "staged")
EXTRACT = ("fenced", "fenced_strict", "first_fenced", "raw")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_SIGXCPU, _SIGKILL = 24, 9


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

    A regex scan (the parent never parses untrusted code), in the spirit of research/verifiers.md
    §2.4 item 7: a rising rate of a flag across steps is the signal to look at.

        >>> hack_flags("import sys; sys.exit(0)")
        ['early_exit']
    """
    head = code[:200_000]
    return [name for name, rx in _FLAGS.items() if rx.search(head)]


def extract_code(completion: str, lang: str, how: str = "fenced") -> str | None:
    """The program in `completion`, or None.

    how: "fenced" (last block tagged with the language, else the last untagged block),
    "fenced_strict" (tagged blocks only), "first_fenced" (first block tagged or untagged),
    "raw" (the whole completion).
    """
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


@dataclass
class CaseGroup:
    """One group of the row's tests, parsed: the job to run and what the parent checks.

    Attributes:
        job: the sandbox job (inputs only).
        expected: per case `[N]`: expected stdout text, expected JSON value, or an AssertCheck.
        kind: "stdio", "call" or "assert".
    """

    job: Job
    expected: list[Any]
    kind: str


def parse_tests(tests: Any, lang_name: str, source: str, limits: Limits, max_tests: int | None) -> list[CaseGroup]:
    """The row's `tests` field as test groups; AssayError when it is malformed."""
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise AssayError("field 'tests' is a string that is not JSON") from None
    groups = tests if isinstance(tests, list) else [tests]
    if not groups or not all(isinstance(g, dict) for g in groups):
        raise AssayError("field 'tests' must be a test group {kind, cases} or a list of them")
    lang = language(lang_name)
    out = [_group(g, lang, source, limits) for g in groups]
    if max_tests is not None:
        out = _truncate(out, max_tests)
    if sum(len(g.expected) for g in out) == 0:
        raise AssayError("field 'tests' has no cases")
    return out


def _group(g: dict[str, Any], lang: dict[str, Any], source: str, limits: Limits) -> CaseGroup:
    kind, cases = g.get("kind"), g.get("cases")
    if not isinstance(cases, list):
        raise AssayError(f"test group {kind!r} needs a list 'cases'")
    if kind != "stdio" and lang["kind"] != "python":
        raise AssayError(f"{kind!r} tests need a Python program; this language runs stdio tests only")
    lim = Limits(**{**limits.__dict__, "wall_s": None, "cpu_s": float(g.get("cpu_s", limits.cpu_s))})
    if kind == "stdio":
        inputs = [{"input": str(c.get("input", ""))} for c in cases]
        return CaseGroup(Job(lang, source, "stdio", inputs, limits=lim), [str(c.get("output", "")) for c in cases], kind)
    if kind == "call":
        if not isinstance(g.get("fn"), str):
            raise AssayError("call tests need 'fn', the function's name")
        inputs = [{"args": list(c.get("args", [])), "kwargs": dict(c.get("kwargs", {}))} for c in cases]
        return CaseGroup(Job(lang, source, "call", inputs, fn=g["fn"], limits=lim), [c.get("expected") for c in cases], kind)
    if kind == "assert":
        checks = [grading.split_assert(str(c)) for c in cases]
        inputs = [{"exprs": c.exprs} for c in checks]
        return CaseGroup(Job(lang, source, "exprs", inputs, setup=str(g.get("setup", "")), limits=lim), checks, kind)
    raise AssayError(f"unknown test kind {kind!r}; known: stdio, call, assert")


def _truncate(groups: list[CaseGroup], max_tests: int) -> list[CaseGroup]:
    left, out = max_tests, []
    for g in groups:
        g.job.cases, g.expected = g.job.cases[:left], g.expected[:left]
        left -= len(g.expected)
        if g.expected:
            out.append(g)
    return out


def case_stage(rec: CaseRecord, kind: str, expected: Any, limits: Limits, opts: "Options") -> str:
    """The stage one test reached: "runtime_error", "timeout", "wrong_answer" or "pass"."""
    if rec.status == "timeout" or rec.sig == _SIGXCPU or (rec.sig == _SIGKILL and rec.cpu >= 0.9 * limits.cpu_s):
        return "timeout"
    if rec.status == "output_limit":
        return "wrong_answer"
    if rec.status != "ok":
        return "runtime_error"
    if kind == "stdio":
        return "pass" if grading.stdout_matches(rec.stdout, expected, opts.whitespace) else "wrong_answer"
    if rec.result is None:
        return "runtime_error"
    try:
        value = grading.decode(rec.result)
    except ValueError:
        return "wrong_answer"
    if kind == "call":
        ok = grading.values_equal(grading.json_view(value) if type(value) not in (set, frozenset) else value,
                                  expected, opts.float_tol)
    else:
        ok = isinstance(value, list) and expected.passes(value)
    return "pass" if ok else "wrong_answer"


@dataclass
class Options:
    """Comparison options shared by every test (see `CodeReward`)."""

    whitespace: str = "lines"
    float_tol: float = 1e-6


@dataclass
class Graded:
    """One program's verdict before scoring: `passed [N]`, `stages [N]`, the program stage."""

    passed: list[bool]
    stages: list[str]
    stage: str
    runtime_s: float
    compile_error: str = ""
    detail: list[str] = field(default_factory=list)


def grade(groups: list[CaseGroup], results: list[ProgramResult], opts: Options) -> Graded | str:
    """Per-test verdicts of one program, or an error string when the sandbox itself failed."""
    passed, stages, detail, runtime = [], [], [], 0.0
    for g, r in zip(groups, results):
        if r.status == "sandbox_error":
            return r.error or "sandbox error"
        if not r.compiled:
            stage = "syntax_error" if g.job.lang["kind"] == "python" else "compile_error"
            n = sum(len(x.expected) for x in groups)
            return Graded([False] * n, [stage] * n, stage, 0.0, r.compile_error[:2000])
        for rec, exp in zip(r.cases, g.expected):
            st = case_stage(rec, g.kind, exp, g.job.limits, opts)
            if rec.status == "missing" and r.status == "timeout":
                st = "timeout"
            passed.append(st == "pass")
            stages.append(st)
            detail.append(rec.stderr[-300:] if st == "runtime_error" else "")
            runtime += rec.wall
    stage = min(stages, key=STAGES.index) if stages else "runtime_error"
    return Graded(passed, stages, stage, runtime, detail=detail)


@REWARDS.register("code")
class CodeReward(Reward):
    """Unit-test reward for programs written by the policy, run in the sandbox.

    Args:
        language: language of the program ("python", "cpp", or any `LANGUAGES` entry); a row's
            `language` field overrides it.
        mode: "all", "fraction", "verpo" or "staged" (see the module docstring).
        extract: how the program is found in the completion ("fenced", "fenced_strict",
            "first_fenced", "raw").
        whitespace: stdio comparison ("lines", "tokens", "exact").
        float_tol: relative and absolute tolerance for floats in call results.
        cpu_s, memory_mb: per-test CPU seconds and address-space MiB (a group's `cpu_s` overrides).
        max_tests: run at most this many tests per program (None: all).
        tiers: reward per stage for mode "staged" (defaults `DEFAULT_TIERS`).
        verpo_beta: weight of the dense term in mode "verpo".
        runtime_weight: weight of the runtime term (0 disables it).
        reference_field: row field holding the reference solution for the runtime term.
        tests_field: row field holding the tests.
        workers: sandbox worker slots (None: one per core).
        unsafe_no_sandbox: run WITHOUT isolation when no sandbox is available (explicit opt-out).

    `kind` is "io": the reward waits on sandbox workers, so an executor may call `score` from
    many threads at once (the pool is thread-safe); `__call__` on a batch runs it in one go.
    The VeRPO statistics live in this object: score a run's batches with one instance.
    """

    kind = "io"

    def __init__(self, language: str = "python", mode: str = "all", extract: str = "fenced",
                 whitespace: str = "lines", float_tol: float = 1e-6, cpu_s: float = 2.0, memory_mb: int = 512,
                 max_tests: int | None = None, tiers: dict[str, float] | None = None, verpo_beta: float = 0.5,
                 runtime_weight: float = 0.0, reference_field: str = "reference", tests_field: str = "tests",
                 workers: int | None = None, unsafe_no_sandbox: bool = False) -> None:
        _check("mode", mode, MODES)
        _check("extract", extract, EXTRACT)
        _check("whitespace", whitespace, grading.WHITESPACE_MODES)
        self.language, self.mode, self.extract, self.whitespace = language, mode, extract, whitespace
        self.float_tol, self.cpu_s, self.memory_mb, self.max_tests = float_tol, cpu_s, memory_mb, max_tests
        self.tiers = {**DEFAULT_TIERS, **(tiers or {})}
        self.verpo_beta, self.runtime_weight, self.reference_field = verpo_beta, runtime_weight, reference_field
        self.tests_field, self.workers, self.unsafe_no_sandbox = tests_field, workers, unsafe_no_sandbox
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
        results = iter(shared_pool(self.workers, self.unsafe_no_sandbox).run(jobs) if jobs else [])
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
        except Exception as e:  # fail closed: whatever broke grading came from the program's output
            return RewardResult.failed(f"grading failed: {type(e).__name__}: {e}", score=0.0, stage="runtime_error")
        if isinstance(g, str):
            return RewardResult.failed(f"sandbox error: {g}", score=None, stage="sandbox_error")
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
                g = grade(groups, res, Options(self.whitespace, self.float_tol))
            except Exception:  # a reference we cannot grade gives no runtime term
                g = "ungradable"
            self._ref_runtime[key] = g.runtime_s if isinstance(g, Graded) and g.stage == "pass" else None


def _prompt_key(t: Trajectory, tests_field: str) -> str:
    tests = json.dumps(t.sample.fields.get(tests_field), sort_keys=True, default=str)
    return f"{t.sample.id}:{hashlib.sha1(tests.encode()).hexdigest()[:12]}"


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise AssayError(f"code reward: {name}={value!r} is not one of {', '.join(allowed)}")
