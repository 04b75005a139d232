"""The reward side of a training run: the run's reward block behind one executor."""

from __future__ import annotations

from assay.errors import AssayError
from assay.rewards.executor import RewardExecutor
from assay.rewards.monitors import reward_health
from assay.rewards.spec import build_reward


class TrainingRewards:
    """Scores trajectories with the run's reward and reports reward-health metrics.

    Every caller says whether its trajectories count toward the training metrics: the
    step's rollouts do (`training=True`); held-out evaluation and the references that
    ground-truth injection checks do not. `scorer(training)` is the same as a plain
    `trajectories -> results` function, for code that takes one (`assay.eval.policy.evaluate`).
    """

    def __init__(self, reward, workers: int, timeout: float):
        self.executor = RewardExecutor(reward, workers=workers, timeout=timeout)
        self._pending: dict[str, float] = {}

    def score(self, batch, *, training: bool):
        """One result per trajectory; with `training`, counted in the next `health()`."""
        if training:
            return self.executor.score(batch)
        self._pending = _merge(self._pending, self.executor.stats())
        results = self.executor.score(batch)
        self.executor.stats()  # drop these counts
        return results

    def scorer(self, training: bool):
        """`score` as a function of the trajectories alone."""
        return lambda batch: self.score(batch, training=training)

    def health(self, results, trajs) -> dict[str, float]:
        """`reward_health` of one step plus the executor's failure counts."""
        m = reward_health(results, [t.group for t in trajs], [len(t.completion_ids) for t in trajs])
        m.update(_merge(self._pending, self.executor.stats()))
        self._pending = {}
        return m

    def close(self) -> None:
        self.executor.close()


def _merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Add two counter dicts (rates are taken from the newer one)."""
    return {k: b.get(k, 0.0) if k.endswith("_per_s") else a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


def make_executor(cfg, task_reward: str | None) -> TrainingRewards:
    """The run's reward block (default: the task's own verifier) behind a `RewardExecutor`."""
    spec = cfg.reward or task_reward
    if spec is None:
        raise AssayError("reward: this data has no built-in verifier; set a reward block (reward=NAME, see docs/rewards.md)")
    return TrainingRewards(build_reward(spec), cfg.reward_workers, cfg.reward_timeout)
