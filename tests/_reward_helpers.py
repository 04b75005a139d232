"""Small rewards that misbehave on purpose, importable by worker processes."""

from __future__ import annotations

import os
import time

from assay.rewards.base import Reward
from assay.types import RewardResult, Sample, Trajectory


def traj(completion, answer=None, **fields) -> Trajectory:
    """A trajectory with just the text fields set."""
    return Trajectory(Sample("s", "prompt", answer, dict(fields)), completion, [], list(range(len(completion) if isinstance(completion, str) else 0)), [], True)


class Misbehave(Reward):
    """Scores by the completion: 'raise', 'hang', 'crash' misbehave; anything else scores its length."""

    def score(self, t):
        c = t.completion
        if c == "raise":
            raise RuntimeError("boom")
        if c == "hang":
            while True:
                time.sleep(0.05)
        if c == "crash":
            os._exit(3)
        return RewardResult(float(len(c)))


class FailsToLoad(Reward):
    """Pickles fine but cannot be unpickled (as when a worker lacks a dependency)."""

    def __init__(self):
        self.x = 1

    def __setstate__(self, state):
        raise ImportError("no module named 'missing_dependency'")

    def score(self, t):
        return RewardResult(1.0)
