"""Numbers in answers: digit-group separators, cosmetic normal form, exact comparison.

Separators are read by one rule on both sides, reference and prediction. A *run* is a
maximal stretch of digits joined by `,`, `.`, `{,}` or a space-like separator (a space,
`\\,`, `\\ `, `\\;`, `\\:`, `~`, no-break or thin space); the whole run is read at once:

* `12,345`, `1,234,567.5`: commas between groups of exactly three digits, the first group
  1-3 digits not starting with 0, no space: a thousands separator (English).
* `12 345`, `12\\,345`, `10\\,000`: one space-like separator repeated between the same
  three-digit groups: a thousands separator (SI style; MATH references write `10\\,000`).
* `14{,}916` (`{,}` before three-digit groups) is a thousands separator; `3{,}14` and
  `0{,}500` (`{,}` otherwise) a decimal comma. A braced comma is never a list comma.
* `1.234.567` and `1.234.567,89` (two or more dot groups, then maybe a comma and digits):
  German-style thousands dots and decimal comma. One dot group (`1.234`, `2.125,3`) is
  ambiguous with an English decimal (and a list), so it stays English.
* Inside brackets (`( )`, `[ ]`, `\\{ \\}`, `\\langle \\rangle`) a bare comma separates
  elements: `(12,102)` is a pair, `\\{1,000\\}` two elements.
* Anything else is not one number: `12, 345` and `1,22` are two numbers (a list), and
  digits separated only by spaces in any other pattern (`1 2`, `12 34`) are a list too.

Deliberately *not* read as numbers, because a MATH-style list reads the same: `1,22`,
`0,5`, `1000,99` (math-verify reads a decimal comma there; here `\\boxed{0,5}` is the
solutions 0 and 5), `1 234,5` (French) and `1.234,5`. `1,234` is 1234, never 1.234.

    >>> group_digits("12,345 and 12, 345 and 10\\\\,000 and 3{,}14")
    '12345 and 12, 345 and 10000 and 3.14'
    >>> numbers_match("0.5", "\\\\frac{1}{2}"), numbers_match("1,234", "1234")
    (True, True)
"""

from __future__ import annotations

import re
from fractions import Fraction

_UNICODE = str.maketrans({"−": "-", "–": "-", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ", "π": "\\pi ", "∞": "\\infty ",
                          "≤": "\\le ", "≥": "\\ge ", "≠": "\\neq ", "≈": "\\approx ", "√": "\\sqrt", "±": "\\pm ", "∓": "\\mp ", "∪": "\\cup ", "∈": "\\in "})


def unicode_to_latex(s: str) -> str:
    """Unicode maths (−, ×, π, √, ≤, ±, …) as the LaTeX math-verify reads."""
    return s.translate(_UNICODE)


# ----------------------------------------------------------------------------- separators

