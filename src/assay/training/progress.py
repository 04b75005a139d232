"""A live progress bar for training runs (rich), showing reward and accuracy."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _f(v: Any) -> str:
    return "–" if v is None else f"{v:.3f}"


class RunProgress:
    """`with RunProgress(total, start) as bar: bar.update(step, metrics)`."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
            console=Console(file=sys.stderr), disable=not enabled, transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")

    def __enter__(self) -> "RunProgress":
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def note(self, message: str) -> None:
        """One line above the bar (or on stderr when the bar is off)."""
        if self.enabled:
            self.progress.console.print(message)
        else:
            print(message, file=sys.stderr, flush=True)

    def update(self, step: int, m: dict[str, Any]) -> None:
        held = f"held-out {_f(m.get('eval/accuracy'))}" if "eval/accuracy" in m or "eval/mean_reward" not in m else f"held-out reward {_f(m['eval/mean_reward'])}"
        info = f"reward {_f(m.get('reward/mean'))}  acc {_f(m.get('train/accuracy'))}  {held}"
        self.progress.update(self.task, completed=step, info=info)
