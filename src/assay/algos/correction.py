"""Rollout/trainer mismatch correction: importance weights between the sampler and the trainer.

The inference engine (vLLM, the in-process sampler) and the trainer compute slightly
different logprobs for the same tokens (kernels, precision, batch shapes), so a rollout
is mildly off-policy for the policy being trained. `mismatch_correction` turns the two
sets of logprobs into per-token weights that multiply the per-token policy loss before
aggregation, and reports the size of the mismatch.
"""

from __future__ import annotations

import torch


def mismatch_correction(
    trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, mask: torch.Tensor,
    mode: str = "tis", cap: float = 2.0, floor: float = 0.0, level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance weights w = π_trainer / π_sampler, truncated (TIS) or masked (MIS).

    ρ_t = exp(log π_trainer(y_t) − log π_sampler(y_t)), or at `level="sequence"` one
    ρ_i = exp(Σ_t …) per response broadcast over its tokens.
    - `tis`: w = min(ρ, cap). Yao et al., "Your Efficient RL Framework Secretly Brings You
      Off-Policy RL Training" (2025), https://fengyao.notion.site/off-policy-rl.
    - `mis`: w = ρ where floor ≤ ρ ≤ cap, else 0 (the token or sequence leaves the loss).
      Liu et al., "When Speed Kills Stability: Demystifying RL Collapse from the
      Training-Inference Mismatch" (2025).
    Use: `loss_mat = loss_mat * weights` before `aggregate`.

    Args:
        trainer_logprobs: `[B, T]` the trainer's logprobs of the sampled tokens under the
            sampling-time weights (π_old as the trainer computes it).
        sampler_logprobs: `[B, T]` the inference engine's logprobs of the same tokens.
        mask: `[B, T]`.
        mode: "tis" or "mis". cap, floor: the bounds on ρ (floor only for "mis").
        level: "token" or "sequence".
    Returns:
        `(weights [B, T], metrics)`; weights are detached and 0 on padding. Metrics:
        `mismatch/k1` and `mismatch/k3` (estimates of KL(sampler ‖ trainer) per token),
        `mismatch/ratio_mean`, `mismatch/ratio_max`, `mismatch/corrected_frac` (the
        share of tokens whose weight was truncated (tis) or masked (mis)),
        `mismatch/weight_mean` (mean weight over tokens), `mismatch/abs_diff_mean` and
        `mismatch/abs_diff_max` (the mean and largest |log π_trainer − log π_sampler| of a token).

    >>> w, m = mismatch_correction(torch.tensor([[0.0, -1.0]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2))
    >>> [round(x, 4) for x in w[0].tolist()], round(m["mismatch/weight_mean"], 4), m["mismatch/abs_diff_max"]
    ([1.0, 0.3679], 0.6839, 1.0)
    """
    if mode not in ("tis", "mis"):
        raise ValueError(f"mismatch mode must be 'tis' or 'mis', not {mode!r}")
    if level not in ("token", "sequence"):
        raise ValueError(f"mismatch level must be 'token' or 'sequence', not {level!r}")
    m = mask.bool()
    zeros = torch.zeros_like(trainer_logprobs)
    log_ratio = torch.where(m, (trainer_logprobs - sampler_logprobs).detach(), zeros)  # [B, T]
    if level == "sequence":
        log_ratio = torch.where(m, log_ratio.sum(-1, keepdim=True).expand_as(log_ratio), zeros)
    ratio = torch.exp(log_ratio.clamp(max=20.0))
    if mode == "tis":
        weights = ratio.clamp(max=cap)
        corrected = ratio > cap
    else:
        corrected = (ratio > cap) | (ratio < floor)
        weights = torch.where(corrected, zeros, ratio)
    weights = torch.where(m, weights, zeros)
    n = m.sum().clamp(min=1)
    x = torch.where(m, (sampler_logprobs - trainer_logprobs).detach(), zeros)  # log(sampler/trainer)
    metrics = {
        "mismatch/k1": float(x.sum() / n),
        "mismatch/k3": float(torch.where(m, torch.exp(-x) - 1 + x, zeros).sum() / n),
        "mismatch/ratio_mean": float(torch.where(m, ratio, zeros).sum() / n),
        "mismatch/ratio_max": float(ratio[m].max()) if m.any() else 1.0,
        "mismatch/corrected_frac": float((corrected & m).sum() / n),
        "mismatch/weight_mean": float(weights.sum() / n),
        "mismatch/abs_diff_mean": float(x.abs().sum() / n),
        "mismatch/abs_diff_max": float(x.abs().max()) if m.any() else 0.0,
    }
    return weights, metrics