_SPACE = r"(?:\\[,;: ]|~|[ \u00a0\u2009\u202f])"  # one space-like separator
_RUN = re.compile(r"(?<![\w.^])\d+(?:(?:,|\.|\{,\}|" + _SPACE + r")\d+)*")
_THOUSANDS_COMMA = re.compile(r"[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
_THOUSANDS_SPACE = re.compile(rf"[1-9]\d{{0,2}}(?P<sep>{_SPACE})\d{{3}}(?:(?P=sep)\d{{3}})*(?:\.\d+)?")
_THOUSANDS_BRACED = re.compile(r"[1-9]\d{0,2}(?:\{,\}\d{3})+(?:\.\d+)?")
_DECIMAL_BRACED = re.compile(r"\d+\{,\}\d+")
_GERMAN = re.compile(r"[1-9]\d{0,2}(?:\.\d{3}){2,}(?:,\d+)?")
_PLAIN = re.compile(r"\d+(?:\.\d+)?")


def _read_run(run: str) -> str:
    """One run of digits and separators, rewritten (see the module docstring)."""
    if _PLAIN.fullmatch(run):
        return run
    if _THOUSANDS_COMMA.fullmatch(run) or _THOUSANDS_BRACED.fullmatch(run):
        return run.replace("{,}", "").replace(",", "")
    if _THOUSANDS_SPACE.fullmatch(run):
        return re.sub(_SPACE, "", run)
    if _DECIMAL_BRACED.fullmatch(run):
        return run.replace("{,}", ".")
    if _GERMAN.fullmatch(run):
        return run.replace(".", "").replace(",", ".")
    return re.sub(rf"(?<=\d){_SPACE}+(?=\d)", ", ", run)  # `1 2`: two numbers


def _in_brackets(s: str) -> list[bool]:
    """For each index of `s`: whether it lies inside `( )`, `[ ]`, `\\{ \\}` or `\\langle \\rangle`."""
    out, depth, k = [False] * (len(s) + 1), 0, 0
    for m in _BRACKET.finditer(s):
        for j in range(k, m.start()):
            out[j] = depth > 0
        depth = depth + 1 if m.group(1) else max(depth - 1, 0)
        k = m.start()
    for j in range(k, len(s) + 1):
        out[j] = depth > 0
    return out


_BRACKET = re.compile(r"(\\\{|\\langle(?![A-Za-z])|[(\[])|\\\}|\\rangle(?![A-Za-z])|[)\]]")


def group_digits(s: str) -> str:
    """`s` with every digit run read once: thousands separators removed, a decimal comma made a point.

    Comma-space (`12, 345`) always separates two numbers, and so does a bare comma inside
    brackets, where it separates elements (`(12,102)` is a pair); see the module docstring.
    """
    s = re.sub(r"\{\s*,\s*\}", "{,}", s)
    s = re.sub(r"(?<=\d),\s*\\!\s*(?=\d)", ",", s)  # MATH writes `10,\!000` (and `11,\! 111`)
    s = re.sub(r"(?<=\d)\\!(?=\d)", "", s)
    inside = _in_brackets(s) if "," in s else []

    def read(m: re.Match[str]) -> str:
        if inside and inside[m.start()]:
            return ",".join(_read_run(piece) for piece in re.split(r"(?<!\{),(?!\})", m.group(0)))
        return _read_run(m.group(0))

    return _RUN.sub(read, s)


_ROMAN_LETTER = re.compile(r"\\(?:mathrm|mathit|mathnormal|rm)\{\s*([A-Za-z])\s*\}")


def clean(s: str) -> str:
    """The text of an answer as the rest of the verifier reads it: unicode as LaTeX, digit groups read,
    `\\mathrm{e}` as `e` (math-verify's LaTeX parser fails on `\\frac{1}{\\mathrm{e}}`)."""
    return _ROMAN_LETTER.sub(r"\1", group_digits(unicode_to_latex(s))).strip()


# --------------------------------------------------------------------------- normal form

_UNITS = (  # Minerva's removed unit words (Lewkowycz et al. 2022, arXiv:2206.14858, appendix D) and a few more
    "cm|mm|km|m|kg|g|gm|grams|mg|s|sec|seconds|minutes|min|hours|hr|h|days|units|unit|degrees|degree|dollars|dollar|cents|"
    "inches|inch|in|feet|ft|foot|meters|metres|miles|mph|square|sq|cubic|liters|litres|l|ml|years|people|students|"
    "ways|integers|points|digits|pounds|lbs|lb|ounces|oz|edges|meals|multiples"
)
_UNIT_TAIL = re.compile(rf"^(.*?\d)\s*(?:\\text\{{\s*)?(?:{_UNITS})(?:\^?\{{?[23]\}}?)?\}}?$")
_STRIP = [
    (re.compile(r"\\(?:left|right|displaystyle|!|,|;|:| )"), ""),
    (re.compile(r"\\[dtc]frac"), r"\\frac"),
    (re.compile(r"\^\s*\{?\\circ\}?|°"), ""),
    (re.compile(r"\\\$|\$"), ""),
    (re.compile(r"\*\*"), ""),
    (re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{([^{}]*)\}"), r"\1"),
    (re.compile(r"\s+"), ""),
]


def norm(s: str) -> str:
    """Cosmetic normal form used for string comparison and numbers (never sent to sympy).

    Idempotent: a comma left after the digit groups are read separates two things and is
    written `, ` so that reading the result again cannot join them into one number.
    """
    s = clean(s)
    for pat, rep in _STRIP:
        s = pat.sub(rep, s)
    return s.rstrip(".").replace(",", ", ")


def _strip_units(s: str) -> str:
    m = _UNIT_TAIL.match(s)
    return m.group(1) if m else s


_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?)\\frac(\d)(\d)")


def number(s: str) -> tuple[Fraction, str, bool] | None:
    """`(value, kind, percent)` for a plain number in normal form: int, decimal, a/b or `\\frac{a}{b}`."""
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


def numbers_match(pred: str, gold: str, min_sig_digits: int = 3) -> bool | None:
    """Exact comparison of two plain numbers (None when either is not a plain number).

    Integers and decimals must be equal as rationals; `%` on either side also allows the
    value /100 (gold `82\\%` accepts `82` and `0.82`, never `8200`); a decimal prediction of
    a non-terminating rational gold (`1/3`) counts when it is the gold correctly rounded
    to the prediction's digits, with at least `min_sig_digits` significant digits.
    """
    pred, gold = norm(pred), norm(gold)
    p, g = number(pred), number(gold)
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


def same_value(a: str, b: str) -> bool:
    """Cheap equality: the same normal form, or the same plain number."""
    a, b = norm(a), norm(b)
    na, nb = number(a), number(b)
    return a == b or (na is not None and nb is not None and na[0] == nb[0])


def _decimals(s: str) -> int:
    m = re.search(r"\.(\d+)", s)
    return len(m.group(1)) if m else 0


def _terminates(q: Fraction) -> bool:
    d = q.denominator
    for f in (2, 5):
        while d % f == 0:
            d //= f
    return d == 1
