"""Credit per turn (`assay.algos.turns`, the `turn_*` extras): numbers worked out by hand, and a real run.

The groups below are episodes of a retry environment: each turn's reward is listed, the
episode's reward is their sum. Unbiased std throughout, as in `grpo`.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from assay.algos import ADVANTAGES, requirements
from assay.algos.turns import held_returns, outcome_turn_rewards, progress_deltas, turn_to_token
from assay.config import load_config
from assay.models import resolve_model_path
from assay.training.extras import turn_tensors
from assay.types import Sample, Trajectory

NAN = math.nan
ROOT = Path(__file__).resolve().parents[1]


def episodes(turn_rewards: list[list[float]], tokens_per_turn: int = 2):
    """One group of episodes: rewards [B], turn_rewards [B, K] (NaN-padded), and a token layout of
    `tokens_per_turn` model tokens then one environment token per turn (mask 0, turn −1)."""
    B, K = len(turn_rewards), max(len(r) for r in turn_rewards)
    T = K * (tokens_per_turn + 1)
    rewards = torch.tensor([sum(r) for r in turn_rewards])
    tr = torch.full((B, K), NAN)
    mask = torch.zeros(B, T)
    index = torch.full((B, T), -1, dtype=torch.long)
    for i, r in enumerate(turn_rewards):
        tr[i, : len(r)] = torch.tensor(r)
        for k in range(len(r)):
            a = k * (tokens_per_turn + 1)
            mask[i, a : a + tokens_per_turn] = 1
            index[i, a : a + tokens_per_turn] = k
    return rewards, torch.zeros(B, dtype=torch.long), mask, tr, index


def per_turn(adv: torch.Tensor, index: torch.Tensor, k: int) -> torch.Tensor:
    """`[B]` the advantage of turn k's tokens (they all share it), NaN for a row without turn k."""
    out = torch.full((adv.shape[0],), NAN)
    for i in range(adv.shape[0]):
        vals = adv[i][index[i] == k]
        if vals.numel():
            assert torch.allclose(vals, vals[0].expand_as(vals))  # every token of the turn gets the turn's advantage
            out[i] = vals[0]
    return out


def naive_survivor_baseline(turn_rewards: list[list[float]]) -> list[list[float]]:
    """The naive per-turn baseline, as a loop: return-to-go minus the mean over the episodes still running at turn k."""
    togo = [[sum(r[k:]) for k in range(len(r))] for r in turn_rewards]
    out = []
    for g in togo:
        row = []
        for k, v in enumerate(g):
            alive = [h[k] for h in togo if len(h) > k]
            row.append(v - sum(alive) / len(alive))
        out.append(row)
    return out


def test_registered_with_their_extras():
    assert requirements("turn_grpo") == {"turn_rewards", "turn_index"}
    assert requirements("turn_progress") == {"turn_rewards", "turn_index", "turn_progress"}


def test_an_outcome_only_group_gets_grpo_and_no_preference_for_more_turns():
    # A solves at once, B on its second try, C fails both tries: A and B both earn 1
    group = [[1.0], [0.0, 1.0], [0.0, 0.0]]
    rewards, g, mask, tr, index = episodes(group)
    adv = ADVANTAGES.get("turn_grpo")(rewards, g, mask, turn_rewards=tr, turn_index=index)
    # held returns: A [1, 1] (ended, holds its last turn), B [1, 1], C [0, 0]; every index sees (1, 1, 0):
    # mean 2/3, std sqrt(((1/3)² + (1/3)² + (2/3)²) / 2) = sqrt(1/3), so A, B: (1/3)/sqrt(1/3) = 0.5774, C: −1.1547
    s = 3 ** -0.5
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([s, s, -2 * s]), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([NAN, s, -2 * s]), atol=1e-5, rtol=0, equal_nan=True)
    # which is GRPO's advantage on every model token
    grpo = ADVANTAGES.get("grpo")(rewards, g, mask)
    torch.testing.assert_close(adv, grpo)
    assert (adv[mask == 0] == 0).all()
    # the naive baseline (mean over the episodes still running at turn k) rewards taking longer:
    # turn 0: (1, 1, 0) − 2/3 → A 1/3, B 1/3; turn 1: B, C still running, (1, 0) − 1/2 → B 1/2
    naive = naive_survivor_baseline(group)
    assert naive[0] == pytest.approx([1 / 3]) and naive[1] == pytest.approx([1 / 3, 1 / 2])
    mean_naive = [sum(r) / len(r) for r in naive]
    assert mean_naive[1] > mean_naive[0]  # B (2 turns for the same 1) gets 5/12 per turn against A's 1/3
    mean_ours = [float(adv[i][mask[i] == 1].mean()) for i in range(3)]
    assert mean_ours[1] == pytest.approx(mean_ours[0], abs=1e-6)


