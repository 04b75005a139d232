"""`assay reward score` and `assay reward list`: score a JSONL file, list the rewards.

Input rows carry `prompt`, `completion`, `answer` and any other fields a reward asks for
by name (they land in `Sample.fields`); `id` is copied when present, else the row number
is used. Output rows: `{id, score, components, info, error}`, one per input row, in order.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Iterator

from assay.data.datasets import iter_jsonl
from assay.errors import AssayError
from assay.rewards.base import REWARDS
from assay.rewards.executor import RewardExecutor
from assay.rewards.spec import build_reward, load_builtins
from assay.types import RewardResult, Sample, Trajectory

_ROW_KEYS = ("id", "prompt", "completion", "answer")


def read_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """`(line number, row)` for each JSONL row to score; AssayError names a bad line. Bytes that are not UTF-8 (a model's
    output cut inside a character) are read as replacement characters: the row is scored, not refused."""
    for n, row in iter_jsonl(path, strict=False):
        if "completion" not in row:
            raise AssayError(f"{path}:{n}: missing field 'completion' (rows need prompt, completion, answer)")
        yield n, row


def row_to_traj(row: dict[str, Any], index: int) -> Trajectory:
    """A trajectory for one input row; extra fields go to `sample.fields`.

    A prompt may be a list of chat messages (kept as the conversation); a completion may
    be a list of messages too (TRL's conversational layout), whose assistant text is read.
    """
    rid = str(row.get("id", index))
    fields = {k: v for k, v in row.items() if k not in _ROW_KEYS}
    prompt = row.get("prompt", "")
    sample = Sample(rid, prompt if isinstance(prompt, list) else str(prompt), row.get("answer"), fields)
    ids = row.get("completion_ids") or []
    comp = row["completion"]
    if isinstance(comp, list) and all(isinstance(m, dict) for m in comp):
        comp = "".join(str(m.get("content", "")) for m in comp if m.get("role", "assistant") == "assistant")
    return Trajectory(sample, comp if isinstance(comp, str) else json.dumps(comp), [], list(ids), [], True, int(row.get("group", 0) or 0))


def result_row(rid: Any, r: RewardResult) -> dict[str, Any]:
    """The output row for one result (NaN and infinities become null)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, (str, int, bool)) or x is None or isinstance(x, float):
            return x
        return str(x)

    row = {"id": rid, "score": clean(r.score), "components": clean(r.components), "info": clean(r.info), "error": r.error}
    if r.steps is not None:
        row["steps"] = clean(r.steps)
    return row


def score_file(spec: str, input_path: str, output_path: str, workers: int = 2, timeout: float = 5.0, batch_size: int = 256) -> dict[str, Any]:
    """Score every row of `input_path` with reward `spec`, write `output_path`, return the summary.

    The summary (also printed to stderr as a table): count, mean (over scored rows),
    failures, none, timeouts, seconds and items_per_s.
    """
    reward = build_reward(spec)
    count, total, scored, failures, nones = 0, 0.0, 0, 0, 0
    start = time.perf_counter()
    try:
        out = open(output_path, "w", encoding="utf-8")
    except OSError as e:
        raise AssayError(f"cannot write {output_path}: {e.strerror}") from None
    timeouts = 0
    with out, RewardExecutor(reward, workers=workers, timeout=timeout) as ex:
        buf: list[tuple[Any, Trajectory]] = []

        def flush() -> None:
            nonlocal count, total, scored, failures, nones
            results = ex.score([t for _, t in buf])
            for (rid, _), r in zip(buf, results):
                out.write(json.dumps(result_row(rid, r), ensure_ascii=True) + "\n")
                count += 1
                failures += r.error is not None
                if r.score is None:
                    nones += 1
                elif r.error is None:
                    scored += 1
                    total += r.score
            buf.clear()

        for index, (_, row) in enumerate(read_rows(input_path)):
            buf.append((row.get("id", index), row_to_traj(row, index)))
            if len(buf) >= batch_size:
                flush()
                timeouts += int(ex.stats()["reward/executor/timeouts"])
        if buf:
            flush()
        timeouts += int(ex.stats()["reward/executor/timeouts"])
    seconds = time.perf_counter() - start
    summary = {"count": count, "mean": total / scored if scored else None, "failures": failures, "none": nones, "timeouts": timeouts, "seconds": round(seconds, 3), "items_per_s": round(count / seconds, 1) if seconds > 0 else 0.0}
    print_summary(summary, spec)
    return summary


def print_summary(summary: dict[str, Any], title: str) -> None:
    """The summary as a rich table on stderr."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"reward {title}")
    for k in ("count", "mean", "failures", "none", "timeouts", "items_per_s"):
        table.add_column(k, justify="right")
    mean = summary["mean"]
    table.add_row(*(str(summary[k]) if k != "mean" else ("-" if mean is None else f"{mean:.4f}") for k in ("count", "mean", "failures", "none", "timeouts", "items_per_s")))
    Console(file=sys.stderr).print(table)


def list_rewards() -> list[tuple[str, str]]:
    """`(name, one-line doc)` for every registered reward, sorted by name."""
    load_builtins()
    out = []
    for name, cls in REWARDS.items():
        doc = (getattr(cls, "__doc__", None) or "").strip().splitlines()
        out.append((name, doc[0] if doc else ""))
    return out
