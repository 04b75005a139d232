"""`MathReward`: the reference parsed once into its parts, the extracted answer judged against it."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

from assay.rewards.base import REWARDS, Reward
from assay.rewards.math.extract import Extraction, after_answer, extract_answer, reference_boxes, think_tags, undouble_backslashes
from assay.rewards.math.numbers import clean, norm, number, numbers_match, same_value
from assay.rewards.math.parts import MAX_PARTS, distinct, drop_lhs, expand_pm, interval_pieces, label, match_parts, peel, split_answer, value_of
from assay.rewards.math.policy import hedge_reason, too_complex
from assay.types import RewardResult, Trajectory

_OR_SPLIT = re.compile(r"\\text\{\s*or\s*\}|\\lor|\\vee|\bor\b|\\cup")
_SET_KINDS = ("list", "set")
#: kinds of prediction each kind of several-part reference can be compared with
_COMPATIBLE = {"list": ("list", "set", "scalar"), "set": ("list", "set", "scalar"), "tuple": ("tuple", "list", "scalar")}


@dataclass
class Gold:
    """A reference answer, parsed once: its text, normal form, kind, parts and sympy parse.

    A reference with several parts (`multi`) holds one `Gold` per distinct part; a
    labelled one (`a = 2, b = 3`) keeps its names in order in `labels`.
    """

    text: str
    norm: str
    kind: str = "scalar"
    parts: list[Gold] = field(default_factory=list)
    labels: list[str] | None = None
    parsed: list | None = None

    @property
    def multi(self) -> bool:
        return len(self.parts) > 1


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@REWARDS.register("math")
class MathReward(Reward):
    """1 when the final answer equals the reference (strict extraction + math-verify), else 0.

    Args:
        no_box: "anchored" lets a completion with no box answer with "the answer is …",
            "Answer: …" or nothing but the answer; "zero" scores every unboxed completion 0.
        thinking: thinking sections never count: "standard" reads every tag family in
            `THINK_TAGS`, "none" reads the whole completion, or a list of [open, close] pairs.
        timeout: seconds for each math-verify parse/verify (main thread only; the executor
            adds a hard outer deadline).
        min_sig_digits: significant digits a decimal needs to stand for a non-terminating
            rational reference.
        cache_size: parsed references kept per process.
    """

    #: modules a forkserver imports once for every worker
    preload = ("math_verify",)

    def __init__(self, no_box: str = "anchored", thinking: str | list = "standard", timeout: int = 2, min_sig_digits: int = 3, cache_size: int = 10_000):
        if no_box not in ("anchored", "zero"):
            raise ValueError(f"no_box must be 'anchored' or 'zero', got {no_box!r}")
        self._tags = think_tags(thinking)
        self.no_box, self.thinking, self.timeout = no_box, thinking, int(timeout)
        self.min_sig_digits, self.cache_size = min_sig_digits, cache_size
        self._golds: dict[str, Gold | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_golds": {}}

    # ------------------------------------------------------------------------ reference

    def gold(self, answer: Any) -> Gold | None:
        """The parsed reference (cached per process); None when it cannot be parsed."""
        key = str(answer)
        if key not in self._golds:
            if len(self._golds) >= self.cache_size:
                self._golds.pop(next(iter(self._golds)))
            self._golds[key] = self._parse_gold(key)
        return self._golds[key]

    def _parse_gold(self, text: str) -> Gold | None:
        """Several boxes in a reference are one answer with several parts (`\\boxed{1}` and `\\boxed{-2}`); a reference
        with every backslash doubled, or with its last box left open, is read as its author meant (`reference_boxes`)."""
        text = undouble_backslashes(text)
        found = reference_boxes(text)
        if found is None:
            return None
        boxes = [peel(clean(b[2])) for b in found]
        texts = [t for t in boxes if t] if boxes else [peel(clean(text))]
        if not texts:
            return None
        if len(texts) == 1:
            return self._parse_part(texts[0])
        parts = []
        for t in texts:
            kind, inner = split_answer(t)
            parts += inner if kind == "list" else [t]
        return self._parse_part(", ".join(parts))

    def _parse_part(self, text: str, depth: int = 0) -> Gold | None:
        text = value_of(text)  # (p, q) = (3, 2) is the pair (3, 2)
        kind, parts = split_answer(text)
        if kind in _SET_KINDS or (kind == "scalar" and len(expand_pm(parts)) == 2):
            parts, kind = expand_pm(parts), ("list" if kind == "scalar" else kind)
        labels = None
        if kind in ("list", "tuple") and len(parts) > 1:
            named = [label(p) for p in parts]
            names = [n for n, _ in named]
            if all(names) and len(set(names)) == 1:  # x = 2, x = 3: the solutions of x
                parts = [v for _, v in named]
            elif all(names) and len(set(names)) == len(names):  # a = 2, b = 3: in this order
                kind, labels, parts = "tuple", names, [v for _, v in named]
        parts = distinct(parts) if kind in _SET_KINDS else parts
        if len(parts) > MAX_PARTS:
            return None  # no prediction could be scored against it
        if kind in ("list", "set", "tuple") and len(parts) > 1 and depth < 3:
            sub = [self._parse_part(p, depth + 1) for p in parts]
            if any(s is None for s in sub):
                return None
            return Gold(text, norm(text), kind, sub, labels)  # type: ignore[arg-type]
        if kind == "list":  # `2, 2` is 2
            text = parts[0]
        if not text:
            return None
        g = Gold(text, norm(text), split_answer(text)[0])
        if number(g.norm) is None:
            g.parsed = self._mv_parse(text)
            if not g.parsed:
                return None
        return g

    # ------------------------------------------------------------------------ math-verify

    def _timeouts(self) -> int | None:
        return self.timeout if _on_main_thread() else None

    def _mv_parse(self, s: str) -> list:
        """math-verify's parse of one answer: its LaTeX parser, else its expression parser when that reads all of `s`.

        The expression parser alone reads a fragment of what it cannot parse (`2*x + 1`
        as 1, `1 + \\frac{1}{\\mathrm{e}}` as 1), which would pay a wrong answer.
        """
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

        if too_complex(s, 2000):
            return []
        found = [x for x in parse(f"${s}$", extraction_config=[LatexExtractionConfig()], parsing_timeout=self._timeouts()) if not isinstance(x, str)]
        if found:
            return found
        out = parse(s, extraction_config=[ExprExtractionConfig()], parsing_timeout=self._timeouts())
        whole = len(out) == 2 and isinstance(out[1], str) and re.sub(r"\s", "", out[1]) == re.sub(r"\s", "", s)
        return [out[0]] if whole and not isinstance(out[0], str) else []

    def _equivalent(self, gold: Gold, parsed: list) -> bool:
        from math_verify import verify

        relations = gold.kind in ("interval", "relation", "tuple")
        if not verify(gold.parsed, parsed, allow_set_relation_comp=relations, timeout_seconds=self._timeouts()):
            return False
        return exact_recheck(gold.parsed[0], parsed[0])

    # ------------------------------------------------------------------------ scoring

    def score(self, traj: Trajectory) -> RewardResult:
        gold = self.gold(traj.sample.answer) if traj.sample.answer is not None else None
        if gold is None:
            return RewardResult(None, info={"reason": "unparseable_gold"})
        ex = extract_answer(as_text(traj.completion), self.no_box, self._tags)
        if ex.reason == "multi_answer" and ex.joined and gold.multi:
            ex.answer, ex.reason = ", ".join(ex.joined), "boxed"
        if ex.answer is None:
            return RewardResult(0.0, info={"reason": ex.reason})
        answer, found_by = self._revise(ex, gold)
        if answer is None:
            return RewardResult(0.0, components={"correct": 0.0}, info={"reason": "hedged", "extracted": ex.answer[:200], "found_by": found_by})
        verdict, path = self.judge(answer, gold)
        info = {"reason": verdict, "extracted": answer[:200], "path": path, "found_by": found_by}
        return RewardResult(1.0 if verdict == "correct" else 0.0, components={"correct": float(verdict == "correct")}, info=info)

    def _revise(self, ex: Extraction, gold: Gold) -> tuple[str | None, str]:
        """The answer after what follows it in the response: kept, extended as a list, corrected, or None (hedged)."""
        assert ex.answer is not None
        then, value = after_answer(ex)
        if then == "list":
            return (", ".join([ex.answer, *value]), ex.reason) if gold.multi else (None, ex.reason)  # type: ignore[list-item]
        if then == "hedged":
            return None, ex.reason
        if then == "corrected":
            return str(value), "corrected"
        return ex.answer, ex.reason

    def judge(self, answer: str, gold: Gold) -> tuple[str, str]:
        """`(verdict, path)`: verdict is "correct" or a reason code; path says who decided."""
        if len(answer) > 2000:
            return "too_long", "policy"
        pred = drop_lhs(peel(clean(answer)), gold.text)
        reason = hedge_reason(pred, gold.text, gold.multi, gold.kind in ("interval", "relation"))
        if reason:
            return reason, "policy"
        return self._judge_value(pred, gold)

    def _judge_value(self, pred: str, gold: Gold) -> tuple[str, str]:
        if gold.multi:
            return self._judge_parts(pred, gold)
        kind, parts = split_answer(pred)
        if kind in ("list", "set", "tuple") and len(distinct(parts)) > 1:
            if gold.kind in ("interval", "relation") and kind == "tuple":
                return self._judge_one(pred, gold)  # (2, 3) is also an open interval
            return ("type_mismatch" if gold.kind in ("interval", "relation") else "multi_answer"), "policy"
        if {kind, gold.kind} == {"set", "interval"}:
            return "type_mismatch", "policy"
        return self._judge_one(pred, gold)

    def _judge_parts(self, pred: str, gold: Gold) -> tuple[str, str]:
        """A reference with several parts: the prediction's parts must be the same, in order for a tuple."""
        kind, parts = split_answer(pred)
        if gold.kind == "tuple" and kind == "relation" and len(gold.parts) == 2:
            return self._judge_one(pred, gold)  # `2 < x < 3` for the open interval (2, 3)
        if kind not in _COMPATIBLE[gold.kind]:
            return "type_mismatch", "policy"
        if gold.kind in _SET_KINDS:
            parts = distinct(expand_pm(parts))
        if len(parts) > MAX_PARTS:
            return "too_complex", "policy"
        if gold.labels:
            named = [label(p) for p in parts]
            if all(n for n, _ in named):
                values = dict(named)
                if len(values) != len(named) or set(values) != set(gold.labels):
                    return "wrong", "parts"
                parts = [values[n] for n in gold.labels]
        same = lambda p, g: self._judge_value(drop_lhs(p, g.text), g)[0] == "correct"  # noqa: E731
        cheap = lambda p, g: norm(drop_lhs(p, g.text)) == g.norm  # noqa: E731
        return ("correct" if match_parts(parts, gold.parts, same, gold.kind == "tuple", cheap) else "wrong"), "parts"

    def _judge_one(self, pred: str, gold: Gold) -> tuple[str, str]:
        """One value against one value: string, exact number, then math-verify."""
        pn = norm(pred)
        if pn == gold.norm:
            return "correct", "string"
        exact = numbers_match(pn, gold.norm, self.min_sig_digits)
        if exact is not None:
            return ("correct" if exact else "wrong"), "exact"
        reason = too_complex(pn)
        if reason:
            return reason, "policy"
        if gold.kind == "interval" and self._intervals_match(pred, gold.text):
            return "correct", "parts"
        if gold.parsed is None:
            gold.parsed = self._mv_parse(gold.text)
        if gold.kind == "interval" and _OR_SPLIT.search(pred) and split_answer(pred)[0] == "relation":
            as_set = self._relations_as_set(pred)
            if as_set is not None:
                return ("correct" if gold.parsed and as_set == gold.parsed[0] else "wrong"), "relations"
        parsed = self._mv_parse(pred)
        if not parsed or not gold.parsed:
            return "unparseable_pred", "math_verify"
        return ("correct" if self._equivalent(gold, parsed) else "wrong"), "math_verify"

    def _intervals_match(self, pred: str, gold: str) -> bool:
        """Intervals (or unions, in any order) with the same brackets and endpoints equal under this verifier's rules."""
        p, g = interval_pieces(pred), interval_pieces(gold)
        if not p or not g:
            return False

        def same_end(a: str, b: str) -> bool:
            if same_value(a, b) or numbers_match(a, b, self.min_sig_digits):
                return True
            end = None if number(norm(b)) is not None else self._parse_part(b, depth=3)
            return end is not None and self._judge_value(a, end)[0] == "correct"

        same = lambda x, y: x[0] == y[0] and x[3] == y[3] and same_end(x[1], y[1]) and same_end(x[2], y[2])  # noqa: E731
        return match_parts(p, g, same, ordered=False)

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