def test_dense_turn_rewards_credit_the_turn_that_earned_them():
    # A: one turn worth 0.5; B: 0.5 then 0.5; C: 0 then 0.5
    rewards, g, mask, tr, index = episodes([[0.5], [0.5, 0.5], [0.0, 0.5]])
    adv = ADVANTAGES.get("turn_grpo")(rewards, g, mask, turn_rewards=tr, turn_index=index)
    # held returns: A [0.5, 0.5], B [1.0, 0.5], C [0.5, 0.5]
    # turn 0: (0.5, 1, 0.5), mean 2/3, std sqrt((1/36 + 1/9 + 1/36) / 2) = sqrt(1/12) = 0.288675
    #   → A −(1/6)/0.288675 = −0.5774, B (1/3)/0.288675 = 1.1547, C −0.5774
    # turn 1: (0.5, 0.5, 0.5): all equal, 0 — B's and C's second turns earned the same
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([-0.57735, 1.15470, -0.57735]), atol=1e-4, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([NAN, 0.0, 0.0]), atol=1e-4, rtol=0, equal_nan=True)


def test_the_scored_reward_lands_on_the_last_turn():
    # a reward block scored the episodes 2 and 0.5, whatever the environment said per turn
    r, n = outcome_turn_rewards(torch.tensor([2.0, 0.5, NAN]), torch.tensor([[0.25, 1.0, NAN], [0.0, NAN, NAN], [1.0, 1.0, 1.0]]))
    torch.testing.assert_close(r, torch.tensor([[0.25, 1.75, 0.0], [0.5, 0.0, 0.0], [1.0, 1.0, -2.0]]))
    assert n.tolist() == [2, 1, 3]
    torch.testing.assert_close(held_returns(r[:2], n[:2]), torch.tensor([[2.0, 1.75, 1.75], [0.5, 0.5, 0.5]]))


def test_progress_deltas_and_the_progress_estimator():
    # an unmeasured turn holds the last value; turns after the episode's end move nothing
    torch.testing.assert_close(progress_deltas(torch.tensor([[0.5, NAN, 1.0], [0.2, 0.9, NAN]]), torch.tensor([3, 1]), start=0.1),
                               torch.tensor([[0.4, 0.0, 0.5], [0.1, 0.0, 0.0]]))
    # A: fails then solves, progress 0.5 then 1; B: fails twice, progress 0.5 then 0.5; C: solves at once, progress 1
    rewards, g, mask, tr, index = episodes([[0.0, 1.0], [0.0, 0.0], [1.0]])
    progress = torch.tensor([[0.5, 1.0], [0.5, 0.5], [1.0, NAN]])
    adv = ADVANTAGES.get("turn_progress")(rewards, g, mask, turn_rewards=tr, turn_index=index, turn_progress=progress)
    # r = reward + Δprogress: A [0.5, 1.5], B [0.5, 0], C [2]; held returns A [2, 1.5], B [0.5, 0], C [2, 2]
    # turn 0: (2, 0.5, 2), mean 1.5, std sqrt((0.25 + 1 + 0.25) / 2) = 0.866025 → A 0.5774, B −1.1547, C 0.5774
    # turn 1: (1.5, 0, 2), mean 7/6, std sqrt(((1/3)² + (7/6)² + (5/6)²) / 2) = 1.040833 → A 0.3203, B −1.1209
    torch.testing.assert_close(per_turn(adv, index, 0), torch.tensor([0.57735, -1.15470, 0.57735]), atol=1e-4, rtol=0)
    torch.testing.assert_close(per_turn(adv, index, 1), torch.tensor([0.32026, -1.12090, NAN]), atol=1e-4, rtol=0, equal_nan=True)
    # with progress_coef 0 it is turn_grpo
    torch.testing.assert_close(
        ADVANTAGES.get("turn_progress")(rewards, g, mask, turn_rewards=tr, turn_index=index, turn_progress=progress, progress_coef=0.0),
        ADVANTAGES.get("turn_grpo")(rewards, g, mask, turn_rewards=tr, turn_index=index))


