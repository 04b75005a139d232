"""The reward-model objective as pure tensor functions: Bradley–Terry, margin, centering, length.

`N` is the number of pairs in a batch. Each term is its own function so a test can check it
against a hand computation; `rm_loss` adds them with their coefficients.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bt_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float | torch.Tensor = 0.0) -> torch.Tensor:
    """Bradley–Terry negative log-likelihood of each pair: −log σ(r_c − r_r − m).

    P(chosen ≻ rejected) = σ(r_c − r_r) (Bradley & Terry, "Rank Analysis of Incomplete Block
    Designs", 1952), the reward-model objective of "Training language models to follow
    instructions with human feedback" (Ouyang et al., arXiv 2203.02155). A margin m > 0
    asks the chosen reward to clear the rejected one by m, as Llama 2's reward models do
    ("Llama 2: Open Foundation and Fine-Tuned Chat Models", arXiv 2307.09288).

    Args:
        chosen: r_c `[N]`; rejected: r_r `[N]`; margin: a number or `[N]`.
    Returns:
        `[N]` losses.

    >>> round(bt_loss(torch.tensor([1.0]), torch.tensor([0.0])).item(), 4)  # −log σ(1)
    0.3133
    """
    return -F.logsigmoid(chosen - rejected - margin)


def centering_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(r_c + r_r)² per pair: pulls each pair's mean reward to 0.

    The Bradley–Terry likelihood sees only differences, so the rewards' level drifts freely;
    this auxiliary term from "Helping or Herding? Reward Model Ensembles Mitigate but do not
    Eliminate Reward Hacking" (Eisenstein et al., arXiv 2312.09244) pins it, so rewards of
    different prompts (and of several models) share a zero.

    Args:
        chosen, rejected: `[N]`. Returns: `[N]`.

    >>> centering_loss(torch.tensor([1.0]), torch.tensor([0.5])).item()
    2.25
    """
    return (chosen + rejected) ** 2


def length_corr(rewards: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of rewards with response lengths over a batch (0 when either is constant).

    Args:
        rewards, lengths: `[M]` (every response of the batch, chosen and rejected).
    Returns:
        a scalar tensor, differentiable in `rewards`.
    """
    r = rewards - rewards.mean()
    n = lengths.to(rewards.dtype)
    n = n - n.mean()
    denom = torch.sqrt((r * r).sum() * (n * n).sum())
    if denom.item() == 0.0:
        return rewards.sum() * 0.0
    return (r * n).sum() / denom


def rm_loss(chosen: torch.Tensor, rejected: torch.Tensor, chosen_len: torch.Tensor, rejected_len: torch.Tensor, *,
            margin: float = 0.0, center_coef: float = 0.0, length_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The whole objective of a batch and its metrics.

    loss = mean_N[−log σ(r_c − r_r − m)] + η·mean_N[(r_c + r_r)²] + λ·corr(r, len)²

    The last term is a length-debiasing penalty: the squared correlation between reward and
    response length over the batch's 2N responses, the decorrelation term of "ODIN:
    Disentangled Reward Mitigates Hacking in RLHF" (Chen et al., arXiv 2402.07319) applied to
    the one reward head (ODIN's second, length-absorbing head is left out).

    Args:
        chosen, rejected: rewards `[N]`; chosen_len, rejected_len: response lengths in tokens `[N]`.
        margin: m; center_coef: η; length_coef: λ.
    Returns:
        `(loss scalar, metrics)`; metric keys are defined in docs/metrics.md (`rm/*`).
    """
    bt = bt_loss(chosen, rejected, margin).mean()
    loss = bt
    rewards = torch.cat([chosen, rejected])  # [2N]
    corr = length_corr(rewards, torch.cat([chosen_len, rejected_len]))
    center = centering_loss(chosen, rejected).mean()
    if center_coef:
        loss = loss + center_coef * center
    if length_coef:
        loss = loss + length_coef * corr**2
    diff = (chosen - rejected).detach()
    metrics = {
        "rm/loss": loss.item(),
        "rm/bt_loss": bt.item(),
        "rm/center_loss": center.item(),
        "rm/length_corr": corr.item(),
        "rm/accuracy": (diff > 0).float().mean().item(),
        "rm/margin": diff.mean().item(),
        "rm/reward_mean": rewards.detach().mean().item(),
        "rm/reward_std": rewards.detach().std().item() if rewards.numel() > 1 else 0.0,
    }
    return loss, metrics
