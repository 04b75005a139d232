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


class SlowToLoad(Reward):
    """Needs 2 s of loading (a model, say) before it can score: in `warm`, or else at its first item."""

    def __init__(self):
        self._loaded = False

    def warm(self):
        time.sleep(2.0)
        self._loaded = True

    def score(self, t):
        if not self._loaded:
            self.warm()
        return RewardResult(1.0)


class RandomSteps(Reward):
    """A process reward for tests: the completion split in two steps, each scored 0/1 at random.

    Deterministic per (prompt id, completion), like the `random` control reward; the outcome
    score is the last step's, so process estimators see real per-step signal.
    """

    def score(self, t):
        import hashlib

        text = t.completion
        cut = max(1, len(text) // 2)
        spans = [(0, cut), (cut, max(cut, len(text)))]
        bits = hashlib.blake2b(f"{t.sample.id}\0{text}".encode(), digest_size=2).digest()
        steps = [float(bits[0] & 1), float(bits[1] & 1)]
        return RewardResult(steps[-1], steps=steps, spans=spans)


class PaysForLength(Reward):
    """A reward a policy can hack: the completion's length in tokens over `cap` (at most 1), whatever it says."""

    verdict = False

    def __init__(self, cap: int = 6):
        self.cap = cap

    def score(self, t):
        return RewardResult(min(len(t.completion_ids), self.cap) / self.cap)
