"""Text verifiers: exact and normalised match, numbers, choice letters, regex, format, JSON, length.

Each is a small picklable `Reward` scoring 1.0 or 0.0 with a reason in `info`; a
reference that is missing or unusable gives None (cannot be scored), never a silent 0.
The reference is `sample.answer` unless `field` names another dataset column.

    >>> from assay.types import Sample, Trajectory
    >>> t = Trajectory(Sample("0", "", "Paris"), " the  paris. ", [], [], [], True)
    >>> ExactMatch()([t])[0].score, NormalizedMatch()([t])[0].score
    (0.0, 1.0)
"""

from __future__ import annotations

import json
import math
import re
import string
from typing import Any

from assay.rewards.base import REWARDS, Reward
from assay.rewards.math import as_text, extract_answer
from assay.types import RewardResult, Trajectory


def reference(traj: Trajectory, field: str | None) -> Any:
    """The reference: `sample.answer`, or `sample.fields[field]` when `field` is set."""
    if field in (None, "answer"):
        return traj.sample.answer
    return traj.sample.fields.get(field)


def _verdict(ok: bool, **info: Any) -> RewardResult:
    return RewardResult(1.0 if ok else 0.0, info={"reason": "correct" if ok else "wrong", **info})


_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_text(s: str) -> str:
    """SQuAD-style normal form: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", s).split())


@REWARDS.register("exact")
class ExactMatch(Reward):
    """1 when the completion equals the reference exactly (surrounding whitespace ignored if `strip`)."""

    def __init__(self, field: str | None = None, strip: bool = True):
        self.field, self.strip = field, strip

    def score(self, traj: Trajectory) -> RewardResult:
        ref = reference(traj, self.field)
        if ref is None:
            return RewardResult(None, info={"reason": "no_reference"})
        pred, ref = as_text(traj.completion), str(ref)
        if self.strip:
            pred, ref = pred.strip(), ref.strip()
        return _verdict(pred == ref)


@REWARDS.register("normalized")
class NormalizedMatch(Reward):
    """1 when completion and reference (or any of a list of references) agree after `normalize_text`."""

    def __init__(self, field: str | None = None):
        self.field = field

    def score(self, traj: Trajectory) -> RewardResult:
        ref = reference(traj, self.field)
        if ref is None:
            return RewardResult(None, info={"reason": "no_reference"})
        refs = [normalize_text(str(r)) for r in (ref if isinstance(ref, (list, tuple)) else [ref])]
        pred = normalize_text(as_text(traj.completion))
        if not pred:
            return RewardResult(0.0, info={"reason": "empty"})
        return _verdict(pred in refs, normalized=pred[:200])


_FLOAT = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def parse_float(s: str) -> float | None:
    """`s` as a float when it is one number (commas as thousands separators allowed)."""
    s = s.strip().strip("$").replace("{,}", "").rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if not _FLOAT.fullmatch(s):
        return None
    v = float(s)
    return v if math.isfinite(v) else None


@REWARDS.register("numeric")
class NumericMatch(Reward):
    """1 when the answer is a number within tolerance of the reference: |p − g| ≤ max(rel_tol·|g|, abs_tol).

    Args:
        rel_tol, abs_tol: tolerances (both 0: exact).
        extract: "answer" takes the boxed / "answer is" answer (strict, see rewards.math);
            "whole" needs the whole completion to be one number.
    """

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 0.0, extract: str = "answer", field: str | None = None):
        if extract not in ("answer", "whole") or rel_tol < 0 or abs_tol < 0:
            raise ValueError(f"need extract in ('answer', 'whole') and tolerances >= 0; got {extract!r}, {rel_tol}, {abs_tol}")
        self.rel_tol, self.abs_tol, self.extract, self.field = rel_tol, abs_tol, extract, field

    def score(self, traj: Trajectory) -> RewardResult:
        ref = reference(traj, self.field)
        gold = parse_float(str(ref)) if ref is not None else None
        if gold is None:
            return RewardResult(None, info={"reason": "unparseable_gold"})
        text = as_text(traj.completion)
        ans = text if self.extract == "whole" else extract_answer(text).answer
        pred = parse_float(ans) if ans is not None else None
        if pred is None:
            return RewardResult(0.0, info={"reason": "no_answer" if ans is None else "unparseable_pred"})
        return _verdict(abs(pred - gold) <= max(self.rel_tol * abs(gold), self.abs_tol), extracted=pred)


@REWARDS.register("choice")
class ChoiceMatch(Reward):
    """1 when the one letter the completion commits to is the reference letter; hedges score 0.

    The answer is the last boxed letter, else the last "answer is (C)" / "Answer: C", else a
    completion that is only the letter. Several different letters in that answer
    (`A or B`, `A, C`) score 0. A reference may be a letter or a 0-based index.
    """

    def __init__(self, letters: str = "ABCDEFGHIJ", field: str | None = None):
        self.letters, self.field = letters.upper(), field

    def _gold(self, ref: Any) -> str | None:
        if isinstance(ref, int) and 0 <= ref < len(self.letters):
            return self.letters[ref]
        s = str(ref).strip().strip("()").upper()
        return s if len(s) == 1 and s in self.letters else None

    def score(self, traj: Trajectory) -> RewardResult:
        ref = reference(traj, self.field)
        gold = self._gold(ref) if ref is not None else None
        if gold is None:
            return RewardResult(None, info={"reason": "unparseable_gold"})
        ex = extract_answer(as_text(traj.completion))
        if ex.answer is None:
            return RewardResult(0.0, info={"reason": ex.reason})
        found = set(re.findall(rf"(?<![A-Za-z])([{self.letters}{self.letters.lower()}])(?![A-Za-z])", ex.answer.replace("\\text", "")))
        found = {f.upper() for f in found}
        if len(found) != 1:
            return RewardResult(0.0, info={"reason": "no_answer" if not found else "multi_answer", "extracted": ex.answer[:50]})
        return _verdict(found == {gold}, extracted=found.pop())


_FLAGS = {"i": re.I, "m": re.M, "s": re.S, "x": re.X}


@REWARDS.register("regex")
class RegexMatch(Reward):
    """1 when `pattern` matches the completion (`mode`: "search", "match" or "fullmatch")."""

    def __init__(self, pattern: str, mode: str = "search", flags: str = ""):
        if mode not in ("search", "match", "fullmatch") or set(flags) - set(_FLAGS):
            raise ValueError(f"need mode in search/match/fullmatch and flags from 'imsx'; got {mode!r}, {flags!r}")
        re.compile(pattern)
        self.pattern, self.mode, self.flags = pattern, mode, flags

    def score(self, traj: Trajectory) -> RewardResult:
        flags = 0
        for f in self.flags:
            flags |= _FLAGS[f]
        m = getattr(re, self.mode)(self.pattern, as_text(traj.completion), flags)
        return RewardResult(float(m is not None), info={"reason": "match" if m else "no_match"})


@REWARDS.register("format")
class FormatReward(Reward):
    """1 when the completion is exactly `<tag1>…</tag1> <tag2>…</tag2>…`, each tag once, nothing outside.

    The default is the R1 format `<think>…</think><answer>…</answer>` (DeepSeek-R1,
    Guo et al. 2025). Components `has_<tag>` say which blocks were found.
    """

    def __init__(self, tags: tuple[str, ...] | list[str] = ("think", "answer"), allow_empty: bool = False):
        self.tags, self.allow_empty = tuple(tags), allow_empty

    def score(self, traj: Trajectory) -> RewardResult:
        text = as_text(traj.completion).strip()
        def body(t: str) -> str:
            free = rf"(?:(?!</{t}>).)*"
            return free if self.allow_empty else rf"{free}\S{free}"

        pattern = r"\s*".join(rf"<{t}>{body(t)}</{t}>" for t in self.tags)
        ok = re.fullmatch(pattern, text, re.S) is not None
        ok = ok and all(text.count(f"<{t}>") == 1 and text.count(f"</{t}>") == 1 for t in self.tags)
        comps = {f"has_{t}": float(f"<{t}>" in text and f"</{t}>" in text) for t in self.tags}
        return RewardResult(float(ok), components=comps, info={"reason": "ok" if ok else "bad_format"})


@REWARDS.register("json_schema")
class JsonSchemaReward(Reward):
    """1 when the completion (or its ```json block / <answer> block) is JSON valid under `schema`.

    Supports the JSON Schema keywords type, properties, required, additionalProperties,
    items, minItems, maxItems, enum, const, minimum, maximum, minLength, maxLength,
    pattern, anyOf. The schema is `schema`, or the dataset field `schema_field`.
    """

    def __init__(self, schema: dict | None = None, schema_field: str | None = None):
        if schema is None and schema_field is None:
            raise ValueError("give schema or schema_field")
        self.schema, self.schema_field = schema, schema_field

    def score(self, traj: Trajectory) -> RewardResult:
        schema = self.schema if self.schema is not None else traj.sample.fields.get(self.schema_field)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                schema = None
        if not isinstance(schema, dict):
            return RewardResult(None, info={"reason": "no_schema"})
        try:
            value = json.loads(json_payload(as_text(traj.completion)))
        except ValueError:
            return RewardResult(0.0, info={"reason": "invalid_json"})
        problem = validate(value, schema)
        return RewardResult(float(problem is None), info={"reason": "ok" if problem is None else "schema", "problem": problem})


def json_payload(text: str) -> str:
    """The JSON text: a fenced ```json block, else an <answer> block, else the whole text."""
    m = re.search(r"```(?:json)?\s*(.*?)```", text, re.S)
    if m:
        return m.group(1)
    m = re.search(r"<answer>(.*?)</answer>", text, re.S)
    return m.group(1) if m else text


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is_type(v: Any, t: str) -> bool:
    if t == "integer":
        return isinstance(v, int) and not isinstance(v, bool)
    if t == "number":
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return isinstance(v, _TYPES.get(t, ()))


def validate(v: Any, s: dict, path: str = "$") -> str | None:
    """The first problem of `v` under the JSON-Schema subset above, or None when valid."""
    t = s.get("type")
    if t is not None and not any(_is_type(v, x) for x in (t if isinstance(t, list) else [t])):
        return f"{path}: expected {t}"
    if "enum" in s and v not in s["enum"]:
        return f"{path}: not in enum"
    if "const" in s and v != s["const"]:
        return f"{path}: not const"
    if "anyOf" in s and all(validate(v, sub, path) for sub in s["anyOf"]):
        return f"{path}: matches no anyOf"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if "minimum" in s and v < s["minimum"] or "maximum" in s and v > s["maximum"]:
            return f"{path}: out of range"
    if isinstance(v, str):
        if len(v) < s.get("minLength", 0) or len(v) > s.get("maxLength", math.inf):
            return f"{path}: bad length"
        if "pattern" in s and not re.search(s["pattern"], v):
            return f"{path}: pattern"
    if isinstance(v, list):
        if len(v) < s.get("minItems", 0) or len(v) > s.get("maxItems", math.inf):
            return f"{path}: bad item count"
        for i, x in enumerate(v):
            if "items" in s and (p := validate(x, s["items"], f"{path}[{i}]")):
                return p
    if isinstance(v, dict):
        for k in s.get("required", []):
            if k not in v:
                return f"{path}: missing {k}"
        props = s.get("properties", {})
        for k, x in v.items():
            if k in props:
                if p := validate(x, props[k], f"{path}.{k}"):
                    return p
            elif s.get("additionalProperties", True) is False:
                return f"{path}: unexpected {k}"
    return None


@REWARDS.register("length")
class LengthBounds(Reward):
    """1 when the completion's length is within [min_len, max_len] (unit: chars, words or tokens)."""

    verdict = False  # says nothing about correctness: held-out accuracy is checked by the task's verifier

    def __init__(self, min_len: int = 0, max_len: int | None = None, unit: str = "chars"):
        if unit not in ("chars", "words", "tokens"):
            raise ValueError(f"unit must be chars, words or tokens; got {unit!r}")
        self.min_len, self.max_len, self.unit = min_len, max_len, unit

    def score(self, traj: Trajectory) -> RewardResult:
        n = completion_length(traj, self.unit)
        ok = n >= self.min_len and (self.max_len is None or n <= self.max_len)
        return RewardResult(float(ok), info={"reason": "ok" if ok else "out_of_bounds", "length": n})


def completion_length(traj: Trajectory, unit: str = "tokens") -> int:
    """Length of the completion in tokens (falling back to chars without ids), words or chars."""
    text = as_text(traj.completion)
    if unit == "tokens" and traj.completion_ids:
        return len(traj.completion_ids)
    if unit == "words":
        return len(text.split())
    return len(text)