def test_turn_to_token_and_the_extra_tensors():
    torch.testing.assert_close(turn_to_token(torch.tensor([[1.0, 2.0]]), torch.tensor([[0, 0, -1, 1, -1]]), torch.tensor([[1.0, 1, 0, 1, 0]])),
                               torch.tensor([[1.0, 1.0, 0.0, 2.0, 0.0]]))
    s = Sample("x", "p", "1")
    episode = Trajectory(s, "", [0], [5, 6, 7, 8, 9], [0.0] * 5, True, loss_mask=[1, 1, 0, 1, 1], turns=[(0, 2), (3, 5)],
                         info={"turn_rewards": [0.0, None], "turn_progress": [0.5, None]})
    later_part = Trajectory(s, "", [0], [5, 6], [0.0] * 2, True, turns=[(0, 2)],  # a split episode's second part: turn 2
                            info={"turn_rewards": [0.0, 0.0, 1.0], "first_turn": 2})
    single = Trajectory(s, "", [0], [5, 6, 7], [0.0] * 3, True)  # one turn, no info
    r, idx, p = turn_tensors([episode, later_part, single], 6)
    torch.testing.assert_close(r, torch.tensor([[0.0, 0.0, NAN], [0.0, 0.0, 1.0], [0.0, NAN, NAN]]), equal_nan=True)
    assert idx.tolist() == [[0, 0, -1, 1, 1, -1], [2, 2, -1, -1, -1, -1], [0, 0, 0, -1, -1, -1]]
    torch.testing.assert_close(p, torch.tensor([[0.5, NAN, NAN], [NAN, NAN, NAN], [NAN, NAN, NAN]]), equal_nan=True)


def test_the_loop_records_progress_and_the_first_turn():
    from _agents_env import Retry

    from assay.rollout.multiturn import Budget, MultiTurn

    class Scripted:  # answers "3", then "12" (right when the answer is 12)
        version = 0

        def __init__(self, tok):
            self.tok, self.n = tok, 0

        def generate(self, samples, n, params, generator=None):
            out = []
            for s in samples:
                text = ["3", "12"][self.n % 2]
                ids = self.tok(text, add_special_tokens=False)["input_ids"]
                out.append(Trajectory(s, text, list(s.prompt_ids), ids, [0.0] * len(ids), True))
            self.n += 1
            return out

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(load_config(None, []).model.path))
    loop = MultiTurn(Scripted(tok), tok, lambda: Retry(tries=3), Budget(max_turns=3, max_tokens=200))
    from assay.rollout.base import SamplingParams

    (t,) = loop.run([Sample("q", "what is 5+7? ", "12")], 1, SamplingParams(4))
    assert t.info["turn_rewards"] == [0.0, 1.0] and t.info["turn_progress"] == [0.0, 1.0] and t.info["first_turn"] == 0


@pytest.mark.parametrize("advantage", ["turn_grpo", "turn_progress"])
def test_assay_train_with_turn_credit_moves_the_weights(tmp_path, advantage):
    from _train_helpers import assert_learned

    from assay.report.metrics import read_metrics

    start = resolve_model_path(load_config(None, []).model.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    args = ["env.name=_agents_env:Retry", "env.max_turns=3", f"algo.advantage={advantage}", "rollout.prompts_per_step=4",
            "rollout.group_size=4", "train.steps=2", "train.eval_every=0", "train.eval_n=4", "optim.warmup_steps=0", "optim.lr=1e-3",
            "reward_workers=0", "train.threads=1", f"output_dir={tmp_path}", "run_name=r"]
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", *args], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert_learned(tmp_path / "r", start)
    rows = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and any(r["agent/turns_mean"] > 1 for r in rows)  # episodes of several turns were trained on


def test_in_a_run_the_turns_of_an_episode_get_their_own_advantages(tmp_path, monkeypatch):
    """The trainer builds the extras from real episodes: every model turn gets credit, environment tokens get 0."""
    import assay.training.rl as rl
    from assay.training.rl import Trainer

    seen = []
    real = rl.compute_advantages

    def capture(batch, algo, extras=None, args=None):
        adv = real(batch, algo, extras, args)
        seen.append((batch, adv, extras))
        return adv

    monkeypatch.setattr(rl, "compute_advantages", capture)
    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=r", "train.steps=1", "train.eval_every=0", "train.eval_n=4",
                             "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1",
                             "env.name=_agents_env:Retry", "env.max_turns=3", "algo.advantage=turn_progress"])
    Trainer(cfg).fit(progress=False)
    batch, adv, extras = seen[0]
    index = extras["turn_index"]
    assert index.shape == batch.mask.shape and (adv[index < 0] == 0).all() and (batch.mask[index >= 0] == 1).all()
    several = [i for i in range(adv.shape[0]) if int(index[i].max()) >= 1]
    assert several, "the run had no episode of several turns"
    r = batch.rewards
    varied = [i for i in several if r[batch.group == batch.group[i]].unique().numel() > 1]
    assert varied and all((adv[i][batch.mask[i] == 1] != 0).all() for i in varied)  # every turn's tokens got credit
    # and the advantages are the estimator's on the extras the trainer built
    torch.testing.assert_close(adv, ADVANTAGES.get("turn_progress")(r, batch.group, batch.mask, **extras))
