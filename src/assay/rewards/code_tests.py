"""The `code` reward's tests: a row's `tests` field as sandbox jobs, and the stage each test reached.

Test groups (the row's `tests` field holds one or a list of them):

    {"kind": "stdio",  "cases": [{"input": "1 2\\n", "output": "3\\n"}]}
    {"kind": "call",   "fn": "add", "cases": [{"args": [1, 2], "kwargs": {}, "expected": 3}]}
    {"kind": "assert", "cases": ["assert add(1, 2) == 3"], "setup": "import math"}
    {"kind": "check",  "entry_point": "add", "test": "def check(candidate): ...", "setup": "", "check": "check"}

Stages, in order of progress: "no_code", "syntax_error", "compile_error", "runtime_error",
"timeout", "wrong_answer", "pass"; a program's stage is that of its worst test. A test
reaches "wrong_answer" or "pass" only with a result: stdout that is not empty (unless the
expected output is empty too), a complete call or expression value, or a check function that
ran to its end against a live program. Anything else is a crash ("runtime_error"), or
"timeout" when the test really ran out of time: the wall clock, the whole program's deadline,
or SIGXCPU/SIGKILL after spending at least half its CPU limit (a program that sends itself
SIGXCPU early has crashed, not timed out). Half, not all: the kernel sends SIGXCPU when the
tick-sampled CPU time reaches the limit, and the precise time the parent reads back can be
lower on a busy machine (0.96 s for a 1 s limit here, measured).

    >>> produced(b" \\n", "lines"), produced(b"0", "lines")
    (False, True)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from assay.errors import AssayError
from assay.sandbox import check, grading
from assay.sandbox.languages import language
from assay.sandbox.runner import CaseRecord, Job, Limits, ProgramResult

STAGES = ("no_code", "syntax_error", "compile_error", "runtime_error", "timeout", "wrong_answer", "pass")
"""Stages in order of progress; a program's stage is that of its worst test."""
KINDS = ("stdio", "call", "assert", "check")
_SIGXCPU, _SIGKILL = 24, 9
_CHECK_STAGES = {"pass": "pass", "failed": "wrong_answer", "invalid": "wrong_answer", "raised": "runtime_error",
                 "gone": "runtime_error", "not_ready": "runtime_error"}


