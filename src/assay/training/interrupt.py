"""Stopping a run on Ctrl-C or SIGTERM without losing or corrupting anything.

A training step has two halves. Generating and scoring rollouts changes no weights, so a
signal there stops the run at once: the trainer puts back the data, sampling and RNG state
of the step's start and saves a checkpoint equal to the last finished step. The update,
the evaluation, the metric row and the checkpoint that follow change weights and files, so
a signal there is held until they are done (a *critical section*); the run then saves and
stops. A second Ctrl-C inside a critical section stops at once, keeping only what was
already saved. Either way a resumed run continues exactly where the saved step ended.

SIGTERM is how schedulers and clusters preempt a job: it is treated like Ctrl-C and ends
in `Preempted`, so the command exits 143 (128 + SIGTERM) after saving.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable, Iterator


class Preempted(Exception):
    """The run was asked to stop by a signal other than SIGINT (SIGTERM: preemption)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class StopSignals:
    """Turns SIGINT/SIGTERM into exceptions at safe points (see the module docstring).

    Use as a context manager around the run; wrap what must not be torn in `critical()`.
    Off the main thread (signals cannot be caught there) it installs nothing.

    Args:
        notify: called with a one-line message when a signal is held for a critical section.
    """

    def __init__(self, notify: Callable[[str], None] | None = None):
        self.notify = notify or (lambda msg: None)
        self.pending: int | None = None  # a signal held until the critical section ends
        self.torn = False  # True when a second signal broke into a critical section
        self._depth = 0
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum: int, frame) -> None:
        if self._depth > 0 and self.pending is None:
            self.pending = signum
            self.notify(f"{signal.Signals(signum).name}: finishing this step, then saving a checkpoint (Ctrl-C again stops at once, without it)")
            return
        if self._depth > 0:
            self.torn = True
        raise self.exception(signum)

    @staticmethod
    def exception(signum: int) -> BaseException:
        return KeyboardInterrupt() if signum == signal.SIGINT else Preempted(signum)

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """Hold signals until the block ends (nested blocks are fine)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def raise_pending(self) -> None:
        """Raise the held signal's exception, if one arrived during a critical section."""
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise self.exception(signum)
