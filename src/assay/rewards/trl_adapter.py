"""Use any assay reward as a reward function for TRL's `GRPOTrainer`.

TRL calls each reward function as `f(prompts=..., completions=..., completion_ids=...,
**dataset_columns)` and expects `list[float | None]` (None: skip this completion), where
prompts and completions are strings or, for conversational data, lists of
`{"role", "content"}` messages. `to_trl` returns a picklable callable class with that
signature (and a `__name__`, which TRL uses to name the reward in its logs):

    from trl import GRPOTrainer
    from assay.rewards.trl_adapter import to_trl
    trainer = GRPOTrainer(model=..., reward_funcs=[to_trl("math")], train_dataset=ds)  # ds has an "answer" column

TRL is not a dependency: nothing here imports it.

    >>> f = to_trl("math")
    >>> f(prompts=["1+1?", "2+2?"], completions=[r"\\boxed{2}", r"\\boxed{5}"], answer=["2", "4"])
    [1.0, 0.0]
"""

from __future__ import annotations

from typing import Any

from assay.rewards.base import Reward
from assay.rewards.executor import RewardExecutor
from assay.rewards.spec import build_reward
from assay.types import Sample, Trajectory

_TRL_ONLY = ("trainer_state", "log_extra", "log_metric", "completion_ids", "prompt_ids")


def message_text(x: Any) -> str:
    """Text of a TRL prompt/completion: a string, or the contents of a list of messages."""
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in x if not isinstance(m, dict) or m.get("role") != "system")
    return "" if x is None else str(x)


def _is_messages(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(m, dict) and "role" in m for m in x)


class TrlReward:
    """A TRL reward function `(prompts, completions, **kwargs) -> list[float | None]` around an assay reward.

    Args:
        reward: the assay reward.
        answer_field: dataset column holding the reference (falls back to "solution").
        workers, timeout, failure_score: passed to `RewardExecutor` (workers=0: inline).
    """

    def __init__(self, reward: Reward, answer_field: str = "answer", workers: int = 0, timeout: float = 5.0, failure_score: float | None = 0.0):
        self.reward, self.answer_field = reward, answer_field
        self.workers, self.timeout, self.failure_score = workers, timeout, failure_score
        self.__name__ = type(reward).__name__
        self._executor: RewardExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_executor": None}

    def trajectories(self, prompts: list[Any], completions: list[Any], kwargs: dict[str, Any]) -> list[Trajectory]:
        """One trajectory per completion, with the dataset columns as sample fields."""
        answers = kwargs.get(self.answer_field, kwargs.get("solution"))
        ids = kwargs.get("completion_ids") or [[] for _ in completions]
        cols = {k: v for k, v in kwargs.items() if k not in _TRL_ONLY and isinstance(v, (list, tuple)) and len(v) == len(completions)}
        out = []
        for i, c in enumerate(completions):
            fields = {k: v[i] for k, v in cols.items() if k not in (self.answer_field, "solution")}
            prompt = prompts[i] if prompts is not None else ""
            prompt = [dict(m) for m in prompt] if _is_messages(prompt) else message_text(prompt)  # a conversation stays one
            sample = Sample(str(i), prompt, answers[i] if answers is not None else None, fields)
            out.append(Trajectory(sample, message_text(c), [], list(ids[i] or []), [], True))
        return out

    def __call__(self, prompts: list[Any] | None = None, completions: list[Any] | None = None, **kwargs: Any) -> list[float | None]:
        completions = completions or []
        if self._executor is None:
            self._executor = RewardExecutor(self.reward, workers=self.workers, timeout=self.timeout, failure_score=self.failure_score)
        results = self._executor.score(self.trajectories(prompts or [None] * len(completions), completions, kwargs))
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            comps: dict[str, list[float]] = {}
            for r in results:
                for k, v in r.components.items():
                    comps.setdefault(k, []).append(v)
            for k, vs in comps.items():
                try:
                    log_metric(f"{self.__name__}/{k}", sum(vs) / len(vs))
                except TypeError:  # a logger with another signature: logging is optional
                    break
        return [r.score for r in results]


def to_trl(spec_or_reward: Any, **options: Any) -> TrlReward:
    """A TRL GRPOTrainer reward function for a reward spec (name, path, YAML, block) or a `Reward`."""
    reward = spec_or_reward if isinstance(spec_or_reward, Reward) else build_reward(spec_or_reward)
    return TrlReward(reward, **options)
