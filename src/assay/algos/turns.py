"""Turn-level credit for multi-turn episodes: a group baseline per turn index, and progress-delta rewards.

Same signature as every estimator, `(rewards [B], group [B], mask [B, T], **extras) ->
advantages [B, T]`. The episode's turns arrive as three extras (`assay.train.extras`):

- `turn_rewards [B, K]`: the environment's reward for each of the episode's turns
  (`Trajectory.info["turn_rewards"]`), 0 where a turn gave none, NaN after the last turn;
  a single-turn trajectory is one turn. The row's count of non-NaN entries is its number
  of turns n_i ≥ 1.
- `turn_index [B, T]` long: the episode turn that produced each completion token, −1 on
  what the environment said and on padding.
- `turn_progress [B, K]`: a measured progress signal after each turn
  (`Step.info["progress"]`), NaN where the environment measured none.

Every token of a model turn gets that turn's advantage (`turn_to_token`); environment
tokens and padding get 0 (and have loss mask 0 anyway).
"""

from __future__ import annotations

import torch

from assay.algos.advantages import ADVANTAGES, declare, group_normalise

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
@declare(needs=TURN_EXTRAS)
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
@declare(needs=(*TURN_EXTRAS, "turn_progress"))
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
