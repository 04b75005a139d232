"""assay: reinforcement-learning post-training of language models, with rewards as first-class citizens.

The Python API (`assay.api`), the configuration and the plugin protocols:

    from assay import RunConfig, evaluate, score, train

    result = train({"train": {"steps": 20}}, "rollout.group_size=8")
    print(result.final["held-out accuracy at end"])
    print(evaluate(str(result.model), task="arithmetic", n=200, k=0)["accuracy"])
    print(score("math", [{"completion": r"\\boxed{4}", "answer": "4"}])[0].score)

`import assay` is light: torch and the trainer load when a name that needs them is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from assay.errors import AssayError
from assay.types import RewardResult, Sample, Trajectory

__version__ = "0.1.0"

#: name → module that defines it (imported on first use)
_LAZY = {
    "train": "assay.api", "evaluate": "assay.api", "score": "assay.api", "run_config": "assay.api",
    "RunConfig": "assay.config", "RunResult": "assay.training.runs",
    "Reward": "assay.protocols", "AdvantageEstimator": "assay.protocols", "PolicyLoss": "assay.protocols", "Sampler": "assay.protocols",
    "SamplingParams": "assay.protocols", "Extra": "assay.training.extras",
    "REWARDS": "assay.rewards.base", "ADVANTAGES": "assay.algos", "POLICY_LOSSES": "assay.algos", "SAMPLERS": "assay.rollout.base",
    "EXTRAS": "assay.training.extras", "declare": "assay.algos.advantages",
}

if TYPE_CHECKING:
    from assay.algos import ADVANTAGES, POLICY_LOSSES
    from assay.algos.advantages import declare
    from assay.api import evaluate, run_config, score, train
    from assay.config import RunConfig
    from assay.protocols import AdvantageEstimator, PolicyLoss, Reward, Sampler, SamplingParams
    from assay.rewards.base import REWARDS
    from assay.rollout.base import SAMPLERS
    from assay.training.extras import EXTRAS, Extra
    from assay.training.runs import RunResult


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'assay' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["train", "evaluate", "score", "run_config", "RunConfig", "RunResult", "Reward", "RewardResult", "Sample", "Trajectory",
           "AdvantageEstimator", "PolicyLoss", "Sampler", "SamplingParams", "Extra", "REWARDS", "ADVANTAGES", "POLICY_LOSSES",
           "SAMPLERS", "EXTRAS", "declare", "AssayError"]
