"""Math answer verification: our strict extraction and policy, math-verify's equivalence.

Extraction is ours, equivalence is math-verify's (verifiers.md §3.4). The steps:

1. Find the answer: the last brace-balanced `\\boxed{…}` / `\\fbox{…}` after the last
   `</think>`; with `no_box="anchored"` (default) a completion without a box may state its
   answer as "the answer is …" / "Answer: …" (never "any number in the text",
   verifiers PR #1028), or be nothing but the answer.
2. Refuse what a grader must not reward: several different boxes joined as a list
   (`\\boxed{1} and \\boxed{234}`), hedges (`2 or 3`, `\\pm` when the gold has none,
   a comma list for a scalar gold, `\\boxed{5} or 6`, `…, or possibly 6`). A correction
   after the answer replaces it (`\\boxed{166}. Actually no, it is 167.` answers 167), as
   does a later box after prose (`first guess \\boxed{4}; final answer: \\boxed{3}`).
3. Decide: plain numbers are compared exactly as rationals (integers never with a
   tolerance; a decimal gold must be matched digit for digit, so `0.1234568` is not
   `0.1234567`; `%` forms only when one side writes `%`); everything else goes to
   math-verify with relations allowed against interval golds, and an equivalence of two
   exact constants is re-checked at 60 digits (math-verify calls `1/2^{99}` and
   `1/2^{98}` equal). Sets never match intervals or tuples. Exponent towers and huge
   exponents are refused before sympy sees them.

An unparseable gold scores None (left out of baselines, counted), never 0 or 1.

    >>> from assay.types import Sample, Trajectory
    >>> t = lambda c, a: Trajectory(Sample("0", "", a), c, [], [], [], True)
    >>> m = MathReward()
    >>> [m.score(t(c, "2")).score for c in [r"so \\boxed{2}", r"\\boxed{2} or \\boxed{3}", "The answer is 2 or 3."]]
    [1.0, 0.0, 0.0]
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from assay.rewards.base import REWARDS, Reward
from assay.types import RewardResult, Trajectory

# ---------------------------------------------------------------------------- extraction

_BOX_CMDS = ("\\boxed", "\\fbox")
_CONNECTOR = re.compile(r"^(?:[\s$,;.:&]|\\[,;:!]|\\q?quad|\\text\{\s*(?:and|or|,)?\s*\}|\\\]|\\\[|\\\)|\\\(|and|or)*$")
_HEDGE_CUE = re.compile(r"\b(?:or|also|alternatively|possibly|either|maybe|perhaps|might|could be|another)\b", re.I)
_CORRECTION_CUE = re.compile(
    r"\bno,|\b(?:wait|actually|mistake|wrong|incorrect|correct(?:ion|ed)?|final|instead|rather|oops|sorry|scratch that|"
    r"i mean|re-?check|fix|error|recompute|recalculate|redo)\b",
    re.I,
)
_VALUE = r"(-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\\d?frac\{[^{}]*\}\{[^{}]*\})"
_TAIL_HEDGE = re.compile(r"\bor (?:possibly|maybe|perhaps)\b|\balternatively\b|\bcould also be\b|\bmight be\b", re.I)
_STRONG_FIX = re.compile(r"\bno,|\b(?:wait|actually|mistake|wrong|incorrect|oops|sorry|scratch that|i mean|instead|correction)\b", re.I)
_VALUE_END = r"\s*\$*\s*(?=[.!,;]|$|\s)"
_FIX_CLAIM = re.compile(
    r"(?:\b(?:answer|it|result|value|that|this)\s+(?:is|should be|must be|would be)\s+(?:actually\s+)?|\bit's\s+|\bno\b,?\s*|"
    r"\bwait\b,?\s*|\bactually\b,?\s*|\binstead\b,?\s*|\bmeant\s+)\$*\s*" + _VALUE + _VALUE_END,
    re.I,
)
_HEDGE_CLAIM = re.compile(r"(?:\bor\b|\bpossibly|\bmaybe|\bperhaps|\bbe)\s*\$*\s*" + _VALUE + _VALUE_END, re.I)
_ANCHOR = re.compile(r"(?:final answer|the answer|answer)\s*(?:is|:|=)?\s*[:=]?\s*(?:\*\*)?\s*(?::\s*)?|^####\s*", re.I | re.M)
_BARE = re.compile(r"^\$*\s*([^$\n]{1,40}?)\s*\$*\.?$")
_WORD = re.compile(r"(?<!\\)\b[A-Za-z]{3,}\b")


def find_boxes(text: str) -> list[tuple[int, int, str]]:
    """Every `\\boxed{…}` / `\\fbox{…}` as `(start, end, content)`, braces balanced, `\\{` skipped."""
    out, i = [], 0
    while True:
        hits = [(text.find(c, i), c) for c in _BOX_CMDS]
        hits = [(p, c) for p, c in hits if p >= 0]
        if not hits:
            return out
        start, cmd = min(hits)
        j = start + len(cmd)
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _matching_brace(text, j)
            if end < 0:
                return out  # unbalanced: nothing after it can be trusted
            out.append((start, end + 1, text[j + 1 : end]))
            i = end + 1
        elif j > start + len(cmd):  # `\boxed 5`
            m = re.match(r"[^\s$]+", text[j:])
            if m:
                out.append((start, j + m.end(), m.group(0)))
            i = j + (m.end() if m else 0)
        else:
            i = j


def _matching_brace(text: str, open_at: int) -> int:
    """Index of the `}` closing the `{` at `open_at`, or -1."""
    depth, k = 0, open_at
    while k < len(text):
        ch = text[k]
        if ch == "\\":
            k += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return k
        k += 1
    return -1


@dataclass
class Extraction:
    """What `extract_answer` found: the answer text (or None) and a reason code."""

    answer: str | None
    reason: str
    end: int = 0
    joined: list[str] | None = None


def extract_answer(text: str, no_box: str = "anchored", delimiter: str | None = "</think>") -> Extraction:
    """The final answer of a completion under the strict rules in the module docstring."""
    if delimiter and delimiter in text:
        text = text[text.rindex(delimiter) + len(delimiter) :]
    boxes = find_boxes(text)
    if boxes:
        return _from_boxes(text, boxes)
    if no_box == "zero":
        return Extraction(None, "no_box")
    return _from_anchor(text)


def _from_boxes(text: str, boxes: list[tuple[int, int, str]]) -> Extraction:
    last = boxes[-1]
    cluster = [last]
    for prev in reversed(boxes[:-1]):
        if not _CONNECTOR.match(text[prev[1] : cluster[0][0]]):
            break
        cluster.insert(0, prev)
    values = [_norm(b[2]) for b in cluster]
    if len(set(values)) > 1:
        return Extraction(None, "multi_answer", last[1], joined=[b[2] for b in cluster])
    # an earlier, different box separated by prose: a hedge ("or maybe") fails, a correction wins
    for prev in reversed(boxes[: len(boxes) - len(cluster)]):
        if _norm(prev[2]) != values[0]:
            gap = text[prev[1] : cluster[0][0]]
            if _HEDGE_CUE.search(gap) and not _CORRECTION_CUE.search(gap):
                return Extraction(None, "hedged", last[1])
            break
    return Extraction(last[2], "boxed", last[1])


def _from_anchor(text: str) -> Extraction:
    bare = _BARE.match(text.strip())
    if bare and not _WORD.search(bare.group(1)):
        return Extraction(bare.group(1), "bare", len(text))
    matches = list(_ANCHOR.finditer(text))
    for m in reversed(matches):
        span = _claim_span(text, m.end())
        if span:
            return Extraction(span[0], "anchored", span[1])
    return Extraction(None, "no_answer")


def _claim_span(text: str, i: int) -> tuple[str, int] | None:
    """The math after an "answer is": `$…$`, `\\(…\\)`, `\\[…\\]` or plain text to the sentence end."""
    rest = text[i : i + 2000]
    for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if rest.startswith(open_):
            k = rest.find(close, len(open_))
            while close == "$" and k > 0 and rest[k - 1] == "\\":  # `\$` is a dollar sign, not a delimiter
                k = rest.find(close, k + 1)
            if k > len(open_):
                return rest[len(open_) : k], i + k + len(close)
            return None
    m = re.match(r"(.+?)(?:\.(?=\s|$)|\n|$)", rest)
    if not m or not m.group(1).strip():
        return None
    span = m.group(1).strip().rstrip(".")
    if _WORD.search(span):  # prose: "the number of ways, which is 10" -> 10
        tail = re.search(r"(?:\bis|=|\bequals|\bbe)\s*\$*\s*" + _VALUE + r"\s*\$*$", span)
        if tail and not _HEDGE_IN.search(span):
            span = tail.group(1)
    return span, i + m.end()


_LIST_TAIL = re.compile(r"^\s*\$*\s*(?:,|and\b|or\b|\\text\{\s*(?:and|or)\s*\})\s*\$*\s*" + _VALUE, re.I)


def _same(a: str, b: str) -> bool:
    a, b = _norm(a), _norm(b)
    na, nb = _number(a), _number(b)
    return a == b or (na is not None and nb is not None and na[0] == nb[0])


def after_answer(text: str, end: int, answer: str) -> tuple[str, str | None]:
    """What the text after the answer does to it: `("kept", None)`, `("hedged", None)` or `("corrected", value)`.

    A list continuation (`$5$ and $6$`, `\\boxed{5} or 6`) or a hedge cue followed by a
    different value (`, or possibly 6`) hedges; a correction cue whose last stated value
    differs (`Actually no, it is 167.`) corrects the answer to that value.
    """
    tail = text[end : end + 4000]
    if _LIST_TAIL.match(tail):
        return "hedged", None
    hedge, fix = _TAIL_HEDGE.search(tail), _STRONG_FIX.search(tail)
    if hedge and (not fix or hedge.start() < fix.start()):
        claims = [m.group(1) for m in _HEDGE_CLAIM.finditer(tail, hedge.start())]
        return ("hedged", None) if any(not _same(c, answer) for c in claims) else ("kept", None)
    if fix:
        claims = [m.group(1) for m in _FIX_CLAIM.finditer(tail, fix.start())]
        if claims and not _same(claims[-1], answer):
            return "corrected", claims[-1]
    return "kept", None


# ------------------------------------------------------------------------- normalisation

_UNITS = (
    "cm|mm|km|m|kg|g|mg|s|sec|seconds|minutes|min|hours|hr|h|days|units|unit|degrees|degree|dollars|dollar|cents|"
    "inches|inch|in|feet|ft|foot|meters|metres|miles|mph|square|sq|cubic|liters|litres|l|ml|years|people|students"
)
_UNIT_TAIL = re.compile(rf"^(.*?\d)\s*(?:\\text\{{\s*)?(?:{_UNITS})(?:\^?\{{?[23]\}}?)?\}}?$")
_STRIP = [
    (re.compile(r"\\(?:left|right|displaystyle|!|,|;|:| )"), ""),
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\^\s*\{?\\circ\}?|°"), ""),
    (re.compile(r"\\\$|\$"), ""),
    (re.compile(r"\*\*"), ""),
    (re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"(\d)\{,\}(\d)"), r"\1\2"),
    (re.compile(r"\s+"), ""),
]


_UNICODE = str.maketrans({"−": "-", "–": "-", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ", "π": "\\pi ", "∞": "\\infty ",
                          "≤": "\\le ", "≥": "\\ge ", "√": "\\sqrt", "±": "\\pm ", "∪": "\\cup ", "∈": "\\in "})


def unicode_to_latex(s: str) -> str:
    """Unicode maths (−, ×, π, √, ≤, ±, …) as the LaTeX math-verify reads."""
    return s.translate(_UNICODE)


def _norm(s: str) -> str:
    """Cosmetic normal form used for string comparison and numbers (not for sympy)."""
    s = s.strip()
    for pat, rep in _STRIP:
        s = pat.sub(rep, s)
    s = s.rstrip(".")
    if re.fullmatch(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?|[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?\\%", s):
        s = s.replace(",", "")
    return s


def _strip_units(s: str) -> str:
    m = _UNIT_TAIL.match(s)
    return m.group(1) if m else s


_NUM = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?)\\frac(\d)(\d)")


def _number(s: str) -> tuple[Fraction, str, bool] | None:
    """`(value, kind, percent)` for a plain number: int, decimal, a/b or `\\frac{a}{b}`."""
    s = _strip_units(s)
    percent = s.endswith("\\%") or s.endswith("%")
    if percent:
        s = s[:-2] if s.endswith("\\%") else s[:-1]
    if re.fullmatch(r"[+-]?\d+", s):
        return Fraction(int(s)), "int", percent
    if re.fullmatch(r"[+-]?(?:\d+\.\d*|\.\d+)", s):
        return Fraction(s), "dec", percent
    m = re.fullmatch(r"([+-]?\d+)/([+-]?\d+)", s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2))), "frac", percent
    m = _FRAC.fullmatch(s)
    if m:
        sign, a, b = (m.group(1), m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5), m.group(6))
        if int(b) != 0:
            v = Fraction(int(a), int(b))
            return (-v if sign == "-" else v), "frac", percent
    return None


def _decimals(s: str) -> int:
    m = re.search(r"\.(\d+)", s)
    return len(m.group(1)) if m else 0


def numbers_match(pred: str, gold: str, min_sig_digits: int = 3) -> bool | None:
    """Exact comparison of two plain numbers (None when either is not a plain number).

    Integers and decimals must be equal as rationals; `%` on either side also allows the
    value /100 (gold `82\\%` accepts `82` and `0.82`, never `8200`); a decimal prediction of
    a non-terminating rational gold (`1/3`) counts when it is the gold correctly rounded
    to the prediction's digits, with at least `min_sig_digits` significant digits.
    """
    p, g = _number(pred), _number(gold)
    if p is None or g is None:
        return None
    pv = {p[0], p[0] / 100} if p[2] else {p[0]}
    gv = {g[0], g[0] / 100} if g[2] else {g[0]}
    if pv & gv:
        return True
    if p[1] == "dec" and g[1] == "frac" and not _terminates(g[0]):
        d = _decimals(pred)
        sig = len(re.sub(r"^[+-]?0*\.?0*", "", re.sub(r"[^\d.+-]", "", pred)).replace(".", ""))
        return sig >= min_sig_digits and any(round(x, d) == p[0] for x in gv)
    return False


def _terminates(q: Fraction) -> bool:
    d = q.denominator
    for f in (2, 5):
        while d % f == 0:
            d //= f
    return d == 1


# -------------------------------------------------------------------------------- shapes

_TOWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\^\s*\{[^{}]*\{[^{}]*\^")
_BIG_EXP = re.compile(r"\^\s*\{?\s*[+-]?\d{5,}|\d{5,}\s*!|\*\*\s*\d{5,}|\\uparrow|\\underbrace")


def too_complex(s: str, max_len: int = 400) -> str | None:
    """A reason to refuse `s` before sympy: too long, an exponent tower, a huge power."""
    if len(s) > max_len:
        return "too_long"
    if _TOWER.search(s) or _BIG_EXP.search(s) or s.count("{") > 60:
        return "too_complex"
    return None


def _top_level_commas(s: str) -> int:
    depth, n, k = 0, 0, 0
    while k < len(s):
        ch = s[k]
        if ch == "\\" and k + 1 < len(s) and s[k + 1] in "{}":
            depth += 1 if s[k + 1] == "{" else -1
            k += 2
            continue
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            n += 1
        k += 1
    return n


def shape(s: str) -> str:
    """Syntactic kind of an answer: set, interval, tuple, list, relation, matrix or scalar."""
    s = s.strip()
    if "\\begin{" in s:
        return "matrix"
    if s.startswith("\\{") and s.endswith("\\}"):
        return "set"
    if "\\cup" in s or "\\infty" in s or (s[:1] in "([" and s[-1:] in ")]" and s[:1] + s[-1:] in ("(]", "[)", "[]")):
        return "interval"
    if s[:1] == "(" and s[-1:] == ")" and _top_level_commas(s[1:-1]) >= 1:
        return "tuple"
    if re.search(r"<|>|\\le|\\ge|\\lt|\\gt|\\in\b", s):
        return "relation"
    if _top_level_commas(s) >= 1:
        return "list"
    return "scalar"


_OR_SPLIT = re.compile(r"\\text\{\s*or\s*\}|\\lor|\\vee|\bor\b|\\cup")
_HEDGE_IN = re.compile(
    r"\bor\b|\\lor|\\text\{\s*or\s*\}|\beither\b|\bmaybe\b|\?|\bbetween\s+\$?-?\d|\d\$?\s+to\s+\$?-?\d|\bnot\b|\bnever\b|\bno\b|\bprobably\b|"
    r"\blikely\b|\bapproximately\b|\babout\b|\baround\b|\broughly\b|\bguess\b|\\approx|\\neq",
    re.I,
)


def hedge_reason(pred: str, gold: str) -> str | None:
    """A reason when `pred` hedges relative to `gold` (or / ± / a list for a scalar)."""
    multi = shape(_norm(gold)) in ("list", "set", "interval", "relation")  # "x = 2 or x = 3", "x < -2 or x > 3"
    if _HEDGE_IN.search(pred) and not _HEDGE_IN.search(gold) and not multi:
        return "hedged"
    if re.search(r"\\pm|\\mp|±", pred) and not re.search(r"\\pm|\\mp|±", gold):
        return "hedged"
    if re.search(r"\band\b", pred) and not re.search(r"\band\b|,", gold) and not multi:
        return "hedged"
    ps, gs = shape(_norm(pred)), shape(_norm(gold))
    if ps == "list" and gs == "scalar":
        return "multi_answer"
    if (ps == "set") != (gs == "set") and {ps, gs} & {"interval", "tuple"}:
        return "type_mismatch"
    return None


def _drop_lhs(pred: str, gold: str) -> str:
    """`x = 5` → `5` when the gold is not itself an equation."""
    if "=" in gold or re.search(r"\\[lg]e|<|>", pred):
        return pred
    m = re.fullmatch(r"\s*(?:[A-Za-z]|\\[a-zA-Z]+|[A-Za-z]_\{?\w+\}?|\\text\{[^{}]*\})\s*=\s*(.+)", pred, re.S)
    return m.group(1) if m else pred


# ------------------------------------------------------------------------------ the reward

@dataclass
class Gold:
    """A reference answer, parsed once: its text, normal form, number and sympy parse."""

    text: str
    norm: str
    parsed: list | None = None


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@REWARDS.register("math")
class MathReward(Reward):
    """1 when the final answer equals the reference (strict extraction + math-verify), else 0.

    Args:
        no_box: "anchored" lets a completion with no box answer with "the answer is …",
            "Answer: …" or nothing but the answer; "zero" scores every unboxed completion 0.
        delimiter: only text after the last one counts (None: the whole completion).
        timeout: seconds for each math-verify parse/verify (main thread only; the executor
            adds a hard outer deadline).
        min_sig_digits: significant digits a decimal needs to stand for a non-terminating
            rational reference.
        cache_size: parsed references kept per process.
    """

    #: modules a forkserver imports once for every worker
    preload = ("math_verify",)

    def __init__(self, no_box: str = "anchored", delimiter: str | None = "</think>", timeout: int = 2, min_sig_digits: int = 3, cache_size: int = 10_000):
        if no_box not in ("anchored", "zero"):
            raise ValueError(f"no_box must be 'anchored' or 'zero', got {no_box!r}")
        self.no_box, self.delimiter, self.timeout = no_box, delimiter, int(timeout)
        self.min_sig_digits, self.cache_size = min_sig_digits, cache_size
        self._golds: dict[str, Gold | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_golds": {}}

    def gold(self, answer: Any) -> Gold | None:
        """The parsed reference (cached per process); None when it cannot be parsed."""
        key = str(answer)
        if key not in self._golds:
            if len(self._golds) >= self.cache_size:
                self._golds.pop(next(iter(self._golds)))
            self._golds[key] = self._parse_gold(key)
        return self._golds[key]

    def _parse_gold(self, text: str) -> Gold | None:
        boxes = find_boxes(text)
        text = unicode_to_latex(boxes[-1][2] if boxes else text).strip()
        if not text:
            return None
        g = Gold(text, _norm(text))
        if _number(g.norm) is None:
            g.parsed = self._mv_parse(text)
            if not g.parsed:
                return None
        return g

    def _timeouts(self) -> int | None:
        return self.timeout if _on_main_thread() else None

    def _mv_parse(self, s: str) -> list:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

        if too_complex(s, 2000):
            return []
        cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
        out = parse(f"${s}$", extraction_config=cfg, parsing_timeout=self._timeouts())
        return [x for x in out if not isinstance(x, str)]

    def score(self, traj: Trajectory) -> RewardResult:
        gold = self.gold(traj.sample.answer) if traj.sample.answer is not None else None
        if gold is None:
            return RewardResult(None, info={"reason": "unparseable_gold"})
        text = as_text(traj.completion)
        ex = extract_answer(text, self.no_box, self.delimiter)
        if ex.reason == "multi_answer" and ex.joined and shape(gold.text) in ("list", "set", "tuple"):
            ex = Extraction(", ".join(ex.joined), "boxed", ex.end)
        if ex.answer is None:
            return RewardResult(0.0, info={"reason": ex.reason})
        then, value = after_answer(text, ex.end, ex.answer)
        if then == "hedged":
            return RewardResult(0.0, components={"correct": 0.0}, info={"reason": "hedged", "extracted": ex.answer[:200], "found_by": ex.reason})
        found_by = ex.reason
        if then == "corrected":
            ex, found_by = Extraction(value, "corrected", ex.end), "corrected"
        verdict, path = self.judge(ex.answer, gold)
        info = {"reason": verdict, "extracted": ex.answer[:200], "path": path, "found_by": found_by}
        return RewardResult(1.0 if verdict == "correct" else 0.0, components={"correct": float(verdict == "correct")}, info=info)

    def judge(self, answer: str, gold: Gold) -> tuple[str, str]:
        """`(verdict, path)`: verdict is "correct" or a reason code; path says who decided."""
        pred = _drop_lhs(unicode_to_latex(answer).strip(), gold.text)
        reason = hedge_reason(pred, gold.text)
        if reason:
            return reason, "policy"
        pn = _norm(pred)
        if pn == gold.norm:
            return "correct", "string"
        exact = numbers_match(pn, gold.norm, self.min_sig_digits)
        if exact is not None:
            return ("correct" if exact else "wrong"), "exact"
        reason = too_complex(pn)
        if reason:
            return reason, "policy"
        if gold.parsed is None:
            gold.parsed = self._mv_parse(gold.text)
        if shape(_norm(gold.text)) == "interval" and _OR_SPLIT.search(pred) and shape(_norm(pred)) == "relation":
            as_set = self._relations_as_set(pred)
            if as_set is not None:
                return ("correct" if gold.parsed and as_set == gold.parsed[0] else "wrong"), "relations"
        parsed = self._mv_parse(pred)
        if not parsed:
            return "unparseable_pred", "math_verify"
        return ("correct" if self._equivalent(gold, parsed) else "wrong"), "math_verify"

    def _relations_as_set(self, pred: str) -> Any:
        """`x < -2 or x > 3` as the sympy set it describes (None when a part is no relation in one variable)."""
        import sympy

        out, symbols = sympy.EmptySet, set()
        for part in _OR_SPLIT.split(pred):
            parsed = self._mv_parse(part.strip().strip("()"))
            rel = parsed[0] if parsed else None
            if not isinstance(rel, (sympy.core.relational.Relational, sympy.And)) or len(rel.free_symbols) != 1:
                return None
            symbols |= rel.free_symbols
            out = sympy.Union(out, rel.as_set())
        return out if len(symbols) == 1 else None

    def _equivalent(self, gold: Gold, parsed: list) -> bool:
        from math_verify import verify

        relations = shape(gold.text) in ("interval", "relation")
        if not verify(gold.parsed, parsed, allow_set_relation_comp=relations, timeout_seconds=self._timeouts()):
            return False
        return exact_recheck(gold.parsed[0], parsed[0])


def exact_recheck(a: Any, b: Any) -> bool:
    """False when two exact constants that math-verify called equal differ at 60 digits."""
    import sympy

    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return True
    if not (a.is_number and b.is_number) or a.has(sympy.Float) or b.has(sympy.Float):
        return True
    try:
        diff = abs(sympy.N(a - b, 60))
        scale = max(abs(sympy.N(a, 60)), abs(sympy.N(b, 60)))
        return bool(diff == 0 or diff <= scale * sympy.Rational(1, 10**40))
    except (TypeError, ValueError, ArithmeticError):
        return True


def as_text(x: Any) -> str:
    """A completion as text: bytes are decoded with replacement, None is empty."""
    if x is None:
        return ""
    if isinstance(x, bytes):
        return x.decode("utf-8", errors="replace")
    return str(x)
