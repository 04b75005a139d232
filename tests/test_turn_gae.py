"""Turn-level GAE with the critic and segment-locked advantages (`assay.algos.turns`): hand-worked numbers, and real runs.

Episodes are laid out as in `test_turn_credit.episodes`: each turn is 2 model tokens then 1
environment token (loss mask 0, turn −1), so turn k starts at token 3k.
"""

import math

import pytest
import torch
from test_turn_credit import episodes, per_turn

from assay.algos import ADVANTAGES, compute_gae, requirements
from assay.algos.turns import turn_value_targets
from assay.config import load_config
from assay.errors import AssayError

NAN = math.nan


def turn_values(mask: torch.Tensor, starts: list[list[float]], other: float = 9.0) -> torch.Tensor:
    """Critic values `[B, T]`: `starts[i][k]` on turn k's first token (3k), `other` on every other token (never read)."""
    v = torch.full(mask.shape, other)
    for i, row in enumerate(starts):
        for k, x in enumerate(row):
            v[i, 3 * k] = x
    return v * mask


def test_registered_with_their_extras():
    assert requirements("turn_gae") == {"turn_rewards", "turn_index", "values"}
    assert requirements("segment_locked") == {"turn_rewards", "turn_index"}
    assert ADVANTAGES.get("turn_gae").mixes_groups and not ADVANTAGES.get("segment_locked").mixes_groups


def test_turn_gae_on_a_three_turn_episode_by_hand():
    # turn rewards 0, 0.5, 1 (the episode's 1.5); V at the turns' starts 0.2, 0.5, 0.4; γ = 0.9, λ = 0.5
    rewards, g, mask, tr, index = episodes([[0.0, 0.5, 1.0]])
    values = turn_values(mask, [[0.2, 0.5, 0.4]])
    adv = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values, gamma=0.9, lam=0.5, whiten=False)
    # δ2 = 1 + 0.9·0 − 0.4 = 0.6                  A2 = 0.6
    # δ1 = 0.5 + 0.9·0.4 − 0.5 = 0.36             A1 = 0.36 + 0.45·0.6 = 0.63
    # δ0 = 0 + 0.9·0.5 − 0.2 = 0.25               A0 = 0.25 + 0.45·0.63 = 0.5335
    for k, a in enumerate([0.5335, 0.63, 0.6]):
        torch.testing.assert_close(per_turn(adv, index, k), torch.tensor([a]), atol=1e-6, rtol=0)
    assert (adv[index < 0] == 0).all() and (adv[mask == 0] == 0).all()  # environment tokens get nothing
    # the critic's targets: R_k = A_k + V_k on each turn's first token only
    returns, on = turn_value_targets(rewards, values, mask, tr, index, gamma=0.9, lam=0.5)
    assert on[0].nonzero().flatten().tolist() == [0, 3, 6]
    torch.testing.assert_close(returns[0, [0, 3, 6]], torch.tensor([0.7335, 1.13, 1.0]), atol=1e-6, rtol=0)
    assert (returns[~on] == 0).all()


def test_gamma_lam_one_is_return_to_go_minus_value():
    rewards, g, mask, tr, index = episodes([[0.0, 0.5, 1.0], [0.25, 0.0], [1.0]])
    values = turn_values(mask, [[0.2, 0.5, 0.4], [0.1, 0.3], [0.6]])
    adv = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values, whiten=False)
    # returns-to-go 1.5, 1.5, 1 | 0.25, 0 | 1, minus each turn's value
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([1.3, 0.15, 0.4]), atol=1e-6, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([1.0, -0.3, NAN]), atol=1e-6, rtol=0, equal_nan=True)
    torch.testing.assert_close(per_turn(adv, index, 2), torch.tensor([0.6, NAN, NAN]), atol=1e-6, rtol=0, equal_nan=True)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.5), (0.5, 0.0)])
def test_a_single_turn_episode_is_outcome_gae_at_sequence_level(gamma, lam):
    """One turn: A = R − V(prompt) on every token, whatever γ and λ; with γ = λ = 1 that is token GAE's first advantage."""
    rewards, g, mask, tr, index = episodes([[1.0], [0.0]], tokens_per_turn=4)
    values = torch.tensor([[0.3, 0.7, 0.1, 0.9, 0.0], [0.6, 0.2, 0.8, 0.4, 0.0]])
    adv = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values, gamma=gamma, lam=lam, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.7] * 4 + [0.0], [-0.6] * 4 + [0.0]]))
    token_adv, _ = compute_gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv[:, 0], token_adv[:, 0])


