"""Steps of a completion and step-labelled rows: what a process reward model reads and is trained on.

`split_steps(text, how)` cuts a completion into steps, each with its character span:

| `how` | a step is |
|---|---|
| `newline` (default) | a line; blank lines are no step |
| `chars:N` | N characters (the last step may be shorter); for completions without any structure, such as the bundled model's answers |
| any other text, e.g. `"\\n\\n"` or `Step` | the text between two occurrences of the marker; a marker that starts a step (`Step 1: ...`) stays with it |
| `module:function` | your own function `text -> list[(start, end)]` |

A step that is only whitespace is dropped; spans never include the separator. A `<think>`
section is text like any other: its lines are steps.

Step-labelled rows (`read_step_rows`) hold a prompt, its steps and one label per step:

| column | read as |
|---|---|
| `prompt` (or `problem`, `question`) | text, or a conversation |
| `steps` | a list of step texts; the completion is `separator.join(steps)` |
| `labels` | per step: a boolean, or a number in [0, 1] (a soft label: the chance the step leads to a right answer) |
| `ratings` | per step, PRM800K's human rating: −1 (wrong) → 0.0, 0 (neutral) → 1.0, 1 (good) → 1.0 |
| `separator` | optional: what joins the steps (default: `data.step_separator`) |
| `split` | optional: the `how` that cut the steps (`assay rm label-steps` writes it; the `prm` reward reads it back) |

PRM800K's own nested rows (`{question: {problem}, label: {steps: [{completions: [{text, rating}], chosen_completion}]}}`)
are read too: the chosen completion of each step (or the human's), up to and including the
first step the labeller rated −1. The neutral rating counts as not wrong, as ProcessBench and
"Let's Verify Step by Step" (Lightman et al., arXiv 2305.20050) do when they score a step as
correct or not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable

from assay.errors import AssayError

#: PRM800K rating → label: a neutral step is not a wrong one
RATING_LABEL = {-1: 0.0, 0: 1.0, 1: 1.0}


@dataclass(frozen=True)
class Step:
    """One step of a completion: `text == completion[start:end]`."""

    text: str
    start: int
    end: int


def _splitter(how: str) -> Callable[[str], list[tuple[int, int]]]:
    """The function `text -> [(start, end)]` that `how` names."""
    if how == "newline":
        return lambda text: _by_marker(text, "\n")
    if how.startswith("chars:"):
        try:
            n = int(how[6:])
        except ValueError:
            n = 0
        if n < 1:
            raise AssayError(f"step split {how!r}: chars:N needs a whole number N >= 1, for example chars:1")
        return lambda text: [(i, min(i + n, len(text))) for i in range(0, len(text), n)]
    if re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", how):
        from assay.registry import load_path

        return load_path(how, "step splitter")  # type: ignore[return-value]
    if not how:
        raise AssayError("step split '': give newline, chars:N, a marker such as '\\n\\n' or 'Step', or a module:function")
    return lambda text: _by_marker(text, how)


def _by_marker(text: str, marker: str) -> list[tuple[int, int]]:
    """Spans between occurrences of `marker`; a marker that does not end in whitespace (`Step`) starts its step."""
    keep = not marker[-1].isspace()
    cuts = [m.start() for m in re.finditer(re.escape(marker), text)]
    spans, start = [], 0
    for c in cuts:
        spans.append((start, c))
        start = c if keep else c + len(marker)
    spans.append((start, len(text)))
    return spans


def split_steps(text: str, how: str = "newline") -> list[Step]:
    """The steps of `text` with their character spans, whitespace-only steps dropped.

    Args:
        text: a completion.
        how: `newline`, `chars:N`, a marker string, or a `module:function` returning `(start, end)` spans.
    Returns:
        `[Step(text, start, end)]` in order, each stripped of surrounding whitespace (the span too).

    >>> [(s.text, s.start, s.end) for s in split_steps("a=1\\n\\nb=2\\n")]
    [('a=1', 0, 3), ('b=2', 5, 8)]
    >>> [s.text for s in split_steps("Step 1: x. Step 2: y.", "Step")]
    ['Step 1: x.', 'Step 2: y.']
    """
    out = []
    for span in _splitter(how)(text):
        try:
            start, end = int(span[0]), int(span[1])
        except (TypeError, ValueError, IndexError):
            raise AssayError(f"step split {how!r} returned {span!r}; a splitter returns (start, end) pairs") from None
        if not 0 <= start <= end <= len(text):
            raise AssayError(f"step split {how!r} returned span {(start, end)} outside the text (length {len(text)})")
        piece = text[start:end]
        if not piece.strip():
            continue
        lead = len(piece) - len(piece.lstrip())
        trail = len(piece) - len(piece.rstrip())
        out.append(Step(text[start + lead : end - trail], start + lead, end - trail))
    return out


def completion_pieces(completion: str, split: str) -> tuple[list[str], list[tuple[int, int]]]:
    """The pieces `score_steps` tokenises (each from the end of the step before to the end of its own step) and the steps' spans."""
    steps = split_steps(completion, split)
    pieces, prev = [], 0
    for s in steps:
        pieces.append(completion[prev : s.end])
        prev = s.end
    return pieces, [(s.start, s.end) for s in steps]


def check_split(how: str) -> str:
    """`how` if it names a splitter (one `AssayError` line otherwise)."""
    _splitter(how)
    return how


