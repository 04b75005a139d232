"""Rewards: the protocol, verifiers, composition and the batch executor."""

from assay.rewards.base import REWARDS, Reward, RewardResult, score_safely
from assay.rewards import math, monitors, text, transforms  # noqa: F401  (register the built-in rewards)
from assay.rewards import code, sql  # noqa: F401  (register "code" and "sql")
from assay.rewards.executor import RewardExecutor
from assay.rewards.monitors import reward_health
from assay.rewards.spec import build_reward
from assay.rewards.transforms import TRANSFORMS

__all__ = ["REWARDS", "TRANSFORMS", "Reward", "RewardResult", "RewardExecutor", "build_reward", "reward_health", "score_safely"]
