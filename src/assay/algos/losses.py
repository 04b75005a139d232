"""Policy losses (per-token matrices) and loss aggregation, as separate named steps.

A loss is `(logprobs [B, T], old_logprobs [B, T], advantages [B, T], mask [B, T], **kw)
-> (loss [B, T], metrics)`; an aggregation reduces `(loss [B, T], mask [B, T])` to a
scalar. Keeping the two apart is what lets `token-mean` GRPO and Dr. GRPO's constant
normaliser share one clipped objective.
"""

from __future__ import annotations

from typing import Annotated

import torch
from annotated_types import Gt

from assay.registry import Registry

POLICY_LOSSES: Registry = Registry("policy loss")
AGGREGATIONS: Registry = Registry("loss aggregation")


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is true (0 when there are none)."""
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def _metric_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    with torch.no_grad():
        x = torch.where(mask.bool(), x.detach().to(torch.float64), x.new_zeros((), dtype=torch.float64))
        return float(x.sum() / mask.bool().sum().clamp(min=1))


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float | None = 0.2, clip_high: float | None = 0.2, dual_clip: float | None = None, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate, with separate low/high epsilons and optional dual clip.

    ρ = exp(logπ − logπ_old); L = −min(ρA, clip(ρ, 1−ε_low, 1+ε_high)A). With
    `dual_clip=c` (c > 1), tokens with A < 0 are further bounded: L = min(L, −cA).
    Schulman et al., "Proximal Policy Optimization Algorithms" (2017), arXiv:1707.06347;
    clip-higher from DAPO, Yu et al. (2025), arXiv:2503.14476; dual clip from Ye et al.,
    "Mastering Complex Control in MOBA Games" (2020), arXiv:1912.09729.

    Returns the loss `[B, T]` and metrics `clip_frac` (share of tokens where the clipped
    term is the active one) and `ratio_mean`. `None` for a clip bound means the default 0.2.
    """
    clip_low = 0.2 if clip_low is None else clip_low
    clip_high = 0.2 if clip_high is None else clip_high
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)  # [B, T]
    if dual_clip is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -dual_clip * advantages), loss)
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    with torch.no_grad():
        clip_frac = masked_mean((clipped > unclipped).float(), mask).item()
        ratio_mean = masked_mean(ratio, mask).item()
    return loss, {"clip_frac": clip_frac, "ratio_mean": ratio_mean}


@POLICY_LOSSES.register("gspo")
def gspo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float | None = None, clip_high: float | None = None, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: PPO's clip applied to one length-normalised sequence ratio per response.

    s_i = exp((1/|y_i|) Σ_t (log π − log π_old)), L_i = −min(s_i A_i, clip(s_i, 1−ε_low,
    1+ε_high) A_i). Written in the token form (GSPO-token): s_{i,t} = sg(s_i) · π(y_t)/sg(π(y_t))
    has the value s_i and, with `seq-mean-token-mean` and A constant over a response, the
    gradient of the sequence objective, ∇ = −A_i s_i (1/|y_i|) Σ_t ∇log π(y_t) when unclipped.
    Zheng et al., "Group Sequence Policy Optimization" (2025), arXiv:2507.18071; default
    ε_low = 3e-4, ε_high = 4e-4 from the paper. Metrics: `clip_frac` (share of responses
    whose ratio is clipped), `seq_ratio_mean`.
    """
    clip_low = 3e-4 if clip_low is None else clip_low
    clip_high = 4e-4 if clip_high is None else clip_high
    m = mask.bool()
    log_ratio = torch.where(m, logprobs - old_logprobs, torch.zeros_like(logprobs))  # [B, T]
    seq_log_ratio = log_ratio.sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    log_s = logprobs - logprobs.detach() + seq_log_ratio.detach()[:, None]  # value s_i, gradient per token
    s = torch.exp(log_s.clamp(max=10.0))  # [B, T]
    unclipped = -advantages * s
    clipped = -advantages * s.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.where(m, torch.maximum(unclipped, clipped), torch.zeros_like(s))
    with torch.no_grad():
        has = m.any(-1)
        seq_clipped = ((clipped > unclipped) & m).any(-1).float()
        metrics = {
            "clip_frac": float(seq_clipped[has].mean()) if has.any() else 0.0,
            "seq_ratio_mean": float(seq_log_ratio[has].clamp(max=10.0).exp().mean()) if has.any() else 1.0,
        }
    return loss, metrics


@POLICY_LOSSES.register("cispo")
def cispo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    clip_low: float | None = None, clip_high: float | None = None, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO: clip the importance weight, not the update; every token keeps its gradient.

    L_t = −sg(clip(ρ_t, 1−ε_low, 1+ε_high)) · A_t · log π(y_t), ρ_t = π/π_old, so
    ∂L/∂log π = −clip(ρ)·A even where PPO would zero the gradient. MiniMax, "MiniMax-M1:
    Scaling Test-Time Compute Efficiently with Lightning Attention" (2025),
    arXiv:2506.13585. The paper sets no lower bound: default ε_low = 1 (weights ≥ 0),
    ε_high = 0.28. Metrics: `clip_frac` (share of tokens whose weight was capped), `ratio_mean`.
    """
    clip_low = 1.0 if clip_low is None else clip_low
    clip_high = 0.28 if clip_high is None else clip_high
    ratio = torch.exp(logprobs - old_logprobs).detach()  # [B, T]
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = -weight * advantages * logprobs
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    capped = (ratio > 1 + clip_high) | (ratio < 1 - clip_low)
    return loss, {"clip_frac": _metric_mean(capped.float(), mask), "ratio_mean": _metric_mean(ratio, mask)}


