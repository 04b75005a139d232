"""Outcome-level advantage estimators: `(rewards [B], group [B], mask [B, T], **extras) -> advantages [B, T]`.

Every estimator has the same signature, so the trainer never special-cases a name:

- `rewards` may hold NaN for samples that could not be scored (`RewardResult.score is
  None`): they are left out of every baseline and get advantage 0.
- `group` is the integer group (prompt) index of each sample; group-relative estimators
  never mix groups. Those that normalise over the whole batch say so with
  `fn.mixes_groups = True`.
- `mask` is the loss mask; padding always gets advantage 0.
- An estimator that needs more than these takes each *extra* as a keyword argument and
  declares their names with `@declare(needs=...)` (`fn.needs`; `requirements(name)`
  reads it back). The trainer produces each extra with the provider registered under its
  name (`assay.training.extras.EXTRAS`: values, reference logprobs, greedy-rollout rewards,
  step rewards, an episode's turns, ...), and passes exactly the declared ones. Every other keyword
  parameter is a hyperparameter, set from `algo.advantage_args` and checked against the
  signature (`assay.algos.args`).

Estimators are called under `torch.no_grad()` semantics: extras such as `logprobs` or
`values` must be detached by the caller. Token-level and step-level estimators (GAE,
EVPO, PURE, process GRPO, FRPO) live in `assay.algos.credit`, the turn-level ones of multi-turn
episodes (`turn_grpo`, `turn_progress`, `turn_gae`, `segment_locked`) in `assay.algos.turns`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from assay.registry import Registry

ADVANTAGES: Registry = Registry("advantage estimator")

def declare(needs: Iterable[str] = (), mixes_groups: bool = False, groups: bool = False) -> Callable:
    """Decorator that records what an estimator needs from the trainer.

    Sets `fn.needs` (a frozenset of extra names, each produced by the provider of that
    name in `assay.training.extras.EXTRAS`), `fn.mixes_groups` (True when the estimator
    normalises across groups, e.g. over the whole batch) and `fn.groups` (True when a
    sample's advantage comes from comparing its reward with the rest of its group, so with
    one sample per group, `rollout.group_size=1`, every advantage is 0 and nothing trains;
    the config refuses that pairing, and the conformance suite checks the declaration).
    """
    needs = frozenset(needs)

    def deco(fn: Callable) -> Callable:
        fn.needs = needs
        fn.mixes_groups = mixes_groups
        fn.groups = groups
        return fn

    return deco


def requirements(name: str, registry: Registry | None = None) -> frozenset[str]:
    """The extras that the plugin called `name` declares it needs the trainer to pass.

    Works for any registry (default: advantage estimators) and for `module:attr` plugins,
    which need nothing unless they set a `needs` attribute.

    >>> sorted(requirements("remax"))
    ['greedy_rewards']
    """
    fn = (registry or ADVANTAGES).get(name)
    return frozenset(getattr(fn, "needs", frozenset()))


# ---------------------------------------------------------------- shared pieces


def group_stats(rewards: torch.Tensor, group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, unbiased std and count of its group's scored rewards.

    Args:
        rewards: `[B]`, NaN where unscored.
        group: `[B]` integer group index.
    Returns:
        `(mean [B], std [B], count [B])`; std is 0 for groups with fewer than 2 scored samples.
    """
    valid = ~torch.isnan(rewards)  # [B]
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, valid.to(r.dtype))  # [N]
    total = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, r)
    mean = total / count.clamp(min=1)
    dev = torch.where(valid, r - mean[group], torch.zeros_like(r))
    var = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, dev**2) / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))
    return mean[group], std[group], count[group]