def test_a_split_episode_part_bootstraps_through_the_turns_it_lacks():
    # the first part of a split episode: turn 0 here, turn 1 (reward 1) in the other part; γ = 0.9, λ = 0.5
    rewards, g, mask, tr, index = episodes([[0.0, 1.0]])
    index[0, 3:] = -1
    mask[0, 3:] = 0
    values = turn_values(mask, [[0.2]])
    adv = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values, gamma=0.9, lam=0.5, whiten=False)
    # turn 1 has no value here: its return 1 stands in, A0 = 0 + 0.9·1 − 0.2 = 0.7
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([0.7]))
    returns, on = turn_value_targets(rewards, values, mask, tr, index, gamma=0.9, lam=0.5)
    assert on[0].nonzero().flatten().tolist() == [0] and returns[0, 0].item() == pytest.approx(0.9)


def test_turn_gae_whitens_over_scored_model_tokens():
    rewards, g, mask, tr, index = episodes([[0.0, 0.5, 1.0], [0.25, 0.0], [1.0]])
    rewards[2] = NAN  # unscored: advantage 0, out of the whitening
    values = turn_values(mask, [[0.2, 0.5, 0.4], [0.1, 0.3], [0.6]])
    raw = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values, whiten=False)
    adv = ADVANTAGES.get("turn_gae")(rewards, g, mask, turn_rewards=tr, turn_index=index, values=values)
    on = (mask == 1) & (torch.arange(3) < 2)[:, None]
    x = raw[on]
    torch.testing.assert_close(adv[on], (x - x.mean()) / (x.std() + 1e-8))
    assert (adv[2] == 0).all() and (adv[mask == 0] == 0).all()


# ---------------------------------------------------------------- segment-locked

GROUP = [[1.0], [0.5, 1.0], [0.0, 0.0], [0.25, 0.5, 0.0]]  # A answers at once; B, C, D act first


