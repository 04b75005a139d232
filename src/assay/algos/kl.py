"""KL estimators between the policy and a reference, per token: `(logprobs, ref) -> [B, T]`.

With log-ratio x = log π(a) − log π_ref(a) on samples a ~ π (Schulman, "Approximating
KL Divergence", 2020, http://joschu.net/blog/kl-approx.html):
k1 = x (unbiased, high variance), k2 = x²/2, k3 = exp(−x) − 1 + x (unbiased, ≥ 0).
"""

from __future__ import annotations

import torch

from assay.registry import Registry

KL_ESTIMATORS: Registry = Registry("KL estimator")


@KL_ESTIMATORS.register("k1")
def k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log π − log π_ref."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = ½ (log π − log π_ref)²."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = π_ref/π − 1 − log(π_ref/π), clamped in the log domain for stability (as in GRPO)."""
    x = (ref_logprobs - logprobs).clamp(-20, 20)
    return torch.exp(x) - 1 - x


def kl_reward_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str = "k1",
) -> torch.Tensor:
    """Per-sequence KL, Σ_t k(log π_t, log π_ref,t) over response tokens, for use as a reward penalty.

    Subtract `β ×` this from the rewards before the advantage estimator (`rewards −
    β · kl_reward_penalty(...)`), as PPO-RLHF and REINFORCE++ do, instead of adding a
    KL term to the loss. Args are `[B, T]` and detached; returns `[B]`.
    """
    kl = KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)  # [B, T]
    return torch.where(mask.bool(), kl, torch.zeros_like(kl)).sum(-1)


def future_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The future KL of each token: Σ_{k ≥ t} (log π(y_k) − log π_ref(y_k)) over response tokens.

    The causal KL return-to-go of FRPO (Future-KL Regularized Policy Optimization): subtract `β ×` it from
    the normalised advantage (estimator `frpo` does). Detached; padding gets 0.

    Args:
        logprobs, ref_logprobs: `[B, T]`.
        mask: `[B, T]`.
    Returns:
        `[B, T]`.

    >>> future_kl(torch.tensor([[-1., -1., -1.]]), torch.tensor([[-2., -1., -3.]]), torch.ones(1, 3))
    tensor([[3., 2., 2.]])
    """
    ratio = torch.where(mask.bool(), (logprobs - ref_logprobs).detach(), torch.zeros_like(logprobs))
    to_go = ratio.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask.bool(), to_go, torch.zeros_like(to_go))
