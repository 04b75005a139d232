"""Token- and step-level credit: critic baselines (GAE, EVPO), per-step rewards, future KL.

These are advantage estimators like those in `assay.algos.advantages`, with the same
signature `(rewards [B], group [B], mask [B, T], **extras) -> advantages [B, T]`, but
their advantage varies along the response. Per-step rewards arrive as `step_rewards
[B, S]` (NaN-padded) with `step_ends [B, S]`: the index on the T axis of each step's
last token (-1 padded, increasing within a row). Step s covers the tokens
`(step_ends[s−1], step_ends[s]]`; tokens after a row's last step get no step credit.
"""

from __future__ import annotations

import math

import torch

from assay.algos.advantages import ADVANTAGES, _broadcast, _scored, declare, group_stats, grpo, masked_whiten, rloo
from assay.algos.kl import future_kl


def step_to_token(step_values: torch.Tensor, step_ends: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Spread per-step values over the tokens of each step.

    out[b, t] = step_values[b, s] for the step s with step_ends[b, s−1] < t ≤ step_ends[b, s];
    0 after the last step, on padding, and where the step's value is NaN.

    Args:
        step_values: `[B, S]`, NaN where a step is unscored or padding.
        step_ends: `[B, S]` long, last token index of each step, -1 padded.
        mask: `[B, T]` loss mask.
    Returns:
        `[B, T]`.

    >>> step_to_token(torch.tensor([[1., 2.]]), torch.tensor([[1, 3]]), torch.ones(1, 5))
    tensor([[1., 1., 2., 2., 0.]])
    """
    B, T = mask.shape
    S = step_values.shape[1]
    if S == 0:
        return torch.zeros(B, T, dtype=step_values.dtype, device=mask.device)
    ends = torch.where(step_ends < 0, torch.full_like(step_ends, T), step_ends).contiguous()  # pads sort last
    t = torch.arange(T, device=mask.device).expand(B, T).contiguous()
    raw = torch.searchsorted(ends, t)  # first step ending at or after t; S if none
    idx = raw.clamp(max=S - 1)
    found = (raw < S) & (torch.gather(ends, 1, idx) < T)
    vals = torch.gather(torch.nan_to_num(step_values, nan=0.0), 1, idx)
    return torch.where(found & mask.bool(), vals, torch.zeros_like(vals))


# ---------------------------------------------------------------- critic baselines


def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation with the outcome reward on the last response token.

    δ_t = r_t + γ V_{t+1} − V_t, A_t = Σ_l (γλ)^l δ_{t+l}, returns R_t = A_t + V_t; steps
    run over response tokens only (positions where `mask` is 0 are skipped, so multi-turn
    masks with holes work), and V after the last token is 0. Schulman et al.,
    "High-Dimensional Continuous Control Using Generalized Advantage Estimation" (2016),
    arXiv:1506.02438.

    Args:
        rewards: `[B]` outcome reward, NaN where unscored (those rows get 0).
        values: `[B, T]` critic values V_t of the state before token t.
        mask: `[B, T]`.
    Returns:
        `(advantages [B, T], returns [B, T])`, unwhitened; `returns` is the critic's target.
    """
    m = mask.bool()
    B, T = m.shape
    v = values.to(torch.float64)
    after = m.flip(-1).cumsum(-1).flip(-1) - m.long()
    r_tok = torch.where(m & (after == 0), torch.nan_to_num(rewards, nan=0.0).double()[:, None], 0.0)  # [B, T]
    adv = torch.zeros(B, T, dtype=torch.float64, device=v.device)
    next_v = torch.zeros(B, dtype=torch.float64, device=v.device)
    next_a = torch.zeros(B, dtype=torch.float64, device=v.device)
    for t in reversed(range(T)):
        delta = r_tok[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        adv[:, t] = torch.where(m[:, t], a, 0.0)
        next_v = torch.where(m[:, t], v[:, t], next_v)
        next_a = torch.where(m[:, t], a, next_a)
    scored = _scored(rewards, mask)
    adv = torch.where(scored, adv, 0.0).to(values.dtype)
    returns = torch.where(scored, adv + values, torch.zeros_like(values))
    return adv, returns


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """EV = 1 − Var(R − V) / Var(R) over the masked tokens; NaN when Var(R) = 0.

    1 is a perfect critic, 0 no better than a constant, negative worse than a constant.
    """
    m = mask.bool()
    if m.sum() < 2:
        return math.nan
    r, v = returns[m].double(), values[m].double()
    var_r = r.var()
    if var_r <= 0:
        return math.nan
    return float(1 - (r - v).var() / var_r)


@ADVANTAGES.register("gae")
@declare(needs={"values"}, mixes_groups=True)
def gae(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
    gamma: float = 1.0, lam: float = 1.0, whiten: bool = True, **_,
) -> torch.Tensor:
    """PPO's advantage: GAE(γ, λ) against a learned value head, whitened over the batch.

    A = whiten_batch(GAE_γλ(r, V)); see `compute_gae`, which also returns the value
    targets. Schulman et al., arXiv:1506.02438 and "Proximal Policy Optimization
    Algorithms" (2017), arXiv:1707.06347; γ = λ = 1 as in verl's defaults for LLMs.
    `whiten=False` keeps groups separate.
    """
    adv, _ = compute_gae(rewards, values, mask, gamma, lam)
    return masked_whiten(adv, _scored(rewards, mask)) if whiten else adv


@ADVANTAGES.register("evpo")
@declare(needs={"values"}, mixes_groups=True)
def evpo(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
    gamma: float = 1.0, lam: float = 1.0, threshold: float = 0.0, **_,
) -> torch.Tensor:
    """EVPO: use the critic only when it explains the returns, else the batch-mean baseline.

    EV = 1 − Var(R − V)/Var(R) on this batch (R = GAE returns). If EV > threshold (0):
    A = GAE_γλ(r, V); otherwise A_i = r_i − mean_batch(r). EVPO (Explained Variance Policy
    Optimization), which reads baseline choice as a Kalman gain between PPO and GRPO. Log the gate with
    `explained_variance(values, returns, mask)`.
    """
    adv, returns = compute_gae(rewards, values, mask, gamma, lam)
    if explained_variance(values, returns, _scored(rewards, mask)) > threshold:
        return adv
    scored = ~torch.isnan(rewards)
    mean = rewards[scored].mean() if scored.any() else torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return _broadcast(rewards - mean, rewards, mask)


# ---------------------------------------------------------------- per-step rewards


def _suffix_min(x: torch.Tensor) -> torch.Tensor:
    """min over j ≥ s of x[:, j], ignoring NaN; NaN where no scored step remains. `[B, S]`."""
    filled = torch.where(torch.isnan(x), torch.full_like(x, math.inf), x)
    out = torch.cummin(filled.flip(-1), dim=-1).values.flip(-1)
    return torch.where(torch.isinf(out), torch.full_like(out, math.nan), out)


@ADVANTAGES.register("pure")
@declare(needs={"step_rewards", "step_ends"}, groups=True)
def pure(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, step_rewards: torch.Tensor,
    step_ends: torch.Tensor, outcome_coef: float = 0.0, **_,
) -> torch.Tensor:
    """PURE: min-form credit. A step's value is the minimum of the process rewards from it on.

    V_{i,s} = min_{j ≥ s} p_{i,j} (instead of the sum Σ_{j≥s} γ^{j−s} p_{i,j}); the baseline
    b_i is the leave-one-out group mean of the trajectory values V_{·,1}; token t of step s
    gets V_{i,s} − b_i, plus `outcome_coef` × the RLOO advantage of the outcome reward.
    PURE, Cheng et al., "Stop Summation: Min-Form Credit Assignment Is All Process Reward
    Model Needs for Reasoning" (2025), arXiv:2504.15275 (the
    baseline is our choice, following the paper's use of RLOO).
    """
    v = _suffix_min(step_rewards.to(rewards.dtype))  # [B, S]
    if v.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    traj = torch.where(torch.isnan(rewards), torch.full_like(rewards, math.nan), v[:, 0])  # [B], NaN: unscored
    mean, _, count = group_stats(traj, group)
    loo = (mean * count - traj) / (count - 1).clamp(min=1)  # mean of the others' trajectory values
    adv = step_to_token(v - loo[:, None], step_ends, mask)
    ok = ~torch.isnan(traj) & (count > 1)
    adv = torch.where(ok[:, None], adv, torch.zeros_like(adv))
    if outcome_coef:
        adv = adv + outcome_coef * rloo(rewards, group, mask)
    return adv


@ADVANTAGES.register("grpo_process")
@declare(needs={"step_rewards", "step_ends"})
def grpo_process(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, step_rewards: torch.Tensor,
    step_ends: torch.Tensor, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """GRPO with process supervision: step rewards normalised over the group, summed to go.

    r̃_{i,s} = (p_{i,s} − mean(p_g)) / (std(p_g) + eps), mean and std over every scored
    step of every response in the group; token t gets Σ_{s: end_s ≥ t} r̃_{i,s}. Shao et
    al., "DeepSeekMath" (2024), arXiv:2402.03300, §4.1.3.
    """
    p = step_rewards.to(rewards.dtype)
    p = torch.where(torch.isnan(rewards)[:, None], torch.full_like(p, math.nan), p)
    S = p.shape[1]
    flat_group = group.repeat_interleave(S)
    mean, std, _ = group_stats(p.reshape(-1), flat_group)
    norm = ((p.reshape(-1) - mean) / (std + eps)).reshape(p.shape)
    norm = torch.nan_to_num(norm, nan=0.0)
    to_go = norm.flip(-1).cumsum(-1).flip(-1)  # [B, S]
    to_go = torch.where(step_ends < 0, torch.full_like(to_go, math.nan), to_go)
    return step_to_token(to_go, step_ends, mask)


@ADVANTAGES.register("frpo")
@declare(needs={"logprobs", "ref_logprobs", "kl_coef"}, groups=True)
def frpo(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor, kl_coef: float = 0.01, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """FRPO: the GRPO advantage minus β × the future KL, added after normalisation.

    A_{i,t} = (r_i − mean_g r)/(std_g r + eps) − β Σ_{k ≥ t} (log π(y_k) − log π_ref(y_k)).
    The KL is kept out of the reward because group normalisation is non-linear in it.
    Use it instead of a loss-side KL term (set that coefficient to 0). FRPO (Future-KL
    Regularized Policy Optimization): reverse-KL regularisation as a return-to-go added after normalisation.

    Args:
        logprobs, ref_logprobs: `[B, T]` detached logprobs of the sampling and reference policies.
        kl_coef: β, the run's `algo.kl_coef` (which also loads the reference model).
    """
    adv = grpo(rewards, group, mask, eps=eps)
    correction = future_kl(logprobs, ref_logprobs, mask).to(adv.dtype)
    return torch.where(_scored(rewards, mask), adv - kl_coef * correction, torch.zeros_like(adv))