def test_segment_locked_roles_by_hand():
    rewards, g, mask, tr, index = episodes(GROUP)
    adv = ADVANTAGES.get("segment_locked")(rewards, g, mask, turn_rewards=tr, turn_index=index)
    # action segments (every turn but the last), one reward per episode: B 0.5, C 0, D 0.25 + 0.5 = 0.75 (A has none)
    #   mean 5/12, unbiased std sqrt(((1/12)² + (5/12)² + (1/3)²) / 2) = 0.381881 → B 0.218218, C −1.091089, D 0.872872
    # final segments: A 1, B 1, C 0, D 0: mean 0.5, std sqrt(1/3) → ±0.866025
    act, fin = [NAN, 0.218218, -1.091089, 0.872872], 0.866025
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([fin, act[1], act[2], act[3]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([NAN, fin, -fin, act[3]]), atol=1e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(per_turn(adv, index, 2), torch.tensor([NAN, NAN, NAN, -fin]), atol=1e-5, rtol=0, equal_nan=True)
    assert (adv[index < 0] == 0).all()


def test_segment_locked_per_turn_index_by_hand():
    rewards, g, mask, tr, index = episodes(GROUP)
    adv = ADVANTAGES.get("segment_locked")(rewards, g, mask, turn_rewards=tr, turn_index=index, segments="turn")
    # turn 0: (1, 0.5, 0, 0.25): mean 0.4375, std sqrt(0.546875 / 3) = 0.426956 → 1.317465, 0.146385, −1.024695, −0.439155
    # turn 1: (B 1, C 0, D 0.5): mean 0.5, std 0.5 → 1, −1, 0;  turn 2: D alone → 0
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([1.317465, 0.146385, -1.024695, -0.439155]), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([NAN, 1.0, -1.0, 0.0]), atol=1e-5, rtol=0, equal_nan=True)
    torch.testing.assert_close(per_turn(adv, index, 2), torch.tensor([NAN, NAN, NAN, 0.0]), atol=1e-5, rtol=0, equal_nan=True)


def test_segment_locked_is_grpo_on_single_turns_and_refuses_an_unknown_segmentation():
    rewards, g, mask, tr, index = episodes([[1.0], [0.0], [0.5]])
    for segments in ("role", "turn"):
        adv = ADVANTAGES.get("segment_locked")(rewards, g, mask, turn_rewards=tr, turn_index=index, segments=segments)
        torch.testing.assert_close(adv, ADVANTAGES.get("grpo")(rewards, g, mask))
    cfg = load_config(None, ["algo.advantage=segment_locked", "algo.advantage_args={segments: step}"])
    from assay.training.learner import estimator_args

    with pytest.raises(AssayError, match="segments=.step. is not one of .role., .turn. for segment_locked") as e:
        estimator_args(cfg.algo)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------- real runs on the Retry environment


@pytest.mark.parametrize("advantage", ["turn_gae", "segment_locked"])
def test_training_on_retry_episodes(tmp_path, monkeypatch, advantage):
    """Two steps on `_agents_env:Retry`: the weights move, every step has a gradient, and turn_gae's critic fits per-turn returns."""
    from _train_helpers import assert_learned

    import assay.training.critic as critic
    import assay.training.rl as rl
    from assay.models import resolve_model_path
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    seen, fits = [], []
    real_adv, real_fit = rl.compute_advantages, critic.Critic.fit
    monkeypatch.setattr(rl, "compute_advantages", lambda batch, algo, extras=None, args=None:
                        seen.append((batch, extras)) or real_adv(batch, algo, extras, args))
    monkeypatch.setattr(critic.Critic, "fit", lambda self, batch, old, returns, on, *a, **k:
                        fits.append((batch, old, returns, on)) or real_fit(self, batch, old, returns, on, *a, **k))
    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=r", "train.steps=2", "train.eval_every=0", "train.eval_n=4",
                             "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1",
                             "optim.warmup_steps=0", "optim.lr=1e-3", "env.name=_agents_env:Retry", "env.max_turns=3",
                             f"algo.advantage={advantage}", "algo.advantage_args={gamma: 0.9, lam: 0.8}" if advantage == "turn_gae" else "seed=0"])
    d = Trainer(cfg).fit(progress=False).run_dir
    assert_learned(d, resolve_model_path(cfg.model.path))
    rows = [r for r in read_metrics(d / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and any(r["agent/turns_mean"] > 1 for r in rows)
    batch, extras = seen[0]
    assert any(int(extras["turn_index"][i].max()) >= 1 for i in range(batch.mask.shape[0]))  # episodes of several turns
    if advantage == "turn_gae":
        assert len(fits) == 2 and all(math.isfinite(r["critic/loss"]) for r in rows)
        fb, old, returns, on = fits[0]
        want_returns, want_on = turn_value_targets(batch.rewards, extras["values"].cpu(), batch.mask.cpu(),
                                                   extras["turn_rewards"], extras["turn_index"], gamma=0.9, lam=0.8)
        assert torch.equal(on.cpu(), want_on) and on.sum() > batch.mask.shape[0]  # one target per turn, several turns
        torch.testing.assert_close(returns.cpu(), want_returns)
    else:
        assert not fits


def test_the_critic_learns_per_turn_returns(tiny_model_dir):
    """Fitted to `turn_value_targets`, the critic comes to explain each turn's return at the turn's first token."""
    from assay.config import CriticConfig
    from assay.models import load_policy
    from assay.training.critic import Critic
    from assay.training.extras import turn_tensors
    from assay.training.learner import collate
    from assay.types import RewardResult, Sample, Trajectory

    torch.manual_seed(0)
    model, tok = load_policy(str(tiny_model_dir))
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    trajs, results = [], []
    for k in range(6):  # two-turn episodes: the first turn earns k % 2 · 0.5, the second 1 when k < 3
        first, obs, second = ids(f"{k}{k}"), ids("no"), ids("7")
        rewards = [0.5 * (k % 2), float(k < 3)]
        trajs.append(Trajectory(Sample(str(k), f"{k}+{k}="), "", ids(f"{k}+{k}="), first + obs + second, [0.0] * 5, True, group=k,
                                loss_mask=[1, 1, 0, 0, 1], turns=[(0, 2), (4, 5)], info={"turn_rewards": rewards}))
        results.append(RewardResult(sum(rewards)))
    batch = collate(trajs, results, tok.pad_token_id, torch.device("cpu"))
    tr, index, _ = turn_tensors(trajs, batch.response_len)
    critic = Critic(model, CriticConfig(lr=3e-3), seed=0)
    for _ in range(60):
        v = critic.values(batch)
        returns, on = turn_value_targets(batch.rewards, v, batch.mask, tr, index, gamma=1.0, lam=1.0)
        last = critic.fit(batch, v, returns, on, epochs=1, minibatches=2)
    assert on.sum() == 12 and on[:, 0].all() and on[:, 4].all()  # one target per turn: tokens 0 and 4
    # γ = λ = 1: the targets are the returns-to-go, e.g. episode 1: 0.5 + 1 at turn 0, 1 at turn 1
    torch.testing.assert_close(returns[1, [0, 4]], torch.tensor([1.5, 1.0]))
    assert last["critic/explained_variance"] > 0.9