@dataclass
class CaseGroup:
    """One group of the row's tests, parsed: the job to run and what the parent checks.

    Attributes:
        job: the sandbox job (inputs only).
        expected: per case `[N]`: expected stdout text, expected JSON value, an AssertCheck, or None (check).
        kind: "stdio", "call", "assert" or "check".
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
    kind = g.get("kind")
    if kind not in KINDS:
        raise AssayError(f"unknown test kind {kind!r}; known: {', '.join(KINDS)}")
    if kind != "stdio" and lang["kind"] != "python":
        raise AssayError(f"{kind!r} tests need a Python program; this language runs stdio tests only")
    lim = Limits(**{**limits.__dict__, "wall_s": None, "cpu_s": float(g.get("cpu_s", limits.cpu_s))})
    if kind == "check":
        return _check_group(g, lang, source, lim)
    cases = g.get("cases")
    if not isinstance(cases, list):
        raise AssayError(f"test group {kind!r} needs a list 'cases'")
    if kind == "stdio":
        inputs = [{"input": str(c.get("input", ""))} for c in cases]
        return CaseGroup(Job(lang, source, "stdio", inputs, limits=lim), [str(c.get("output", "")) for c in cases], kind)
    if kind == "call":
        if not isinstance(g.get("fn"), str):
            raise AssayError("call tests need 'fn', the function's name")
        inputs = [{"args": list(c.get("args", [])), "kwargs": dict(c.get("kwargs", {}))} for c in cases]
        return CaseGroup(Job(lang, source, "call", inputs, fn=g["fn"], limits=lim), [c.get("expected") for c in cases], kind)
    checks = [grading.split_assert(str(c)) for c in cases]
    inputs = [{"exprs": c.exprs} for c in checks]
    return CaseGroup(Job(lang, source, "exprs", inputs, setup=str(g.get("setup", "")), limits=lim), checks, kind)


def _check_group(g: dict[str, Any], lang: dict[str, Any], source: str, lim: Limits) -> CaseGroup:
    """A check test: validated and compiled here, run in the sandbox worker (one test)."""
    fields = {k: g.get(k, d) for k, d in (("entry_point", None), ("test", None), ("setup", ""), ("check", "check"))}
    bad = [k for k, v in fields.items() if not isinstance(v, str) or (k != "setup" and not v)]
    if bad:
        raise AssayError(f"check tests need string fields entry_point, test (and optional setup, check); bad: {bad}")
    try:
        check.compile_spec(fields["setup"], fields["test"])
    except SyntaxError as e:
        raise AssayError(f"check test does not compile: {e.msg} (line {e.lineno})") from None
    spec = check.CheckSpec(fields["test"], fields["entry_point"], fields["setup"], fields["check"])
    return CaseGroup(Job(lang, source, "check", [{}], fn=spec.entry_point, limits=lim, check=spec), [None], "check")


def _truncate(groups: list[CaseGroup], max_tests: int) -> list[CaseGroup]:
    left, out = max_tests, []
    for g in groups:
        g.job.cases, g.expected = g.job.cases[:left], g.expected[:left]
        left -= len(g.expected)
        if g.expected:
            out.append(g)
    return out


@dataclass
class Options:
    """Comparison options shared by every test (see `CodeReward`)."""

    whitespace: str = "lines"
    float_tol: float = 1e-6


def timed_out(rec: CaseRecord, limits: Limits) -> bool:
    """The test really ran out of time: its wall clock, or its CPU limit (the signal alone is not enough: at least
    half the limit spent, as the precise CPU time read back can be below the kernel's tick-sampled one)."""
    cpu_limit = max(1, math.ceil(limits.cpu_s))
    return rec.status == "timeout" or (rec.sig in (_SIGXCPU, _SIGKILL) and rec.cpu >= 0.5 * cpu_limit)


def produced(stdout: bytes, whitespace: str) -> bool:
    """Whether a stdio test printed anything that counts as output under the comparison mode."""
    if whitespace == "exact":
        return bool(stdout)
    return bool(stdout.decode("utf-8", "replace").strip())


def case_stage(rec: CaseRecord, kind: str, expected: Any, limits: Limits, opts: Options) -> str:
    """The stage one test reached: "runtime_error", "timeout", "wrong_answer" or "pass"."""
    if timed_out(rec, limits):
        return "timeout"
    if kind == "stdio":
        if rec.status == "output_limit":
            return "wrong_answer"  # it printed: too much, so wrong
        if rec.status != "ok" or not (produced(rec.stdout, opts.whitespace) or not produced(expected.encode(), opts.whitespace)):
            return "runtime_error"
        return "pass" if grading.stdout_matches(rec.stdout, expected, opts.whitespace) else "wrong_answer"
    if kind == "check":
        stage = _CHECK_STAGES.get(rec.check or "", "runtime_error")
        return stage if rec.status == "ok" or stage == "runtime_error" else "runtime_error"
    if rec.status != "ok" or rec.result is None:
        return "runtime_error"
    try:
        value = grading.decode(rec.result)
    except ValueError:
        return "runtime_error"  # not a result the harness wrote
    if kind == "call":
        ok = grading.values_equal(grading.json_view(value) if type(value) not in (set, frozenset) else value,
                                  expected, opts.float_tol)
    else:
        ok = isinstance(value, list) and expected.passes(value)
    return "pass" if ok else "wrong_answer"


@dataclass
class Graded:
    """One program's verdict before scoring: `passed [N]`, `stages [N]`, the program stage."""

    passed: list[bool]
    stages: list[str]
    stage: str
    runtime_s: float
    compile_error: str = ""
    detail: list[str] = field(default_factory=list)


class Unscorable(Exception):
    """The program cannot be scored, through no fault of its own (sandbox or test failure)."""

    def __init__(self, message: str, stage: str) -> None:
        super().__init__(message)
        self.stage = stage


def grade(groups: list[CaseGroup], results: list[ProgramResult], opts: Options) -> Graded:
    """Per-test verdicts of one program; raises `Unscorable` when the sandbox or the test failed."""
    passed, stages, detail, runtime = [], [], [], 0.0
    for g, r in zip(groups, results):
        if r.status in ("sandbox_error", "test_error"):
            raise Unscorable(r.error or r.status, r.status)
        if not r.compiled:
            stage = "syntax_error" if g.job.lang["kind"] == "python" else "compile_error"
            n = sum(len(x.expected) for x in groups)
            return Graded([False] * n, [stage] * n, stage, 0.0, r.compile_error[:2000])
        for rec, exp in zip(r.cases, g.expected):
            st = case_stage(rec, g.kind, exp, g.job.limits, opts)
            if r.status == "timeout" and (rec.status == "missing" or rec.sig == _SIGKILL):
                # the whole program's deadline stopped the sandbox: a test with no record, or one the harness saw
                # killed as the sandbox went down (on a busy machine, before the test's own CPU limit), ran out of time
                st = "timeout"
            passed.append(st == "pass")
            stages.append(st)
            detail.append(_detail(rec, st))
            runtime += rec.wall
    stage = min(stages, key=STAGES.index) if stages else "runtime_error"
    return Graded(passed, stages, stage, runtime, detail=detail)


def _detail(rec: CaseRecord, stage: str) -> str:
    if stage == "pass":
        return ""
    if rec.check is not None and rec.note:
        return f"check {rec.check}: {rec.note}"[-300:]
    return rec.stderr[-300:] if stage == "runtime_error" else ""
