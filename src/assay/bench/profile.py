"""Reading `py-spy record --format raw` output: where a training step spends its samples.

A raw profile has one line per distinct stack, `outer (file:line);...;inner (file:line) COUNT`.
`top_frames` keeps the samples taken inside one function (the step), folds line numbers
away, and ranks frames by the share of those samples they appear in (inclusive) and end
in (self).

    >>> import tempfile, pathlib
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "p.txt"
    >>> _ = p.write_text("main (m.py:1);step (s.py:2);gen (g.py:3) 3\\nmain (m.py:1);step (s.py:9);opt (o.py:4) 1\\nmain (m.py:1);load (l.py:5) 6\\n")
    >>> [(f, inc) for f, inc, _ in top_frames(p, "step")]
    [('step (s.py)', 1.0), ('gen (g.py)', 0.75), ('opt (o.py)', 0.25)]
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

#: the function each framework's step runs under
STEP_ROOTS = {"trl": "_inner_training_loop", "assay": "train_step"}
_LINE = re.compile(r":\d+\)$")


def _frame(raw: str) -> str:
    return _LINE.sub(")", raw.strip())


def top_frames(path: str | Path, root: str, n: int = 12, by: str = "inclusive") -> list[tuple[str, float, float]]:
    """`(frame, inclusive share, self share)` of the `n` frames under `root` with the largest share `by`.

    `root` is a function or method name (`train_step` matches `Trainer.train_step`);
    `by` is `inclusive` (on the stack) or `self` (the innermost Python frame).
    """
    inclusive, own, total = Counter(), Counter(), 0
    for line in Path(path).read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame(f) for f in stack.split(";")]
        at = next((i for i, f in enumerate(frames) if f.split(" (")[0].rpartition(".")[2] == root), None)
        if at is None:
            continue
        k = int(count)
        total += k
        for f in dict.fromkeys(frames[at:]):
            inclusive[f] += k
        own[frames[-1]] += k
    if not total:
        return []
    ranked = (inclusive if by == "inclusive" else own).most_common(n)
    return [(f, inclusive[f] / total, own[f] / total) for f, _ in ranked]
