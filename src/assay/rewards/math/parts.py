"""The shape of an answer: one value, or one answer made of several parts.

`split_answer` reads what kind of answer a text is and, for answers with several parts,
the parts (each as text):

| kind | written | parts compared |
|---|---|---|
| `list` | `1, -2`; `6 \\text{ and } 8`; `x = 2 \\text{ or } x = 3`; `a; b`; several boxes | as a set: any order, repeats count once |
| `set` | `\\{1, 2\\}` | as a set |
| `tuple` | `(3, -1)`; `\\langle 1, 2 \\rangle`; `[1, 2, 3]` | in order |
| `interval` | `[1, 3)`; `(-\\infty, 2] \\cup [3, \\infty)` | brackets and endpoints (unions in any order), else math-verify |
| `relation` | `x < -2 \\text{ or } x > 3`; `x \\ge 1` | whole, by math-verify |
| `matrix` | `\\begin{pmatrix}…` | whole, by math-verify |
| `scalar` | anything else | whole |

A part written `a \\pm b` (one `\\pm` or `\\mp`) stands for the two parts `a + b`, `a - b`
whenever the answer it belongs to has several parts. `(2, 3)` is a tuple here; an open
interval written the same way compares the same (in order).

    >>> split_answer(r"6 \\text{ and } 8")
    ('list', ['6', '8'])
    >>> split_answer(r"\\left( 3, \\frac{\\pi}{2} \\right)")
    ('tuple', ['3', '\\\\frac{\\\\pi}{2}'])
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

from assay.rewards.math.numbers import same_value

_OPEN = re.compile(r"\\\{|\\langle(?![A-Za-z])|[({\[]")
_CLOSE = re.compile(r"\\\}|\\rangle(?![A-Za-z])|[)}\]]")
_LIST_SEP = re.compile(
    r"(?<!\\)[,;]|\\q?quad(?![A-Za-z])|\\lor(?![A-Za-z])|\\(?:text|textrm|textnormal|mbox|mathrm)\{\s*(?:and|or|,)\s*\}|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])"
)
_GROUP_SEP = re.compile(r"(?<!\\);|\\(?:text|textrm|textnormal|mbox|mathrm)\{\s*(?:and|or)\s*\}|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])")
_COMMA, _SEMICOLON, _UNION = re.compile(r"(?<!\\),"), re.compile(r"(?<!\\);"), re.compile(r"\\cup(?![A-Za-z])")
_RELATION = re.compile(r"<|>|\\(?:le|leq|leqslant|ge|geq|geqslant|lt|gt|in|subset|subseteq|supset|supseteq)(?![A-Za-z])")
_TEXT = re.compile(r"(\\(?:text|textbf|textrm|textnormal|mathrm|mbox))\{([^{}]*)\}")
_PM = re.compile(r"\\(?:pm|mp)(?![A-Za-z])")
_LABEL = re.compile(r"\s*((?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?)\s*=(?!=)\s*(.+)", re.S)
_NAMES_LHS = re.compile(r"\s*\(\s*[A-Za-z](?:_\{?\w+\}?)?(?:\s*,\s*[A-Za-z](?:_\{?\w+\}?)?)+\s*\)\s*=(?!=)\s*(.+)", re.S)
_EDGE_SPACE = re.compile(r"^(?:\s|\\[,;:! ]|\\q?quad(?![A-Za-z])|~)+|(?:\s|\\[,;:! ]|\\q?quad(?![A-Za-z])|~)+$")
_IN_LHS = re.compile(r"\s*(?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*\\in(?![A-Za-z])\s*(.+)", re.S)
MAX_PARTS = 64
T = TypeVar("T")


def peel(s: str) -> str:
    """`s` without what wraps an answer: `$…$`, `\\(…\\)`, `\\[…\\]`, `{…}`, a final period, sizing
    commands (`\\left`, `\\big`) and spacing (`\\,`, `\\quad`, `~`) at either end."""
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?=[(\[\]).|<>]|\\[{}]|\\langle|\\rangle)|\\displaystyle", "", s)
    s = _EDGE_SPACE.sub("", s).rstrip(".")
    s = _EDGE_SPACE.sub("", s)
    for open_, close in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        inner = s[len(open_) : len(s) - len(close)]
        if s.startswith(open_) and s.endswith(close) and len(s) >= len(open_) + len(close) and close not in inner.replace("\\$", ""):
            s = inner.strip()
    while (inner := _wrapped(s, "{", "}")) is not None:
        s = inner.strip()
    return s


def _depths(s: str) -> tuple[int, ...]:
    """Bracket depth at each character of `s` (any of `( [ { \\{ \\langle` opens)."""
    out, depth, k = [0] * (len(s) + 1), 0, 0
    while k < len(s):
        m = _OPEN.match(s, k) or _CLOSE.match(s, k)
        step = len(m.group(0)) if m else (2 if s[k] == "\\" else 1)
        for j in range(k, min(k + step, len(s))):
            out[j] = depth
        if m:
            depth += 1 if m.re is _OPEN else -1
        k += step
    out[len(s)] = depth
    return tuple(out)


def split_top(s: str, sep: re.Pattern[str] = _LIST_SEP) -> list[str]:
    """`s` cut at every match of `sep` outside brackets; empty pieces dropped."""
    d = _depths(s)
    out, start = [], 0
    for m in sep.finditer(s):
        if d[m.start()] == 0:
            out.append(s[start : m.start()])
            start = m.end()
    out.append(s[start:])
    return [p for p in map(peel, out) if p]


def _wrapped(s: str, open_: str, close: str) -> str | None:
    """The inside of `s` when one `open_ … close` pair wraps all of it."""
    if not (s.startswith(open_) and s.endswith(close)):
        return None
    d = _depths(s)
    inner_end = len(s) - len(close)
    if any(d[k] == 0 for k in range(len(open_), inner_end)):
        return None
    return s[len(open_) : inner_end]


def _is_interval(s: str) -> bool:
    if any(m for m in re.finditer(r"\\cup\b|\\cap\b", s) if _depths(s)[m.start()] == 0):
        return True
    if len(s) < 2 or s[0] not in "([" or s[-1] not in ")]" or _wrapped(s, s[0], s[-1]) is None:
        return False
    return len(split_top(s[1:-1], _COMMA)) == 2 and (s[0] + s[-1] != "()" or "\\infty" in s)


def split_answer(s: str) -> tuple[str, list[str]]:
    """`(kind, parts)` of an answer text (kinds in the module docstring)."""
    s = peel(s)
    if "\\begin{" in s:
        return "matrix", [s]
    for open_, close, kind in (("\\{", "\\}", "set"), ("\\langle", "\\rangle", "tuple")):
        inner = _wrapped(s, open_, close)
        if inner is not None:
            return kind, split_top(inner)
    if _is_interval(s):
        return "interval", [s]
    for open_, close, least in (("(", ")", 2), ("[", "]", 3)):
        inner = _wrapped(s, open_, close)
        coords = _coordinates(inner) if inner is not None else []
        if len(coords) >= least:
            return "tuple", coords
    if any(m for m in _RELATION.finditer(s) if _depths(s)[m.start()] == 0):
        return "relation", [s]
    groups = solution_groups(s)
    if groups:
        return "list", groups
    parts = split_top(s)
    if len(parts) == 1 and (m := _TEXT.fullmatch(s)) and len(words := split_top(m.group(2))) > 1:
        parts = [f"{m.group(1)}{{{w}}}" for w in words]  # \text{Evelyn and Carla}
    return ("list", parts) if len(parts) > 1 else ("scalar", [s])


def solution_groups(s: str) -> list[str] | None:
    """Several solutions, each naming the same unknowns (`p=5, q=2; p=7, q=2`, `x=1, y=2 \\text{ or } x=3, y=4`),
    as one labelled tuple per solution (`(p=5, q=2)`, `(p=7, q=2)`); None when `s` is not that.

    Without this, the separators would make one flat list of four labelled values.
    """
    groups = split_top(s, _GROUP_SEP)
    if len(groups) < 2:
        return None
    names = None
    for g in groups:
        named = [label(p) for p in split_top(g, _COMMA)]
        keys = [n for n, _ in named]
        if len(named) < 2 or not all(keys) or len(set(keys)) != len(keys) or (names is not None and set(keys) != names):
            return None
        names = set(keys)
    return [f"({g})" for g in groups]


def _coordinates(inner: str) -> list[str]:
    """The coordinates of a bracketed tuple: split at commas, or at `;` when there is no comma (`(0;-2;6)`)."""
    parts = split_top(inner, _COMMA)
    return parts if len(parts) > 1 else split_top(inner, _SEMICOLON)


def expand_pm(parts: list[str]) -> list[str]:
    """Each part with one `\\pm` / `\\mp` as its two parts (`1 \\pm \\sqrt{2}` → `1 + \\sqrt{2}`, `1 - \\sqrt{2}`)."""
    out = []
    for p in parts:
        signs = _PM.findall(p)
        if len(signs) != 1:
            out.append(p)
            continue
        first, second = ("+", "-") if signs[0] == "\\pm" else ("-", "+")
        out += [_PM.sub(first, p), _PM.sub(second, p)]
    return out


def interval_pieces(s: str) -> list[tuple[str, str, str, str]] | None:
    """`[a, b)` as `[("[", "a", "b", ")")]`, a union as one tuple per interval; None when `s` is not that."""
    out = []
    for piece in split_top(peel(s), _UNION):
        if len(piece) < 2 or piece[0] not in "([" or piece[-1] not in ")]" or _wrapped(piece, piece[0], piece[-1]) is None:
            return None
        ends = split_top(piece[1:-1], _COMMA)
        if len(ends) != 2:
            return None
        out.append((piece[0], ends[0], ends[1], piece[-1]))
    return out or None


def value_of(gold: str) -> str:
    """A reference written `(p, q) = (3, 2)` as its value `(3, 2)`."""
    m = _NAMES_LHS.fullmatch(gold)
    return m.group(1).strip() if m else gold


def label(part: str) -> tuple[str | None, str]:
    """`("x", "5")` for `x = 5`; `(None, part)` when the part is not one name set to a value."""
    m = _LABEL.fullmatch(part)
    if m and "=" not in m.group(2):
        return m.group(1), m.group(2).strip()
    return None, part


def drop_lhs(pred: str, gold: str) -> str:
    """`x = 5` → `5`, `(x, y) = (1, 2)` → `(1, 2)` when the gold is not itself an equation (and `pred` is not
    several solutions, `x = 1, y = 2; x = 3, y = 4`, whose names are read by `solution_groups`);
    `x \\in \\{1, 2\\}` → `\\{1, 2\\}` when the gold does not say `\\in`."""
    m = _IN_LHS.fullmatch(pred)
    if m and "\\in" not in gold:
        return m.group(1)
    if "=" in gold or re.search(r"\\[lg]e|<|>", pred) or solution_groups(pred):
        return pred
    m = _NAMES_LHS.fullmatch(pred) or re.fullmatch(r"\s*(?:[A-Za-z]|\\[a-zA-Z]+|[A-Za-z]_\{?\w+\}?|\\text\{[^{}]*\})\s*=\s*(.+)", pred, re.S)
    return m.group(1) if m else pred


def distinct(parts: list[str]) -> list[str]:
    """Repeats removed (`1, 1, 2` is the set {1, 2}); cheap equality only, never sympy."""
    out: list[str] = []
    for p in parts:
        if not any(same_value(p, q) for q in out):
            out.append(p)
    return out


def match_parts(pred: Sequence[str], gold: Sequence[T], same: Callable[[str, T], bool], ordered: bool,
                cheap: Callable[[str, T], bool] | None = None) -> bool:
    """Whether the parts are one answer: pairwise in order, or as sets (a perfect matching under `same`).

    Parts are compared as given; remove repeats first (`distinct`) where they mean nothing.
    For sets, the gold parts that `cheap` already calls equal are tried first, so a list in
    another order costs no more calls of `same` (math-verify) than one in the same order.
    """
    if len(pred) != len(gold):
        return False
    if ordered:
        return all(same(p, g) for p, g in zip(pred, gold))
    owner: dict[int, int] = {}  # gold index -> pred index (Kuhn's augmenting paths)
    cache: dict[tuple[int, int], bool] = {}

    def ok(i: int, j: int) -> bool:
        if (i, j) not in cache:
            cache[(i, j)] = same(pred[i], gold[j])
        return cache[(i, j)]

    @functools.cache
    def order(i: int) -> tuple[int, ...]:
        first = [j for j in range(len(gold)) if cheap and cheap(pred[i], gold[j])]
        return (*first, *(j for j in range(len(gold)) if j not in first))

    def augment(i: int, seen: set[int]) -> bool:
        for j in order(i):
            if j not in seen and ok(i, j):
                seen.add(j)
                if j not in owner or augment(owner[j], seen):
                    owner[j] = i
                    return True
        return False

    return all(augment(i, set()) for i in range(len(pred)))
