"""The shapes of the plugins assay calls, in one place for type checkers and readers.

- `Reward` (`assay.rewards.base`): a picklable class; `score(traj) -> RewardResult`, and
  `__call__(batch)` maps it. Register with `@REWARDS.register(NAME)` or give `module:attr`.
- `AdvantageEstimator`: `(rewards [B], group [B], mask [B, T], **extras, **hyperparameters) -> [B, T]`,
  with `needs` naming the extras (`@declare(needs=...)`); register in `ADVANTAGES`.
- `PolicyLoss`: `(logprobs [B, T], old_logprobs [B, T], advantages [B, T], mask [B, T], **hyperparameters)
  -> (loss [B, T], metrics)`; register in `POLICY_LOSSES`.
- `Extra` (`assay.training.extras`): makes one extra an estimator declared, `__call__(step) -> value`;
  register in `EXTRAS`.
- `Sampler` (`assay.rollout.base`): a generation backend, `generate(samples, n, params, generator)
  -> trajectories`, plus `update_weights`, `sleep`, `wake`, `close`; register in `SAMPLERS`.

docs/architecture.md ("Where new work plugs in") shows each with its test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from assay.rewards.base import Reward
from assay.rollout.base import Sampler, SamplingParams

if TYPE_CHECKING:
    import torch


@runtime_checkable
class AdvantageEstimator(Protocol):
    """`(rewards [B], group [B], mask [B, T], **extras, **hyperparameters) -> advantages [B, T]`."""

    needs: frozenset[str]

    def __call__(self, rewards: "torch.Tensor", group: "torch.Tensor", mask: "torch.Tensor", **kwargs: Any) -> "torch.Tensor": ...


@runtime_checkable
class PolicyLoss(Protocol):
    """`(logprobs, old_logprobs, advantages, mask [B, T], **hyperparameters) -> (loss [B, T], metrics)`."""

    def __call__(self, logprobs: "torch.Tensor", old_logprobs: "torch.Tensor", advantages: "torch.Tensor", mask: "torch.Tensor",
                 **kwargs: Any) -> "tuple[torch.Tensor, dict[str, float]]": ...


__all__ = ["Reward", "AdvantageEstimator", "PolicyLoss", "Sampler", "SamplingParams"]  # Extra: assay.training.extras (imports torch)