def group_normalise(x: torch.Tensor, group: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`(x − mean_g) / (std_g + eps)` over the scored (non-NaN) entries of each group; NaN → 0.

    Args:
        x: `[B]`, NaN where unscored.
        group: `[B]` group index.
    """
    mean, std, _ = group_stats(x, group)
    out = (x - mean) / (std + eps)
    return torch.where(torch.isnan(x), torch.zeros_like(out), out)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x − mean) / (std + eps)` over the entries where `mask` is true; 0 elsewhere.

    The std is the unbiased one, as in verl's `masked_whiten`. Works on `[B]` or `[B, T]`.
    """
    m = mask.bool()
    n = m.sum()
    if n == 0:
        return torch.zeros_like(x)
    xs = torch.where(m, x, torch.zeros_like(x))
    mean = xs.sum() / n
    var = (torch.where(m, x - mean, torch.zeros_like(x)) ** 2).sum() / (n - 1).clamp(min=1)
    out = (x - mean) / (var.sqrt() + eps)
    return torch.where(m, out, torch.zeros_like(out))


def _broadcast(adv: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    adv = torch.where(torch.isnan(rewards), torch.zeros_like(adv), adv)  # [B]
    return adv[:, None] * mask.to(adv.dtype)  # [B, T]


def _scored(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T]` bool: response tokens of samples that have a reward."""
    return mask.bool() & ~torch.isnan(rewards)[:, None]


# ---------------------------------------------------------------- group baselines


@ADVANTAGES.register("grpo")
@declare(groups=True)
def grpo(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, **_) -> torch.Tensor:
    """GRPO: reward minus its group's mean, divided by the group's std.

    A_i = (r_i − mean_g(r)) / (std_g(r) + eps), the same for every token of response i.
    Shao et al., "DeepSeekMath" (2024), arXiv:2402.03300. The std is the unbiased sample
    std, as in TRL and verl.

    >>> grpo(torch.tensor([1., 0., 0., 0.]), torch.tensor([0, 0, 1, 1]), torch.ones(4, 1))[:, 0]
    tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    mean, std, _ = group_stats(rewards, group)
    return _broadcast((rewards - mean) / (std + eps), rewards, mask)


@ADVANTAGES.register("dr_grpo")
@declare(groups=True)
def dr_grpo(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """Dr. GRPO: reward minus its group's mean, with no division by the std.

    A_i = r_i − mean_g(r). Liu et al., "Understanding R1-Zero-Like Training: A Critical
    Perspective" (2025), arXiv:2503.20783; pair it with `seq-mean-token-sum-norm`.
    """
    mean, _, _ = group_stats(rewards, group)
    return _broadcast(rewards - mean, rewards, mask)


@ADVANTAGES.register("rloo")
@declare(groups=True)
def rloo(rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, **_) -> torch.Tensor:
    """RLOO: reward minus the mean of the other samples in its group.

    A_i = r_i − (Σ_g r − r_i) / (n_g − 1) = n_g / (n_g − 1) · (r_i − mean_g). Ahmadian et
    al., "Back to Basics: Revisiting REINFORCE Style Optimization" (2024), arXiv:2402.14740.
    """
    mean, _, count = group_stats(rewards, group)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scale * (rewards - mean), torch.zeros_like(rewards))
    return _broadcast(adv, rewards, mask)


# ---------------------------------------------------------------- batch baselines


def _token_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Outcome reward at the last response token, discounted back: γ^(tokens after t) · r. `[B, T]`."""
    m = mask.to(rewards.dtype)
    after = m.flip(-1).cumsum(-1).flip(-1) - m  # response tokens strictly after t
    r = torch.nan_to_num(rewards, nan=0.0)
    return (gamma**after) * r[:, None] * m


@ADVANTAGES.register("reinforce_pp")
@declare(mixes_groups=True)
def reinforce_pp(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, eps: float = 1e-8, **_,
) -> torch.Tensor:
    """REINFORCE++: the discounted return, whitened over every response token in the batch.

    G_t = γ^(T_i − 1 − t) r_i (reward at the last token), A_t = (G_t − mean_batch G) /
    std_batch G, mean and std over all scored response tokens. Hu et al., "REINFORCE++"
    (2025), arXiv:2501.03262. As in verl, the whitening is token-weighted; fold a KL
    penalty into `rewards` first with `kl.kl_reward_penalty` to get the paper's shaped return.
    """
    returns = _token_returns(rewards, mask, gamma)  # [B, T]
    return masked_whiten(returns, _scored(rewards, mask), eps)


@ADVANTAGES.register("reinforce_pp_baseline")
@declare(mixes_groups=True, groups=True)
def reinforce_pp_baseline(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, **_,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: subtract the group mean, then whiten over the batch.

    A_t = whiten_batch(r_i − mean_g(r)), the whitening over all scored response tokens.
    Hu et al., arXiv:2501.03262 (the "baseline" variant, `reinforce_plus_plus_baseline` in verl).
    """
    mean, _, _ = group_stats(rewards, group)
    centred = _broadcast(rewards - mean, rewards, mask)  # [B, T]
    return masked_whiten(centred, _scored(rewards, mask), eps)


@ADVANTAGES.register("remax")
@declare(needs={"greedy_rewards"})
def remax(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, greedy_rewards: torch.Tensor, **_,
) -> torch.Tensor:
    """ReMax: reward minus the reward of a greedy rollout of the same prompt.

    A_i = r_i − r(x_i, ŷ_greedy). Li et al., "ReMax: A Simple, Effective, and Efficient
    Reinforcement Learning Method for Aligning LLMs" (2023), arXiv:2310.10505. A NaN
    greedy reward gives advantage 0.

    Args:
        greedy_rewards: `[B]`, each sample's prompt's greedy-rollout reward.
    """
    adv = rewards - greedy_rewards.to(rewards.dtype)
    return _broadcast(adv, adv, mask)


# ---------------------------------------------------------------- multi-reward and targeted


@ADVANTAGES.register("gdpo")
@declare(needs={"components"}, mixes_groups=True, groups=True)
def gdpo(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, components: torch.Tensor,
    weights: list[float] | torch.Tensor | None = None, batch_norm: bool = True, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """GDPO: normalise each reward component within its group, sum, then normalise over the batch.

    A_i = whiten_batch(Σ_k w_k (c_ik − mean_g c_k) / (std_g c_k + eps)). Normalising the
    components separately keeps reward combinations apart that GRPO on the summed reward
    collapses to one advantage. Liu et al., "GDPO: Group reward-Decoupled Normalization
    Policy Optimization for Multi-reward RL Optimization" (2026), arXiv:2601.05242; the
    multi-reward setting of MARBLE (Multi-Aspect Reward BaLancE) and SMOPD
    (Specialize-and-Merge Online Policy Distillation), which uses GDPO as its baseline.

    Args:
        components: `[B, K]`, NaN where a component is unscored (it then adds 0).
        weights: optional `[K]` weights, default all 1.
        batch_norm: whiten the summed advantage over the batch's scored samples.
    """
    c = components.to(rewards.dtype)
    w = torch.ones(c.shape[1], dtype=c.dtype, device=c.device) if weights is None else torch.as_tensor(weights, dtype=c.dtype, device=c.device)
    total = sum(w[k] * group_normalise(c[:, k], group, eps) for k in range(c.shape[1]))  # [B]
    total = torch.as_tensor(total, dtype=rewards.dtype, device=rewards.device) * torch.ones_like(rewards)
    if batch_norm:
        total = masked_whiten(total, ~torch.isnan(rewards), eps)
    return _broadcast(total, rewards, mask)


def _log_comb(n: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """log C(n, k), −inf where k > n or k < 0."""
    ok = (k >= 0) & (k <= n)
    val = torch.lgamma(n + 1) - torch.lgamma(k + 1) - torch.lgamma((n - k).clamp(min=0) + 1)
    return torch.where(ok, val, torch.full_like(val, -math.inf))


def _group_indices(group: torch.Tensor, valid: torch.Tensor) -> list[torch.Tensor]:
    """The indices of each group's valid samples; a group with none (every reward unscored) is left out."""
    out = [torch.nonzero((group == g) & valid).flatten() for g in torch.unique(group)]
    return [idx for idx in out if idx.numel()]


@ADVANTAGES.register("passk")
@declare(groups=True)
def passk(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, k: int = 2, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """Pass@k-targeted advantage: GRPO applied to the best-of-k reward of every k-subset.

    Form all C(n, k) subsets of a group's n scored responses; a subset's reward is its
    max (pass@k for 0/1 rewards). A response's advantage is the mean reward of the
    subsets containing it, minus the mean over all subsets, over their std:
    A_i = (E[max_S r | i ∈ S] − E[max_S r]) / (std_S[max_S r] + eps). With rewards sorted
    ascending (rank j = 1..n), E[max_S r] = Σ_j C(j−1, k−1) r_(j) / C(n, k) and
    E[max_S r | i ∈ S] = [C(i−1, k−1) r_(i) + Σ_{j>i} C(j−2, k−2) r_(j)] / C(n−1, k−1).
    For 0/1 rewards this is the closed form of Chen et al., "Pass@k Training for Adaptively
    Balancing Exploration and Exploitation of Large Reasoning Models" (2025), arXiv:2508.10751;
    on real-valued rewards it targets max@k (cf. Walder & Karkhanis, PKPO, arXiv:2505.15201).
    Groups with fewer than k scored responses use k = n; k = 1 is GRPO with the population
    std. k must be below the group size for any signal: with k = n there is one subset.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for idx in _group_indices(group, ~torch.isnan(rewards)):
        n = idx.numel()
        kk = min(k, n)
        if n < 2:
            continue
        r, order = rewards[idx].double().sort()  # ascending
        j = torch.arange(1, n + 1, dtype=torch.float64, device=r.device)  # ranks
        nn, kt = torch.full_like(r[0], float(n)), torch.full_like(r[0], float(kk))
        p_max = torch.exp(_log_comb(j - 1, kt - 1) - _log_comb(nn, kt))  # P(rank j is a subset's max)
        mean_all = (p_max * r).sum()
        var_all = (p_max * r**2).sum() - mean_all**2
        # subsets containing rank i: max is r_(i) with weight C(i−1, k−1), or r_(j>i) with C(j−2, k−2)
        w_self = torch.exp(_log_comb(j - 1, kt - 1) - _log_comb(nn - 1, kt - 1))  # [n]
        w_up = torch.exp(_log_comb(j - 2, kt - 2) - _log_comb(nn - 1, kt - 1))  # [n] weight of rank j as max
        upper = (w_up * r).flip(0).cumsum(0).flip(0) - w_up * r  # Σ_{j>i} w_up_j r_j
        mean_cond = w_self * r + upper  # [n]
        a = (mean_cond - mean_all) / (var_all.clamp(min=0).sqrt() + eps)
        adv[idx[order]] = a
    return _broadcast(adv.to(rewards.dtype), rewards, mask)


@ADVANTAGES.register("tailrl")
@declare(groups=True)
def tailrl(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor,
    low: float | None = None, high: float | None = None, **_,
) -> torch.Tensor:
    """TailRL: the tail-likelihood advantage, a mixture of best-of-k advantages.

    TailRL maximises E_τ[log P(R ≥ τ)] for a threshold τ ~ Uniform[low, high]. With the
    group estimate p̂(τ) = (1/G) Σ_j 1{r_j ≥ τ}, A_i = E_τ[1{r_i ≥ τ} / p̂(τ)] − E_τ[1{p̂(τ) > 0}]
    (thresholds no response reaches count 0). For τ between the (k+1)-th and k-th best
    reward only the top k count, each with weight G/k, so the best response gets the most.
    TailRL (Tail-Likelihood RL): maximise log P(R ≥ τ) for a random threshold τ; the
    estimator is its gradient written per group. `low`/`high` default to each group's min and max reward, giving A = 0 for a
    group whose rewards are all equal. Not normalised: |A| ≤ G − 1.
    """
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    for idx in _group_indices(group, ~torch.isnan(rewards)):
        r = rewards[idx].double()
        lo = r.min() if low is None else torch.full_like(r[0], float(low))
        hi = r.max() if high is None else torch.full_like(r[0], float(high))
        if hi <= lo:
            continue
        # τ ∈ (edges[m−1], edges[m]]: p̂ is constant there, = #(r ≥ edges[m]) / n
        edges = torch.cat([lo[None], torch.unique(r).clamp(lo, hi), hi[None]]).unique()  # sorted
        length = edges[1:] - edges[:-1]  # [M]
        above = (r[None, :] >= edges[1:, None]).double()  # [M, n]: reaches every τ in the interval
        p_hat = above.mean(1)  # [M]
        share = torch.where(p_hat > 0, length / p_hat.clamp(min=1e-12), torch.zeros_like(length))
        first = (share[:, None] * above).sum(0) / (hi - lo)  # E_τ[1{r_i ≥ τ} / p̂]
        baseline = (length * (p_hat > 0)).sum() / (hi - lo)  # E_τ[1{p̂ > 0}]
        adv[idx] = first - baseline
    return _broadcast(adv.to(rewards.dtype), rewards, mask)


@ADVANTAGES.register("papo")
@declare(needs={"correct", "components"}, groups=True)
def papo(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor,
    components: torch.Tensor, process: int = -1, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """PAPO: outcome advantage over the group plus process advantage among correct responses.

    A_i = (r_i − mean_g r) / (std_g r + eps) + 1{i correct} · (p_i − mean_{g,correct} p) /
    (std_{g,correct} p + eps). The process reward p only separates correct answers, so it
    cannot pay an incorrect but verbose response. PAPO (Process-Aware Policy Optimization):
    A = A_out + A_proc, with A_proc normalised among correct responses only (incorrect ones get 0).

    Args:
        correct: `[B]` bool outcome.
        components: `[B, K]`; column `process` (default: the last) is the process reward p.
    """
    outcome = group_normalise(rewards, group, eps)  # [B]
    p = components[:, process].to(rewards.dtype)
    p = torch.where(correct.bool(), p, torch.full_like(p, math.nan))
    adv = outcome + group_normalise(p, group, eps)
    return _broadcast(adv, rewards, mask)
