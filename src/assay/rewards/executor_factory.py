"""The reward side of a training run: the run's reward block behind one executor."""

from __future__ import annotations

from assay.errors import AssayError
from assay.rewards.executor import RewardExecutor, gives_verdicts
from assay.rewards.monitors import reward_health
from assay.rewards.spec import build_reward


class TrainingRewards:
    """Scores trajectories with the run's reward and reports reward-health metrics.

    Every caller says whether its trajectories count toward the training metrics: the
    step's rollouts do (`training=True`); held-out evaluation and the references that
    ground-truth injection checks do not. `scorer(training)` is the same as a plain
    `trajectories -> results` function, for code that takes one (`assay.eval.policy.evaluate`).
    """

    def __init__(self, reward, workers: int, timeout: float, verifier=None, executor: RewardExecutor | None = None):
        self.executor = executor if executor is not None else RewardExecutor(reward, workers=workers, timeout=timeout)
        self.verdicts = gives_verdicts(reward)
        self.verifier = RewardExecutor(verifier, workers=0, timeout=timeout) if verifier is not None and not self.verdicts else None
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

    def heldout_scorers(self):
        """`(verifier, reward)` for held-out evaluation (`assay.eval.policy.evaluate`): the run's reward as the
        verifier when its scores are verdicts; else the data's own verifier (None when it has none), with the
        run's reward beside it for the mean reward. Neither counts toward the training metrics."""
        if self.verdicts:
            return self.scorer(False), None
        return (self.verifier.score if self.verifier is not None else None), self.scorer(False)

    def health(self, results, trajs) -> dict[str, float]:
        """`reward_health` of one step plus the executor's failure counts."""
        m = reward_health(results, [t.group for t in trajs], [len(t.completion_ids) for t in trajs])
        m.update(_merge(self._pending, self.executor.stats()))
        self._pending = {}
        return m

    def close(self) -> None:
        self.executor.close()
        if self.verifier is not None:
            self.verifier.close()


def _merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Add two counter dicts (rates are taken from the newer one)."""
    return {k: b.get(k, 0.0) if k.endswith("_per_s") else a.get(k, 0.0) + b.get(k, 0.0) for k in {*a, *b}}


def make_executor(cfg, task_reward: str | None) -> TrainingRewards:
    """The run's reward block (default: the task's own verifier) behind a `RewardExecutor`; the task's
    verifier checks held-out answers when the run's reward gives no verdicts (a reward model)."""
    spec = cfg.reward or task_reward
    if spec is None:
        raise AssayError("reward: this data has no built-in verifier; set a reward block (reward=NAME, see docs/rewards.md)")
    verifier = build_reward(task_reward) if task_reward is not None and cfg.reward is not None else None
    reward = build_reward(spec)
    executor = None
    cluster = getattr(cfg, "cluster", None)
    if cluster is not None and cluster.ray and cluster.reward_workers:  # the reward's CPU work on Ray actors (assay.cluster)
        from assay.cluster import RayRewardExecutor, connect

        connect(cluster)
        executor = RayRewardExecutor(reward, cluster.reward_workers, cfg.reward_workers, cfg.reward_timeout, cluster.cpus_per_worker,
                                     key=f"assay-{cfg.run_name or 'run'}")
    return TrainingRewards(reward, cfg.reward_workers, cfg.reward_timeout, verifier, executor)