@POLICY_LOSSES.register("sapo")
def sapo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
    tau_pos: float = 1.0, tau_neg: float = 1.05, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO: a smooth, temperature-controlled gate on the ratio in place of the hard clip.

    L_t = −f(ρ_t) A_t with f(ρ) = (4/τ) σ(τ(ρ − 1)), τ = τ_pos if A_t > 0 else τ_neg.
    ∂L/∂log π = −A ρ · 4σ(1−σ): equal to the plain policy gradient at ρ = 1 and decaying
    smoothly as ρ leaves 1 (faster for negative advantages, τ_neg > τ_pos). Gao et al.,
    "Soft Adaptive Policy Optimization" (2025), arXiv:2511.20347; defaults τ_pos = 1,
    τ_neg = 1.05 from the paper. Metrics: `gate_weight_mean` (mean of 4σ(1−σ), 1 = no
    damping), `ratio_mean`.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # [B, T]
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = -(4 / tau) * gate * advantages
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    weight = 4 * gate * (1 - gate)
    return loss, {"gate_weight_mean": _metric_mean(weight, mask), "ratio_mean": _metric_mean(ratio, mask)}


@POLICY_LOSSES.register("reinforce")
def reinforce(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Plain REINFORCE: L_t = −A_t · log π(y_t), with no ratio and no clip (on-policy only).

    Williams, "Simple Statistical Gradient-Following Algorithms for Connectionist
    Reinforcement Learning" (1992). `old_logprobs` only feeds the `ratio_mean` metric,
    which should stay at 1; use a clipped loss when reusing a batch for several updates.
    """
    loss = torch.where(mask.bool(), -advantages * logprobs, torch.zeros_like(logprobs))
    return loss, {"ratio_mean": _metric_mean(torch.exp(logprobs - old_logprobs), mask)}


@POLICY_LOSSES.register("rwr")
def rwr(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, beta: float = 1.0,
    max_weight: float = 20.0, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Reward-weighted regression: L_t = −w · log π(y_t), w = min(exp(A/β), max_weight), w held constant.

    Maximum likelihood on the policy's own samples, each weighted by its exponentiated
    advantage: a baseline that needs no ratio and no clip (every sample pulls the policy
    toward itself, the better ones harder). Peters & Schaal, "Reinforcement Learning by
    Reward-Weighted Regression for Operational Space Control" (ICML 2007); for image
    generators, Lee et al., "Aligning Text-to-Image Models using Human Feedback" (2023),
    arXiv:2302.12192, and the RWR baseline of Black et al., "Training Diffusion Models with
    Reinforcement Learning" (DDPO, 2023), arXiv:2305.13301. Metric `weight_mean`.
    """
    weight = torch.exp(advantages.detach() / beta).clamp(max=max_weight)
    loss = torch.where(mask.bool(), -weight * logprobs, torch.zeros_like(logprobs))
    return loss, {"weight_mean": _metric_mean(weight, mask), "ratio_mean": _metric_mean(torch.exp(logprobs - old_logprobs), mask)}


@POLICY_LOSSES.register("nft")
def nft(
    velocity: torch.Tensor, old_velocity: torch.Tensor, target: torch.Tensor, t: torch.Tensor, advantages: torch.Tensor,
    mask: torch.Tensor, beta: Annotated[float, Gt(0)] = 1.0, adv_clip: Annotated[float, Gt(0)] = 5.0, **_,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DiffusionNFT: reinforcement on the forward process, flow matching toward good pictures and away from bad ones.

    Each picture's advantage becomes an optimality weight r = clip(A/a_max, −1, 1)/2 + 1/2. The policy's velocity v
    and the rollout policy's v_old make an implicit positive policy v⁺ = (1 − β)·v_old + β·v and an implicit negative
    one v⁻ = (1 + β)·v_old − β·v; the loss regresses v⁺ onto the flow-matching target where the picture was good and
    v⁻ where it was bad, both in the picture's space (x̂₀ = x_t − t·v), each term divided by its own mean absolute
    error (held constant in the gradient, measured afresh at each call, as the authors' code does):

        L = a_max/β · [r·‖x̂₀(v⁺) − x₀‖²/w⁺ + (1 − r)·‖x̂₀(v⁻) − x₀‖²/w⁻]

    At v = v_old its gradient is A times the flow-matching gradient (weighted by t²/w). Since w follows the error,
    each term grows like its norm: a picture pulls v toward where v⁺ (good) or v⁻ (bad) meets the target, 1/β of the
    way from v_old, with a strength set by A; no trust region (the optimizer steps and the KL bound a batch's move).
    Zheng et al., "DiffusionNFT: Online Diffusion Reinforcement with Forward Process" (2025),
    arXiv:2509.16117; defaults here β = 1, a_max = 5. Shapes: velocities and targets `[B, K, ...]` (K noisings of
    each picture, one per action column), `t`, `advantages` and `mask` `[B, K]`. Metrics `r_mean`, `fm_error`
    (the policy's mean squared flow-matching error).
    """
    shape = t.shape + (1,) * (velocity.dim() - t.dim())
    tt = t.view(shape)
    x0_error = lambda v: tt * (target - v)  # noqa: E731  (x̂₀ − x₀ = x_t − t·v − x₀ = t·(ε − x₀ − v))
    r = (advantages.detach().clamp(-adv_clip, adv_clip) / adv_clip) / 2 + 0.5
    old = old_velocity.detach()
    dims = tuple(range(t.dim(), velocity.dim()))
    terms = []
    for v in (beta * velocity + (1 - beta) * old, (1 + beta) * old - beta * velocity):
        err = x0_error(v)
        w = err.detach().abs().mean(dim=dims).clamp(min=1e-5)
        terms.append((err**2).mean(dim=dims) / w)
    loss = adv_clip / beta * (r * terms[0] + (1 - r) * terms[1])
    loss = torch.where(mask.bool(), loss, torch.zeros_like(loss))
    with torch.no_grad():
        fm = ((velocity.detach() - target) ** 2).mean(dim=dims)
    return loss, {"r_mean": _metric_mean(r, mask), "fm_error": _metric_mean(fm, mask)}


nft.takes = "forward_process"


def loss_reads(name: str) -> str:
    """What the policy loss `name` reads: `logprobs` (the default: `(logprobs, old_logprobs, advantages, mask)`), or
    `forward_process` (`(velocity, old_velocity, target, t, advantages, mask)`, from an image policy's `forward_process`),
    as the loss declares in its `takes` attribute."""
    return getattr(POLICY_LOSSES.get(name), "takes", "logprobs")


# a token whose advantage is 0 adds exactly zero loss and gradient under each of these, so the learner
# may leave rows with zero advantage out of the update (`assay.training.learner.skips_inert_rows`)
ppo_clip.zero_at_zero_advantage = gspo.zero_at_zero_advantage = cispo.zero_at_zero_advantage = True
sapo.zero_at_zero_advantage = reinforce.zero_at_zero_advantage = True


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
    clip: float | None = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss, per token: ½ max((V − R)², (clip(V, V_old ± c) − R)²).

    For the critic of `gae`/`evpo`; R comes from `credit.compute_gae`. `clip=None` gives
    ½ (V − R)². Schulman et al., arXiv:1707.06347 (value clipping as in OpenAI baselines).
    Returns the loss `[B, T]` (aggregate it like the policy loss) and `vf_clip_frac`.
    """
    err = (values - returns) ** 2
    if clip is None:
        loss, frac = 0.5 * err, 0.0
    else:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        err_c = (clipped - returns) ** 2
        loss = 0.5 * torch.maximum(err, err_c)
        frac = _metric_mean((err_c > err).float(), mask)
    return torch.where(mask.bool(), loss, torch.zeros_like(loss)), {"vf_clip_frac": frac}


@AGGREGATIONS.register("token-mean")
def token_mean(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """Mean over every response token in the batch (DAPO's token-level loss)."""
    return masked_mean(loss, mask)


token_mean.unit = "token"  # what the denominator counts: micro-batches scale by their share of it


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """Mean over tokens within each sequence, then over sequences (the original GRPO)."""
    m = mask.to(loss.dtype)
    per_seq = (loss * m).sum(-1) / m.sum(-1).clamp(min=1)  # [B]
    return per_seq.mean()


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """Sum over tokens within each sequence, then mean over sequences."""
    return (loss * mask.to(loss.dtype)).sum(-1).mean()


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: torch.Tensor, mask: torch.Tensor, norm: float | None = None, **_) -> torch.Tensor:
    """Token sum of each sequence divided by a constant, then mean over sequences (Dr. GRPO).

    Σ_{b,t} m·L / (B · norm), `norm` = T when None. Dr. GRPO divides by the generation
    budget (max new tokens), a constant, so no response's tokens count less for being
    long (arXiv:2503.20783). Pass `norm` = the generation budget to make it independent of
    how far the batch happens to be padded.
    """
    norm = loss.shape[-1] if norm is None else norm
    return (loss * mask.to(loss.dtype)).sum() / (loss.shape[0] * norm)


seq_mean_token_mean.unit = seq_mean_token_sum.unit = seq_mean_token_sum_norm.unit = "sequence"


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, **kw) -> torch.Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar with the aggregation named `mode`.

    Extra keywords (e.g. `norm` for `seq-mean-token-sum-norm`) reach the aggregation.
    """
    return AGGREGATIONS.get(mode)(loss, mask, **kw)
