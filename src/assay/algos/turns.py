"""Turn-level credit for multi-turn episodes: per-turn group baselines, progress deltas, GAE over turns, locked segments.

Same signature as every estimator, `(rewards [B], group [B], mask [B, T], **extras) ->
advantages [B, T]`. The episode's turns arrive as three extras (`assay.training.extras`):

- `turn_rewards [B, K]`: the environment's reward for each of the episode's turns
  (`Trajectory.info["turn_rewards"]`), 0 where a turn gave none, NaN after the last turn;
  a single-turn trajectory is one turn. The row's count of non-NaN entries is its number
  of turns n_i ≥ 1.
- `turn_index [B, T]` long: the episode turn that produced each completion token, −1 on
  what the environment said and on padding.
- `turn_progress [B, K]`: a measured progress signal after each turn
  (`Step.info["progress"]`), NaN where the environment measured none.

`turn_gae` also reads the critic's `values [B, T]` and names the critic's targets in its
`value_targets` attribute (`turn_value_targets`). Every token of a model turn gets that
turn's advantage (`turn_to_token`); environment tokens and padding get 0 (and have loss
mask 0 anyway).
"""

from __future__ import annotations

from typing import Literal

import torch

from assay.algos.advantages import ADVANTAGES, declare, group_normalise, masked_whiten
from assay.errors import AssayError

TURN_EXTRAS = ("turn_rewards", "turn_index")


