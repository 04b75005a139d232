"""The reward side of a training run: the run's reward block behind one executor."""

from __future__ import annotations

from assay.errors import AssayError
from assay.rewards.executor import RewardExecutor
from assay.rewards.monitors import reward_health
from assay.rewards.spec import build_reward


class TrainingRewards:
    """Scores trajectories with the run's reward and reports reward-health metrics."""

    def __init__(self, reward, workers: int, timeout: float):
        self.executor = RewardExecutor(reward, workers=workers, timeout=timeout)
        self._pending: dict[str, float] = {}

    def score(self, batch):
        """Score training rollouts; counted in the next `health()`."""
        return self.executor.score(batch)

    def __call__(self, batch):
        """Score evaluation rollouts; not counted in the training metrics."""
        self._pending = _merge(self._pending, self.executor.stats())
        results = self.executor.score(batch)
        self.executor.stats()  # drop the evaluation's counts
        return results

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
