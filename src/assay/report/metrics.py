"""Metric sinks. JSONL is always written: one object per step, flushed as it is written."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlSink:
    """Appends `{"step": n, ...}` rows to `metrics.jsonl`."""

    def __init__(self, path: Path, truncate_after: int | None = None):
        self.path = Path(path)
        if truncate_after is not None and self.path.exists():
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= truncate_after]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._f = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All rows of a metrics file (a torn last line from a kill is skipped)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
