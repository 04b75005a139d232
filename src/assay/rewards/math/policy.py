"""What the math verifier refuses before deciding equivalence: hedges and inputs too costly for sympy.

    >>> hedge_reason("5 or 6", "5", multi=False), hedge_reason("5 or 6", "5, 6", multi=True)
    ('hedged', None)
    >>> too_complex("9^{9^{9^9}}")
    'too_complex'
"""

from __future__ import annotations

import re

from assay.rewards.math.extract import HEDGE_IN

_OR_WORD = re.compile(r"or|\\lor|\\text\{\s*or\s*\}", re.I)
_NEQ = re.compile(r"\\neq?(?![A-Za-z])")
#: a reference that says "not equal" in any spelling uses the qualifier `\\neq` itself
_NEQ_SPELLED = re.compile(r"\\neq?(?![A-Za-z])|!=")
_PM = re.compile(r"\\(?:pm|mp)(?![A-Za-z])|±|∓")


def hedge_reason(pred: str, gold: str, multi: bool, or_joins: bool = False) -> str | None:
    """"hedged" when `pred` hedges relative to the reference `gold`, else None.

    Hedges: a qualifier (`or`, `either`, `maybe`, `?`, `between`, `to`, `not`, `about`,
    `\\approx`, `\\neq` or `\\ne`, … see `HEDGE_IN`) the reference does not use itself (a
    reference saying `!=` uses `\\neq`), `\\pm` / `\\mp` when
    the reference has none and one value, `and` joining values for a one-value reference.
    A bare "or" joins parts, not a hedge, when the reference has several parts (`multi`)
    or is a union of intervals / an inequality (`or_joins`, which also allows `\\neq`).
    """
    if not (HEDGE_IN.search(gold) or _NEQ_SPELLED.search(gold)):
        for m in HEDGE_IN.finditer(pred):
            cue = m.group(0)
            if not ((multi or or_joins) and _OR_WORD.fullmatch(cue) or or_joins and _NEQ.fullmatch(cue)):
                return "hedged"
    if _PM.search(pred) and not _PM.search(gold) and not multi:
        return "hedged"
    if re.search(r"\band\b", pred) and not re.search(r"\band\b|,", gold) and not (multi or or_joins):
        return "hedged"
    return None


_TOWER = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\d+\s*\^|\^\s*\{[^{}]*\{[^{}]*\^")
_BIG_EXP = re.compile(r"\^\s*\{?\s*[+-]?\d{5,}|\d{5,}\s*!|\*\*\s*\d{5,}|\\uparrow|\\underbrace")


def too_complex(s: str, max_len: int = 400) -> str | None:
    """A reason to refuse `s` before sympy: too long, an exponent tower, a huge power."""
    if len(s) > max_len:
        return "too_long"
    if _TOWER.search(s) or _BIG_EXP.search(s) or s.count("{") > 60:
        return "too_complex"
    return None
