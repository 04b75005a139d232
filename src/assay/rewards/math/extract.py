"""Finding the final answer of a completion: the response after thinking, boxes, answer statements, corrections.

Every position an `Extraction` holds (`end`) is an offset in its own `response` string,
the completion with its thinking removed; `after_answer` reads the same string. The
thinking never feeds the answer or the correction scan.

**Thinking.** The response is the text after the last closing thinking tag, up to an
opening tag that is never closed. So `<think>…</think> answer` answers from ` answer`;
a closing tag with no opening one (the template opened it in the prompt, as
DeepSeek-R1 and Qwen3 do) makes everything before it thinking; an unclosed opening tag
(`answer <think> truncated…`) ends the response; a completion that is all thinking has
no answer. Tags of all the families in `THINK_TAGS` are read by default.

    >>> extract_answer("<think>Wait, it is 6.</think> \\\\boxed{5}").answer
    '5'
    >>> extract_answer("\\\\boxed{5} <think>no, \\\\boxed{6}").answer
    '5'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from assay.rewards.math.numbers import same_value

#: Thinking tags of the models trained with RL on verifiable rewards:
#: `<think>` (DeepSeek-R1, Qwen3, QwQ and most), `<|begin_of_thought|>` (Sky-T1 and the
#: OpenThoughts / Bespoke-Stratos data), `[THINK]` (Magistral), `◁think▷` (Kimi-VL-Thinking),
#: `<seed:think>` (Seed-OSS), and `<thinking>` / `<reasoning>` as RL prompt templates ask.
THINK_TAGS: tuple[tuple[str, str], ...] = (
    ("<think>", "</think>"),
    ("<thinking>", "</thinking>"),
    ("<reasoning>", "</reasoning>"),
    ("<|begin_of_thought|>", "<|end_of_thought|>"),
    ("[THINK]", "[/THINK]"),
    ("◁think▷", "◁/think▷"),
    ("<seed:think>", "</seed:think>"),
)


def think_tags(thinking: str | list | tuple) -> tuple[tuple[str, str], ...]:
    """The tag pairs for a `thinking` setting: "standard" (THINK_TAGS), "none", or a list of [open, close] pairs."""
    if thinking == "standard":
        return THINK_TAGS
    if thinking == "none":
        return ()
    if isinstance(thinking, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(t, str) and t for t in p) for p in thinking
    ):
        return tuple((p[0], p[1]) for p in thinking)
    raise ValueError(f"thinking must be 'standard', 'none' or a list of [open, close] tag pairs, got {thinking!r}")


def response_span(text: str, tags: tuple[tuple[str, str], ...] = THINK_TAGS) -> tuple[int, int]:
    """`(start, end)` of the response in `text`: after the last closing tag, before a later (unclosed) opening tag."""
    if not tags:
        return 0, len(text)
    closes = re.compile("|".join(re.escape(c) for _, c in tags), re.I)
    opens = re.compile("|".join(re.escape(o) for o, _ in tags), re.I)
    start = 0
    for m in closes.finditer(text):
        start = m.end()
    m = opens.search(text, start)
    return start, (m.start() if m else len(text))


# ---------------------------------------------------------------------------------- boxes

_BOX_CMDS = ("\\boxed", "\\fbox")


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


# ------------------------------------------------------------------------ references

_BACKSLASH_RUN = re.compile(r"\\+")
_OPEN_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def undouble_backslashes(text: str) -> str:
    r"""A reference stored with every backslash doubled, as JSON-escaped datasets hold LaTeX, read with
    single ones; any other text as it is.

    Doubled means: every run of backslashes has even length, so no command is written with one
    backslash, and some doubled backslash starts a command of two or more letters or a set brace
    (`\\frac`, `\\{`). LaTeX's own line break (`1 \\ 2` in a matrix) never meets both.

        >>> print(undouble_backslashes(r"\\left(\\frac{1}{5},\\frac{1}{6}\\right)"))
        \left(\frac{1}{5},\frac{1}{6}\right)
        >>> print(undouble_backslashes(r"\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"), undouble_backslashes(r"1 \\ 2"))
        \begin{pmatrix} 1 \\ 2 \end{pmatrix} 1 \\ 2
    """
    runs = list(_BACKSLASH_RUN.finditer(text))
    if not runs or any(len(m.group(0)) % 2 for m in runs):
        return text
    if not any(len(m.group(0)) % 4 == 2 and re.match(r"[A-Za-z]{2}|[{}]", text[m.end() :]) for m in runs):
        return text
    return _BACKSLASH_RUN.sub(lambda m: "\\" * (len(m.group(0)) // 2), text)


def reference_boxes(text: str) -> list[tuple[int, int, str]] | None:
    """The boxes of a reference answer (`find_boxes`), with a last box its author left open
    (`\\boxed{W(n) = 1 \\text{ and } W(n) = -1`) read to the end of the text; None when the open
    box's own braces do not balance (`\\boxed{\\frac{1}{2`), where what was meant is a guess.

    A completion's unclosed box is never read this way: a reference is written by a person,
    a completion cut off mid-box has no answer.
    """
    boxes = find_boxes(text)
    start = boxes[-1][1] if boxes else 0
    m = _OPEN_BOX.search(text, start)
    if m is None:
        return boxes
    inner = re.sub(r"(?:(?<!\\)\$|\s|\.)+$", "", text[m.end() :])
    if _matching_brace("{" + inner + "}", 0) != len(inner) + 1:
        return None
    return [*boxes, (m.start(), len(text), inner)]


# ----------------------------------------------------------------------------- extraction

_LABEL_EQ = r"(?:[A-Za-z]|\\[a-zA-Z]+)(?:_\{?\w+\}?)?\s*="
_CONNECTOR = re.compile(
    r"^(?:[\s$,;.:&]|\\[,;:!]|\\q?quad|\\text\{\s*(?:and|or|,)?\s*\}|\\\]|\\\[|\\\)|\\\(|and|or|" + _LABEL_EQ + ")*$"
)
_HEDGE_CUE = re.compile(r"\b(?:or|also|alternatively|possibly|either|maybe|perhaps|might|could be|another)\b", re.I)
_CORRECTION_CUE = re.compile(
    r"\bno,|\b(?:wait|actually|mistake|wrong|incorrect|correct(?:ion|ed)?|final|instead|rather|oops|sorry|scratch that|"
    r"i mean|re-?check|fix|error|recompute|recalculate|redo)\b",
    re.I,
)
_ANCHOR = re.compile(r"(?:final answer|the answer|answer)\s*(?:is|:|=)?\s*[:=]?\s*(?:\*\*)?\s*(?::\s*)?|"
                     r"\bthe solutions?\s+(?:is|are)\b\s*:?\s*|^####\s*", re.I | re.M)
_BARE = re.compile(r"^\$*\s*([^$\n]{1,40}?)\s*\$*\.?$")
_MATH_ONLY = re.compile(r"\$\$(.+?)\$\$\.?|\$((?:[^$]|\\\$)+?)\$\.?|\\\((.+?)\\\)\.?|\\\[(.+?)\\\]\.?", re.S)
_WORD = re.compile(r"(?<!\\)\b[A-Za-z]{3,}\b")
#: qualifiers that make a stated answer a hedge (also used by the judge on the answer itself)
HEDGE_IN = re.compile(
    r"\bor\b|\\lor|\\text\{\s*or\s*\}|\beither\b|\bmaybe\b|\?|\bbetween\s+\$?-?\d|\d\$?\s+to\s+\$?-?\d|\bnot\b|\bnever\b|\bno\b|\bprobably\b|"
    r"\blikely\b|\bapproximately\b|\babout\b|\baround\b|\broughly\b|\bguess\b|\\approx|\\neq?(?![A-Za-z])",
    re.I,
)
VALUE = r"(-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\\d?frac\{[^{}]*\}\{[^{}]*\})"


@dataclass
class Extraction:
    """What `extract_answer` found.

    `answer` is the answer text (None when there is none) and `reason` how it was found
    (`boxed`, `anchored`, `bare`) or why not. `end` is the offset just past the answer in
    `response`, the completion without its thinking, which starts at `offset` in the
    completion. `joined` lists the different boxes of a `multi_answer`.
    """

    answer: str | None
    reason: str
    end: int = 0
    joined: list[str] | None = None
    response: str = ""
    offset: int = 0


def extract_answer(text: str, no_box: str = "anchored", thinking: str | list | tuple = "standard") -> Extraction:
    """The final answer of a completion under the rules in the module docstring and `docs/rewards.md`."""
    start, stop = response_span(text, think_tags(thinking))
    response = text[start:stop]
    boxes = find_boxes(response)
    if boxes:
        ex = _from_boxes(response, boxes)
        if ex.reason == "boxed":
            ex = _restated_after_box(response, ex)
    elif no_box == "zero":
        ex = Extraction(None, "no_box")
    else:
        ex = _from_anchor(response)
    ex.response, ex.offset = response, start
    return ex


def _from_boxes(text: str, boxes: list[tuple[int, int, str]]) -> Extraction:
    last = boxes[-1]
    cluster = [last]
    for prev in reversed(boxes[:-1]):
        if not _CONNECTOR.match(text[prev[1] : cluster[0][0]]):
            break
        cluster.insert(0, prev)
    values = [b[2] for b in cluster]
    if any(v != values[0] and not same_value(v, values[0]) for v in values):
        return Extraction(None, "multi_answer", last[1], joined=values)
    # an earlier, different box separated by prose: a hedge ("or maybe") fails, a correction wins
    for prev in reversed(boxes[: len(boxes) - len(cluster)]):
        if not same_value(prev[2], values[0]):
            gap = text[prev[1] : cluster[0][0]]
            if _HEDGE_CUE.search(gap) and not _CORRECTION_CUE.search(gap):
                return Extraction(None, "hedged", last[1])
            break
    return Extraction(last[2], "boxed", last[1])


def _from_anchor(text: str) -> Extraction:
    """A response that is nothing but the answer (`_bare`), else the last "answer is" statement."""
    bare = _bare(text.strip())
    if bare is not None:
        return Extraction(bare, "bare", len(text.rstrip()))
    for m in reversed(list(_ANCHOR.finditer(text))):
        found = _statement(text, m)
        if found:
            return found
    return Extraction(None, "no_answer")


_SOLUTION_ANCHOR = re.compile(r"the solutions?\b", re.I)


def _statement(text: str, m: re.Match[str]) -> Extraction | None:
    """The answer an anchor `m` states: after it (`the answer is 5`), else before it (`$5$ is the answer`).

    "The solution is" states an answer only in maths: prose after it ("The solution is complete.",
    "the solution is valid since 12 > 0") is about the solution, and an earlier statement stands.
    """
    span = _claim_span(text, m.end())
    if span and _SOLUTION_ANCHOR.match(m.group(0)):
        words = _WORD.search(span[0])
        if words and not (HEDGE_IN.search(span[0]) and re.search(r"[\d$\\]", span[0])):
            return None
    if span:
        return Extraction(span[0], "anchored", span[1])
    before = _claim_before(text, m.start())
    if before == "hedged":
        return Extraction(None, "hedged", m.end())
    return Extraction(before, "anchored", m.end()) if before else None


_IS_BEFORE = re.compile(r"(?:is|was)\s+(?:(?:the|our|my)\s+)?$", re.I)  # no leading \s*: quadratic on a run of spaces
_MATH_SPAN = re.compile(r"\$\$([^$]+)\$\$|\$((?:[^$]|\\\$)+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_VALUE_AT_END = re.compile(r"(?<![\w.,/])" + VALUE + r"$")
_LIST_BEFORE = re.compile(r"(?:\$|\d|\\\)|\})\s*(?:,|\bor|\band|\\text\{\s*(?:or|and)\s*\})\s*\$*\s*$", re.I)


def _claim_before(text: str, at: int) -> str | None:
    """The math right before "is the answer" / "is our answer" ending at `at`: a `$…$` / `\\(…\\)` span
    or a plain number; "hedged" when it ends a list (`$5$ or $6$ is the answer`); None when there is none."""
    head = text[max(0, at - 2000) : at]
    m = _IS_BEFORE.search(head)
    if not m:
        return None
    claim = head[: m.start()].rstrip()
    spans = list(_MATH_SPAN.finditer(claim))
    if spans and spans[-1].end() == len(claim):
        inner, start = next(g for g in spans[-1].groups() if g is not None).strip(), spans[-1].start()
    elif value := _VALUE_AT_END.search(claim):
        inner, start = value.group(1), value.start()
    else:
        return None
    if not inner:
        return None
    return "hedged" if _LIST_BEFORE.search(claim[:start]) else inner


_FIRM_ANCHOR = re.compile(r"final answer|the answer\s+is\b", re.I)
#: "$7$ is the answer" as a sentence or clause of its own (after a boundary or a connective), in the present tense
_PLAIN_CLAIM_BEFORE = re.compile(r"(?:^|[.;:!?,\n]|\b(?:and|or|so|thus|hence|therefore|then)\b)\s*"
                                 r"(?:\$[^$]{1,400}\$|\\\([^\n]{1,400}?\\\)|-?\d[\d,./]*)\s+is\s+(?:(?:the|our|my)\s+)?(?:final\s+)?$", re.I)
_RESTATE_LOOKBACK = 8  # anchors read back from the end: a restatement closes the response, and the cost stays bounded


def _restated_after_box(text: str, ex: Extraction) -> Extraction:
    """The box's answer, or a different one stated later in plain maths ("Final Answer: The final answer is
    $10{,}455$.", "and $10{,}455$ is the answer"), which replaces it as a later box would; prose between them
    that hedges scores 0. A looser anchor ("to check the answer: $3 \\cdot 4 = 12$") restates nothing, and
    neither does a claim inside prose about an answer ("a common mistake is to think $5$ is the answer")."""
    for m in list(_ANCHOR.finditer(text, ex.end))[::-1][:_RESTATE_LOOKBACK]:
        after = _claim_span(text, m.end())
        if not _FIRM_ANCHOR.match(m.group(0)) and after:
            continue
        if not after and not _PLAIN_CLAIM_BEFORE.search(text[max(ex.end, m.start() - 600) : m.start()]):
            continue  # "a common mistake is to think $5$ is the answer", "I thought $5$ was the answer": about an answer
        found = _statement(text, m)
        if found is None:
            continue
        if found.answer is None:  # `$5$ or $6$ is the answer`
            return found
        if _WORD.search(text[m.end() : found.end]) or same_value(found.answer, ex.answer or ""):
            continue
        gap = text[ex.end : m.end()]  # a "final answer" is itself a correction cue
        if _HEDGE_CUE.search(gap) and not _CORRECTION_CUE.search(gap):
            return Extraction(None, "hedged", found.end)
        return found
    return ex


def _bare(text: str) -> str | None:
    """The whole response as the answer: one line of at most 40 characters with no word of three or
    more letters (`42`, `x = 5`, `$\\frac{1}{2}$.`, `$28$ %`: math delimiters inside it are read past),
    or a single math span of at most 400 characters (`$\\text{odd}$`, `\\[ (3, \\tfrac{\\pi}{2}) \\]`),
    whose words are maths, not prose."""
    if text.startswith("####"):  # GSM8K's answer marker: an answer statement
        return None
    m = _MATH_ONLY.fullmatch(text)
    inner = next((g for g in m.groups() if g is not None), "").strip() if m else ""
    if inner and len(inner) <= 400:
        return inner
    m = _BARE.match(re.sub(r"(?<!\\)\$", "", text))
    return m.group(1) if m and not _WORD.search(m.group(1)) else None


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
    if not span:
        return None
    if _WORD.search(span):  # prose: "the number of ways, which is 10" -> 10
        tail = re.search(r"(?:\bis|=|\bequals|\bbe)\s*\$*\s*" + VALUE + r"\s*\$*$", span)
        if tail and not HEDGE_IN.search(span):
            span = tail.group(1)
    return span, i + m.end()


# ---------------------------------------------------------------------------- what follows

_LIST_TAIL = re.compile(
    r"\s*\$*\s*(?:,|and\b|or\b|\\text\{\s*(?:and|or)\s*\})\s*\$*\s*(?:[A-Za-z]\s*=\s*)?" + VALUE + r"\s*\$*", re.I
)
_TAIL_HEDGE = re.compile(r"\bor (?:possibly|maybe|perhaps)\b|\balternatively\b|\bcould also be\b|\bmight be\b", re.I)
_STRONG_FIX = re.compile(r"\bno,|\b(?:wait|actually|mistake|wrong|incorrect|oops|sorry|scratch that|i mean|instead|correction)\b", re.I)
_VALUE_END = r"\s*\$*\s*(?=[.!,;]|$|\s)"
_FIX_CLAIM = re.compile(
    r"(?:\b(?:answer|it|result|value|that|this)\s+(?:is|should be|must be|would be)\s+(?:actually\s+)?|\bit's\s+|\bno\b,?\s*|"
    r"\bwait\b,?\s*|\bactually\b,?\s*|\binstead\b,?\s*|\bmeant\s+)\$*\s*" + VALUE + _VALUE_END,
    re.I,
)
_HEDGE_CLAIM = re.compile(r"(?:\bor\b|\bpossibly|\bmaybe|\bperhaps|\bbe)\s*\$*\s*" + VALUE + _VALUE_END, re.I)


def list_continuation(tail: str) -> list[str]:
    """The values a list goes on with right after an answer: ` and $6$`, `, 7 or 8` → `["6"]`, `["7", "8"]`."""
    out, k = [], 0
    while m := _LIST_TAIL.match(tail, k):
        out.append(m.group(1))
        k = m.end()
    return out


def after_answer(ex: Extraction) -> tuple[str, str | list[str] | None]:
    """What the response after the answer does to it: `("kept", None)`, `("hedged", None)`,
    `("corrected", value)` or `("list", [values])`.

    A list continuation (`$5$ and $6$`, `\\boxed{5} or 6`) makes the answer a list (a hedge
    for a one-value reference); a hedge cue followed by a different value (`, or possibly
    6`) hedges; a correction cue whose last stated value differs (`Actually no, it is
    167.`) corrects the answer to that value. Only `ex.response` is read, never thinking.
    """
    tail = ex.response[ex.end : ex.end + 4000]
    more = list_continuation(tail)
    if more:
        return "list", more
    hedge, fix = _TAIL_HEDGE.search(tail), _STRONG_FIX.search(tail)
    if hedge and (not fix or hedge.start() < fix.start()):
        claims = [m.group(1) for m in _HEDGE_CLAIM.finditer(tail, hedge.start())]
        return ("hedged", None) if any(not same_value(c, ex.answer or "") for c in claims) else ("kept", None)
    if fix:
        claims = [m.group(1) for m in _FIX_CLAIM.finditer(tail, fix.start())]
        if claims and not same_value(claims[-1], ex.answer or ""):
            return "corrected", claims[-1]
    return "kept", None
