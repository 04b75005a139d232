"""The reward protocol: a batch of trajectories in, one `RewardResult` each out.

A reward is a picklable callable class (so it can run in worker processes), registered
by name in `REWARDS` or loadable from a `module:attr` path. Subclasses implement
`score` for one trajectory; `__call__` maps it over the batch. A reward that raises for
one sample gives that sample a failed result with the reason; the batch goes on.

    >>> from assay.types import Sample, Trajectory
    >>> class Exact(Reward):
    ...     def score(self, t):
    ...         return RewardResult(float(t.completion.strip() == t.sample.answer))
    >>> t = Trajectory(Sample("0", "1+1=", "2"), "2", [], [], [], True)
    >>> Exact()([t])[0].score
    1.0
"""

from __future__ import annotations

import abc
import time
from typing import Any

from assay.registry import Registry
from assay.types import RewardResult, Trajectory


class Reward(abc.ABC):
    """Base class of every reward. `kind` tells the executor how to run it."""

    #: "cpu" for CPU-bound rule rewards (worker processes: isolation, per-item deadlines), "io" for rewards
    #: that wait on a server, "batch" for rewards that score a whole batch in one call in the caller's process:
    #: model judges (they bound their own time) and learned reward models (batched forwards, `rm`, `prm`).
    kind: str = "cpu"
    #: True when a score is a verdict: 1 (or more) means right, less means not (verifiers, rule rewards and
    #: compositions of them). False for a score on a scale of its own (a reward model, a judge, a rubric's
    #: weighted sum): accuracy never counts it as right or wrong (`gives_verdicts`).
    verdict: bool = True

    @abc.abstractmethod
    def score(self, traj: Trajectory) -> RewardResult:
        """Score one trajectory."""

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        return [score_safely(self, t) for t in batch]

    def hparams(self) -> dict[str, Any]:
        """Hyperparameters, readable for logging."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def warm(self) -> None:
        """Load what scoring needs (a model, say) now: a worker calls it once, before its first item's deadline starts."""


def score_safely(reward: Reward, traj: Trajectory) -> RewardResult:
    """`reward.score(traj)`, with an exception turned into a failed result."""
    start = time.perf_counter()
    try:
        result = reward.score(traj)
    except Exception as e:  # a reward bug fails one item, never the batch
        return RewardResult.failed(f"{type(e).__name__}: {e}")
    result.info.setdefault("seconds", round(time.perf_counter() - start, 6))
    return result


REWARDS: Registry[type[Reward]] = Registry("reward")