def turn_to_token(turn_values: torch.Tensor, turn_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Give every token of a model turn its turn's value: out[b, t] = turn_values[b, turn_index[b, t]].

    Args:
        turn_values: `[B, K]`.
        turn_index: `[B, T]` long, −1 where a token belongs to no model turn.
        mask: `[B, T]` loss mask.
    Returns:
        `[B, T]`, 0 where `turn_index` is −1 or `mask` is 0.

    >>> turn_to_token(torch.tensor([[1., 2.]]), torch.tensor([[0, 0, -1, 1, -1]]), torch.tensor([[1., 1., 0., 1., 0.]]))
    tensor([[1., 1., 0., 2., 0.]])
    """
    on = mask.bool() & (turn_index >= 0)  # [B, T]
    idx = turn_index.clamp(min=0, max=turn_values.shape[1] - 1)
    out = turn_values.gather(1, idx)  # [B, T]
    return torch.where(on, out, torch.zeros_like(out))


def outcome_turn_rewards(rewards: torch.Tensor, turn_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-turn rewards that sum to the scored reward: the environment's, with the last turn taking the rest.

    r_ik = turn_rewards_ik for k < n_i − 1, r_i,n_i−1 = R_i − Σ_{k<n_i−1} turn_rewards_ik. With
    the `episode` reward (R_i = Σ_k turn_rewards_ik) this is the environment's own; with a
    `reward:` block scoring the whole trajectory, its score lands on the last turn; a
    single-turn trajectory gets R_i on its one turn.

    Args:
        rewards: `[B]` scored rewards, NaN where unscored.
        turn_rewards: `[B, K]`, NaN after each row's last turn.
    Returns:
        `(r [B, K], 0 after the last turn; n [B] long, turns per row)`.
    """
    present = ~torch.isnan(turn_rewards)  # [B, K]
    n = present.sum(1).clamp(min=1)  # [B]
    r = torch.nan_to_num(turn_rewards.to(rewards.dtype), nan=0.0)
    last = (n - 1)[:, None]  # [B, 1]
    before = r.sum(1) - r.gather(1, last)[:, 0]  # [B]
    r = r.scatter(1, last, (torch.nan_to_num(rewards, nan=0.0) - before)[:, None])
    return r, n


def held_returns(r: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Return-to-go of each turn, with an episode that has ended holding its last turn's: `[B, K]`.

    G̃_ik = Σ_{j=k}^{n_i−1} r_ij for k < n_i, and G̃_ik = G̃_i,n_i−1 = r_i,n_i−1 for k ≥ n_i.

    >>> held_returns(torch.tensor([[1., 0., 0.], [0., 1., 0.], [0.5, 0.25, 1.]]), torch.tensor([1, 2, 3]))
    tensor([[1.0000, 1.0000, 1.0000],
            [1.0000, 1.0000, 1.0000],
            [1.7500, 1.2500, 1.0000]])
    """
    K = r.shape[1]
    alive = torch.arange(K, device=r.device)[None, :] < n[:, None]  # [B, K]
    r = torch.where(alive, r, torch.zeros_like(r))
    togo = r.flip(1).cumsum(1).flip(1)  # [B, K]
    terminal = togo.gather(1, (n - 1)[:, None])  # [B, 1]
    return torch.where(alive, togo, terminal.expand_as(togo))


def per_turn_normalise(returns: torch.Tensor, rewards: torch.Tensor, group: torch.Tensor, eps: float) -> torch.Tensor:
    """Each turn index k on its own: (G̃_·k − mean_g G̃_·k) / (std_g G̃_·k + eps) over the group's scored episodes. `[B, K]`."""
    scored = ~torch.isnan(rewards)
    cols = [group_normalise(torch.where(scored, returns[:, k], torch.full_like(rewards, float("nan"))), group, eps)
            for k in range(returns.shape[1])]
    return torch.stack(cols, 1) if cols else returns


@ADVANTAGES.register("turn_grpo")
@declare(needs=TURN_EXTRAS, groups=True)
def turn_grpo(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    eps: float = 1e-6, **_,
) -> torch.Tensor:
    """Turn-level GRPO: each turn's return-to-go, normalised against the group's at the same turn index.

    With per-turn rewards r_ik (`outcome_turn_rewards`: the environment's, summing to the
    scored reward R_i) and held returns G̃_ik (`held_returns`: the return-to-go from turn k,
    and for an episode that ended before k the return-to-go of its last turn),
    A_ik = (G̃_ik − mean_g G̃_·k) / (std_g G̃_·k + eps) over every scored episode of the group,
    and every token of turn k gets A_ik.

    Every episode of the group enters the baseline at every turn index, so a late turn is
    never compared only with the episodes that lasted as long (the struggling ones); with an
    outcome reward only (r_ik = 0 before the last turn) G̃_ik = R_i at every k and this is
    GRPO exactly, whatever the number of turns (docs/algorithms.md, `turn_grpo`).
    Turn-level advantages from group-normalised turn rewards come from Zeng et al.,
    "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit Assignment"
    (MT-GRPO, 2025), arXiv:2505.11821 (there: a turn-reward and an outcome advantage, summed;
    here: one return-to-go per turn). The per-turn-index group comparison is the step-level
    group of Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training"
    (GiGPO, 2025), arXiv:2505.10978, grouped by turn index rather than by a repeated
    environment state. Deliberate change: ended episodes hold their last turn's value
    instead of leaving the baseline.

    Args:
        turn_rewards: `[B, K]` the environment's per-turn rewards, NaN after the last turn.
        turn_index: `[B, T]` the turn of each token, −1 on environment tokens.
    """
    r, n = outcome_turn_rewards(rewards, turn_rewards)
    adv = per_turn_normalise(held_returns(r, n), rewards, group, eps)  # [B, K]
    return turn_to_token(adv, turn_index, mask).to(rewards.dtype)


def progress_deltas(turn_progress: torch.Tensor, n: torch.Tensor, start: float = 0.0) -> torch.Tensor:
    """Δp_ik = p_ik − p_i,k−1 with p_i,−1 = `start`; a turn without a measurement holds the last one (Δ = 0). `[B, K]`.

    >>> progress_deltas(torch.tensor([[0.5, float("nan"), 1.0]]), torch.tensor([3]))
    tensor([[0.5000, 0.0000, 0.5000]])
    """
    B, K = turn_progress.shape
    p = torch.full((B,), float(start), dtype=turn_progress.dtype, device=turn_progress.device)
    out = torch.zeros_like(turn_progress)
    for k in range(K):
        now = torch.where(torch.isnan(turn_progress[:, k]) | (k >= n), p, turn_progress[:, k])
        out[:, k] = now - p
        p = now
    return out


@ADVANTAGES.register("turn_progress")
@declare(needs=(*TURN_EXTRAS, "turn_progress"), groups=True)
def turn_progress(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    turn_progress: torch.Tensor, progress_coef: float = 1.0, start: float = 0.0, eps: float = 1e-6, **_,
) -> torch.Tensor:
    """Progress-delta credit: each turn is also rewarded by how far it moved a measured progress signal.

    r_ik = (outcome-summing turn reward, `outcome_turn_rewards`) + c · (p_ik − p_i,k−1), with
    p_i,−1 = `start` and an unmeasured turn holding the previous value; then `turn_grpo`'s
    held returns and per-turn-index group normalisation. The episode's total is
    R_i + c · (p_i,final − start): the deltas telescope, so progress made and then undone
    earns nothing. ProCredit (verified progress credit: the task's acceptance checks rerun
    after every turn, turn reward = Δ checks passed; the survey entry we read gives no arXiv
    id), with the baseline of `turn_grpo`. Setlur et al., "Rewarding Progress: Scaling
    Automated Process Verifiers for LLM Reasoning" (PAV, 2024), arXiv:2410.08146, learn a
    progress signal; this estimator takes a measured one.

    Args:
        turn_progress: `[B, K]` progress after each turn, NaN where unmeasured.
        progress_coef: c, the weight of the progress deltas against the environment's rewards.
        start: the progress before the first turn.
    """
    r, n = outcome_turn_rewards(rewards, turn_rewards)
    r = r + progress_coef * progress_deltas(turn_progress.to(r.dtype), n, start)
    adv = per_turn_normalise(held_returns(r, n), rewards, group, eps)
    return turn_to_token(adv, turn_index, mask).to(rewards.dtype)


# ---------------------------------------------------------------- a critic over turns


def turn_starts(turn_index: torch.Tensor, mask: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first model token of each turn: `(first [B, K] long, T where the row has no token of turn k; has [B, K] bool)`.

    >>> turn_starts(torch.tensor([[0, 0, -1, 1, 1]]), torch.tensor([[1., 1., 0., 1., 1.]]), 3)
    (tensor([[0, 3, 5]]), tensor([[ True,  True, False]]))
    """
    B, T = turn_index.shape
    on = mask.bool() & (turn_index >= 0) & (turn_index < K)  # [B, T]
    bucket = torch.where(on, turn_index, torch.full_like(turn_index, K))  # tokens of no turn go to a spare column
    pos = torch.arange(T, device=turn_index.device).expand(B, T)
    first = torch.full((B, K + 1), T, dtype=torch.long, device=turn_index.device).scatter_reduce(1, bucket, pos, "amin")
    return first[:, :K], first[:, :K] < T


def turn_gae_core(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    gamma: float, lam: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GAE over an episode's turns: `(advantages [B, K], returns [B, K], first [B, K], target [B, K] bool)`.

    V_ik = values[i, first token of turn k] (the state before turn k), V_i,n_i = 0;
    δ_ik = r_ik + γ V_i,k+1 − V_ik, A_ik = δ_ik + γλ A_i,k+1, R_ik = A_ik + V_ik, with r_ik
    from `outcome_turn_rewards`. A turn with no token in the row (it lies in another part of
    a split episode) has no value here: its λ-return R_ik = r_ik + γ (V_i,k+1 + λ A_i,k+1)
    stands in for V_ik, and its A_ik is 0. `target` marks the turns whose R_ik the critic
    fits: present turns of scored rows. Unscored rows get A = 0.
    """
    r, n = outcome_turn_rewards(rewards, turn_rewards)  # [B, K], [B]
    B, K = r.shape
    first, has = turn_starts(turn_index, mask, K)
    T = values.shape[1]
    v = values.double().gather(1, first.clamp(max=T - 1)) if T else torch.zeros(B, K, dtype=torch.float64, device=values.device)  # [B, K]
    r = r.double()
    adv = torch.zeros(B, K, dtype=torch.float64, device=r.device)
    ret = torch.zeros_like(adv)
    next_v = torch.zeros(B, dtype=torch.float64, device=r.device)
    next_a = torch.zeros_like(next_v)
    for k in reversed(range(K)):
        alive = k < n  # [B]
        here = alive & has[:, k]
        a = r[:, k] + gamma * next_v - v[:, k] + gamma * lam * next_a
        stand_in = r[:, k] + gamma * (next_v + lam * next_a)  # the λ-return, for a turn with no value here
        adv[:, k] = torch.where(here, a, 0.0)
        ret[:, k] = torch.where(here, a + v[:, k], torch.where(alive, stand_in, 0.0))
        next_v = torch.where(here, v[:, k], torch.where(alive, stand_in, 0.0))
        next_a = torch.where(here, a, 0.0)
    scored = ~torch.isnan(rewards)[:, None]  # [B, 1]
    target = has & scored & (torch.arange(K, device=r.device)[None, :] < n[:, None])
    return torch.where(scored, adv, 0.0), ret, first, target


def turn_value_targets(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    gamma: float = 1.0, lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's targets under `turn_gae`: each turn's λ-return R_ik on the first token of turn k, nowhere else.

    Returns:
        `(returns [B, T], on [B, T] bool)`: the critic fits V_t to returns_t where `on`, which
        is exactly the values `turn_gae` reads.
    """
    _, ret, first, target = turn_gae_core(rewards, values, mask, turn_rewards, turn_index, gamma, lam)
    B, T = mask.shape
    col = torch.where(target, first, torch.full_like(first, T))  # off-target turns to a spare column
    returns = torch.zeros(B, T + 1, dtype=values.dtype, device=values.device).scatter(1, col, ret.to(values.dtype))[:, :T]
    on = torch.zeros(B, T + 1, dtype=torch.bool, device=values.device).scatter(1, col, target)[:, :T]
    return returns, on


@ADVANTAGES.register("turn_gae")
@declare(needs=(*TURN_EXTRAS, "values"), mixes_groups=True)
def turn_gae(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    values: torch.Tensor, gamma: float = 1.0, lam: float = 1.0, whiten: bool = True, **_,
) -> torch.Tensor:
    """Turn-level GAE: the critic valued at each turn's start, GAE(γ, λ) over turns, one advantage per turn.

    V_ik = V at the first model token of turn k (the state before turn k: the prompt, the
    earlier turns and the environment's answers), V_i,n_i = 0; with per-turn rewards r_ik
    (`outcome_turn_rewards`: the environment's, the scored reward R_i taking the rest at the
    last turn), δ_ik = r_ik + γ V_i,k+1 − V_ik and A_ik = Σ_l (γλ)^l δ_i,k+l; every token of
    turn k gets A_ik, environment tokens 0; then whitened over the batch's scored model tokens
    as `gae` (`whiten=False` keeps groups apart). With γ = λ = 1, A_ik = Σ_{j≥k} r_ij − V_ik;
    a single-turn episode gets R_i − V(prompt) on every token. The critic fits R_ik = A_ik + V_ik
    on the first token of each turn only (`turn_value_targets`, the estimator's
    `value_targets`), so it learns the values this estimator reads. The turn as the unit of a
    learned critic's TD backup is the high level of Zhou et al., "ArCHer: Training Language
    Model Agents via Hierarchical Multi-Turn RL" (2024), arXiv:2402.19446, there an off-policy
    Q-critic with a token-level actor; here on-policy V with GAE (Schulman et al., "High-Dimensional
    Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438) across turn
    boundaries, skipping observation tokens, as TB-GAE (Turn-Boundary Skip-Observation GAE)
    of Terminal-RSI (the survey entry we read gives no arXiv id), which keeps token-level
    baselines where this keeps one per turn.

    Args:
        turn_rewards: `[B, K]` the environment's per-turn rewards, NaN after the last turn.
        turn_index: `[B, T]` the turn of each token, −1 on environment tokens.
        values: `[B, T]` the critic's V_t of the state before token t.
        gamma, lam: discount and GAE λ across turns.
        whiten: whiten over the batch's scored model tokens.

    One episode, turn rewards (0, 1), V = 0.25 before turn 0 and 0.5 before turn 1, γ = λ = 1:

    >>> turn_gae(torch.tensor([1.]), torch.tensor([0]), torch.tensor([[1., 0., 1.]]), torch.tensor([[0., 1.]]),
    ...          torch.tensor([[0, -1, 1]]), torch.tensor([[0.25, 0., 0.5]]), whiten=False)
    tensor([[0.7500, 0.0000, 0.5000]])
    """
    adv, _, _, _ = turn_gae_core(rewards, values, mask, turn_rewards, turn_index, gamma, lam)
    out = turn_to_token(adv.to(rewards.dtype), turn_index, mask)  # [B, T]
    on = mask.bool() & (turn_index >= 0) & ~torch.isnan(rewards)[:, None]
    return (masked_whiten(out, on) if whiten else out).to(rewards.dtype)


turn_gae.value_targets = turn_value_targets  # what the `values` extra trains the critic on


# ---------------------------------------------------------------- segment-locked


@ADVANTAGES.register("segment_locked")
@declare(needs=TURN_EXTRAS, groups=True)
def segment_locked(
    rewards: torch.Tensor, group: torch.Tensor, mask: torch.Tensor, turn_rewards: torch.Tensor, turn_index: torch.Tensor,
    segments: Literal["role", "turn"] = "role", eps: float = 1e-6, **_,
) -> torch.Tensor:
    """Segment-locked advantages: each segment's own reward, normalised in its group against segments of its kind.

    With per-turn rewards r_ik (`outcome_turn_rewards`, summing to the scored R_i), the
    turns are the segments and a segment's tokens get an advantage from its own reward only,
    never from another segment's:

    - `segments="role"` (the paper's two kinds): the action turns (every turn but the last,
      which the environment answers) and the final turn. A^act_i = norm_g(Σ_{k<n_i−1} r_ik)
      over the group's episodes with an action turn, A^fin_i = norm_g(r_i,n_i−1); action-turn
      tokens get A^act_i, final-turn tokens A^fin_i.
    - `segments="turn"`: each turn index its own kind, A_ik = norm_g(r_ik) over the group's
      episodes that have a turn k.

    norm_g(x) = (x − mean_g x) / (std_g x + eps), unbiased std, unscored episodes left out.
    A single-turn episode's one segment is final: this is GRPO on single-turn runs.
    "SLCA-GRPO: Resolving Cross-Segment Credit Misattribution in Tool-Calling RL" (Segment-Locked
    Credit Assignment; OpenReview, no arXiv id): execution advantages only to tool-call tokens,
    preference advantages only to the summary. Deliberate change: the segments are the
    episode's turns and their rewards the environment's per-turn rewards, not a separately
    judged execution and preference reward.

    Args:
        turn_rewards: `[B, K]` the environment's per-turn rewards, NaN after the last turn.
        turn_index: `[B, T]` the turn of each token, −1 on environment tokens.
        segments: `role` (action turns vs the final turn) or `turn` (each turn index).

    Two episodes of two turns, rewards (0.5, 1) and (0, 0): the first's action turn and its
    answer each beat the other's, and each turn gets only its own comparison.

    >>> segment_locked(torch.tensor([1.5, 0.]), torch.tensor([0, 0]), torch.tensor([[1., 0., 1.]] * 2),
    ...                torch.tensor([[0.5, 1.], [0., 0.]]), torch.tensor([[0, -1, 1]] * 2))
    tensor([[ 0.7071,  0.0000,  0.7071],
            [-0.7071,  0.0000, -0.7071]])
    """
    r, n = outcome_turn_rewards(rewards, turn_rewards)  # [B, K], [B]
    K = r.shape[1]
    k = torch.arange(K, device=r.device)[None, :]  # [1, K]
    nan = torch.full_like(rewards, float("nan"))
    scored = ~torch.isnan(rewards)
    if segments == "turn":
        own = torch.where(k < n[:, None], r, torch.full_like(r, float("nan")))  # [B, K]
        adv = per_turn_normalise(own, rewards, group, eps)
    elif segments == "role":
        action = torch.where(k < (n - 1)[:, None], r, torch.zeros_like(r)).sum(1)  # [B]
        final = r.gather(1, (n - 1)[:, None])[:, 0]  # [B]
        a_act = group_normalise(torch.where(scored & (n > 1), action, nan), group, eps)  # [B]
        a_fin = group_normalise(torch.where(scored, final, nan), group, eps)
        adv = torch.where(k < (n - 1)[:, None], a_act[:, None], a_fin[:, None])  # [B, K]; after n, turn_to_token never reads it
    else:
        raise AssayError(f"algo.advantage_args: segments={segments!r} is not one of 'role', 'turn' for segment_locked")
    return turn_to_token(adv, turn_index, mask).to(rewards.dtype)