@dataclass
class StepRow:
    """A prompt, the steps of one completion, and a label in [0, 1] per step (1: the step is right).

    `completion` is `separator.join(steps)`; `first_error` is the index of the first step
    labelled below 0.5, or −1 when none is (ProcessBench's `label`).
    """

    id: str
    prompt: str | list[dict[str, Any]]
    steps: list[str]
    labels: list[float]
    separator: str = "\n"
    split: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    @property
    def completion(self) -> str:
        return self.separator.join(self.steps)

    @property
    def first_error(self) -> int:
        return next((i for i, y in enumerate(self.labels) if y < 0.5), -1)

    def pieces(self) -> list[str]:
        """The completion cut after each step: the separator goes with the step after it."""
        return [s if i == 0 else self.separator + s for i, s in enumerate(self.steps)]


def _labels(value: Any, where: str, ratings: bool) -> list[float]:
    name = "ratings" if ratings else "labels"
    if not isinstance(value, list):
        raise AssayError(f"{where}: column {name!r} must be a list, one per step, got {str(value)[:60]!r}")
    out = []
    for v in value:
        if ratings:
            if isinstance(v, bool) or v not in RATING_LABEL:
                raise AssayError(f"{where}: rating {v!r} is not a PRM800K rating (-1, 0 or 1)")
            out.append(RATING_LABEL[v])
        elif isinstance(v, bool):
            out.append(float(v))
        elif isinstance(v, (int, float)) and 0.0 <= v <= 1.0:
            out.append(float(v))
        else:
            hint = " (PRM800K's -1/0/1 ratings go in a 'ratings' column)" if v in (-1, -1.0) else ""
            raise AssayError(f"{where}: label {v!r} is not a boolean or a number in [0, 1]{hint}")
    return out


def _prm800k(row: dict[str, Any], where: str) -> tuple[Any, list[str], list[float]]:
    """`(prompt, steps, labels)` of a raw PRM800K row: the chosen (or human) completion of each step, up to the first −1."""
    steps, labels = [], []
    for i, s in enumerate((row.get("label") or {}).get("steps") or []):
        comps = s.get("completions") or []
        pick = s.get("human_completion") or (comps[s["chosen_completion"]] if s.get("chosen_completion") is not None else None)
        if pick is None:  # the labeller stopped here: the first completion rated −1 is the wrong step
            pick = next((c for c in comps if c.get("rating") == -1), None)
            if pick is None:
                break
        rating = pick.get("rating")
        steps.append(str(pick.get("text", "")))
        labels.append(RATING_LABEL.get(rating, 1.0) if rating is not None else 1.0)  # a human-written step has no rating: it is right
        if labels[-1] == 0.0:
            break
    if not steps:
        raise AssayError(f"{where}: a PRM800K row without labelled steps")
    return row["question"]["problem"], steps, labels


def rows_to_steps(rows: list[dict[str, Any]], source: str, separator: str = "\n") -> list[StepRow]:
    """Step-labelled rows (see the module doc); a bad row is one `AssayError` line naming the file and the row."""
    from assay.data.datasets import check_messages

    out = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i + 1}"
        if isinstance(row.get("question"), dict) and isinstance(row.get("label"), dict):
            prompt, steps, labels = _prm800k(row, where)
        else:
            key = next((k for k in ("prompt", "problem", "question") if k in row), None)
            if key is None:
                raise AssayError(f"{where} has no prompt column (prompt, problem or question)")
            prompt, steps = row[key], row.get("steps")
            if not isinstance(steps, list) or not steps or not all(isinstance(s, str) for s in steps):
                raise AssayError(f"{where}: column 'steps' must be a non-empty list of strings, got {str(steps)[:60]!r}")
            if "labels" in row:
                labels = _labels(row["labels"], where, ratings=False)
            elif "ratings" in row:
                labels = _labels(row["ratings"], where, ratings=True)
            else:
                raise AssayError(f"{where} has neither 'labels' (booleans or [0, 1]) nor 'ratings' (PRM800K's -1/0/1)")
            if len(labels) != len(steps):
                raise AssayError(f"{where}: {len(steps)} steps but {len(labels)} labels")
        if not isinstance(prompt, str):
            prompt = check_messages(prompt, where)
        sep = row.get("separator", separator)
        if not isinstance(sep, str):
            raise AssayError(f"{where}: 'separator' must be text, got {sep!r}")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "problem", "question", "steps", "labels", "ratings", "separator", "split", "label", "id")}
        out.append(StepRow(str(row.get("id", i)), prompt, list(steps), labels, sep, row.get("split"), extra))
    if not out:
        raise AssayError(f"{source}: no rows (a step-labelled file needs prompt, steps and labels columns)")
    return out


def read_step_rows(path: str, separator: str = "\n") -> list[StepRow]:
    """The step-labelled rows of a JSONL/Parquet file or `datasets` folder."""
    from assay.data.datasets import read_rows

    return rows_to_steps(read_rows(path), path, separator)


def read_processbench(path: str, separator: str = "\n") -> list[StepRow]:
    """ProcessBench rows `{problem, steps, label}` (`label`: index of the first wrong step, −1 when none), as `StepRow`s.

    Steps before `label` are labelled 1, the step at `label` 0 and those after it 0 (a step
    after an error is not judged; only the first error is measured). Step-labelled rows are
    read as they are.
    """
    from assay.data.datasets import read_rows

    rows = read_rows(path)
    converted = []
    for i, row in enumerate(rows):
        if "label" in row and not isinstance(row.get("label"), dict) and "labels" not in row and "ratings" not in row:
            lab, steps = row["label"], row.get("steps")
            if isinstance(lab, bool) or not isinstance(lab, int) or not isinstance(steps, list) or not -1 <= lab < len(steps):
                raise AssayError(f"{path}: row {i + 1}: 'label' must be -1 or the index of a step (0..{len(steps) - 1 if isinstance(steps, list) else '?'}), "
                                 f"got {lab!r}")
            row = {**row, "labels": [1.0 if lab == -1 or j < lab else 0.0 for j in range(len(steps))]}
        converted.append(row)
    return rows_to_steps(converted, path, separator)
