"""Advantage estimators against values worked out by hand, and against readable loop versions.

Every expected number below is derived in the comment next to it.
"""

import itertools
import math

import pytest
import torch

from assay.algos import ADVANTAGES, compute_gae, explained_variance, requirements, step_to_token
from assay.training.extras import EXTRAS
from assay.algos.advantages import group_stats

nan = math.nan
S3 = 1 / math.sqrt(3)  # 0.57735


def adv(name, rewards, group, mask=None, **extras):
    rewards = torch.tensor(rewards, dtype=torch.float32)
    group = torch.tensor(group)
    mask = torch.ones(len(rewards), 1) if mask is None else torch.tensor(mask, dtype=torch.float32)
    return ADVANTAGES.get(name)(rewards, group, mask, **extras)


def close(actual, expected, atol=1e-4):
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# ---------------------------------------------------------------- hand-worked values


def test_grpo_by_hand():
    # group [1, 2, 3]: mean 2, unbiased std 1 → [-1, 0, 1]
    close(adv("grpo", [1, 2, 3], [0, 0, 0])[:, 0], [-1, 0, 1])
    # NaN is left out: [1, 0] has mean 0.5, std √0.5 → ±0.7071; the NaN sample gets 0
    close(adv("grpo", [1, nan, 0], [0, 0, 0])[:, 0], [0.7071, 0, -0.7071])


def test_dr_grpo_and_rloo_by_hand():
    close(adv("dr_grpo", [1, 2, 3], [0, 0, 0])[:, 0], [-1, 0, 1])
    # RLOO: 1 − (2+3)/2 = −1.5, 2 − (1+3)/2 = 0, 3 − (1+2)/2 = 1.5
    close(adv("rloo", [1, 2, 3], [0, 0, 0])[:, 0], [-1.5, 0, 1.5])
    # a group with a single scored sample has no leave-one-out baseline → 0
    close(adv("rloo", [1, nan], [0, 0])[:, 0], [0, 0])


def test_reinforce_pp_by_hand():
    mask = [[1, 1], [1, 0]]
    # γ = 1: token returns 1, 1, 0 → mean 2/3, unbiased var 1/3 → (1 − 2/3)/0.57735 = 0.5774, (0 − 2/3)/0.57735 = −1.1547
    close(adv("reinforce_pp", [1, 0], [0, 1], mask), [[0.5774, 0.5774], [-1.1547, 0]])
    # γ = 0.5: returns 0.5, 1 | 0 → mean 0.5, unbiased std 0.5 → [0, 1], [−1, 0]
    close(adv("reinforce_pp", [1, 0], [0, 1], mask, gamma=0.5), [[0, 1], [-1, 0]])


def test_reinforce_pp_baseline_by_hand():
    # minus group means: [0.5, −0.5, 1, −1]; mean 0, unbiased var 2.5/3 → std 0.91287
    close(adv("reinforce_pp_baseline", [1, 0, 3, 1], [0, 0, 1, 1])[:, 0], [0.5477, -0.5477, 1.0954, -1.0954])


def test_remax_by_hand():
    # r − r_greedy; a NaN greedy reward gives 0
    out = adv("remax", [1, 0.5, 1], [0, 0, 1], greedy_rewards=torch.tensor([0.5, 0.5, nan]))
    close(out[:, 0], [0.5, 0, 0])


def test_gdpo_by_hand():
    comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    # column 1 [1, 0, 0]: mean 1/3, unbiased std 1/√3 → [1.1547, −0.5774, −0.5774]; column 2 mirrored
    # sum [0.5774, −1.1547, 0.5774] already has mean 0 and unbiased std 1, so batch whitening keeps it
    close(adv("gdpo", [1, 0, 1], [0, 0, 0], components=comps)[:, 0], [S3, -2 * S3, S3])
    # weights (2, 1), no batch norm: 2·[1.1547, −0.5774, −0.5774] + [−0.5774, −0.5774, 1.1547]
    out = adv("gdpo", [1, 0, 1], [0, 0, 0], components=comps, weights=[2.0, 1.0], batch_norm=False)
    close(out[:, 0], [3 * S3, -3 * S3, 0])


def test_gdpo_separates_what_grpo_collapses():
    # GDPO's motivating case: groups {(1,0), (0,0)} and {(1,1), (0,0)} both give GRPO on the summed
    # reward ±0.7071, though the second pair differs twice as much. GDPO: [.7071, −.7071] + 0 for the
    # first, [.7071, −.7071] · 2 for the second.
    comps = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
    close(adv("grpo", [1, 0, 2, 0], [0, 0, 1, 1])[:, 0], [0.7071, -0.7071, 0.7071, -0.7071])
    out = adv("gdpo", [1, 0, 2, 0], [0, 0, 1, 1], components=comps, batch_norm=False)
    close(out[:, 0], [0.7071, -0.7071, 1.4142, -1.4142])


def test_passk_binary_matches_closed_form():
    # n = 4, one correct, k = 2 (Chen et al.): R̄ = 1 − C(3,2)/C(4,2) = 0.5, σ = 0.5
    # A_pos = (1 − R̄)/σ = 1; A_neg = (1 − C(2,1)/C(3,1) − R̄)/σ = (1/3 − 1/2)/0.5 = −1/3
    close(adv("passk", [1, 0, 0, 0], [0] * 4, k=2)[:, 0], [1, -1 / 3, -1 / 3, -1 / 3])
    # k = 1 is GRPO with the population std: [1,0,0,0] → mean .25, std .4330 → [1.7321, −0.5774 ×3]
    close(adv("passk", [1, 0, 0, 0], [0] * 4, k=1)[:, 0], [3 * S3, -S3, -S3, -S3])
    # every k-subset of an all-equal group has the same max → 0
    close(adv("passk", [1, 1, 1], [0] * 3, k=2)[:, 0], [0, 0, 0])


def test_tailrl_by_hand():
    # [1,0,0,0]: τ ∈ (0, 1], only the best reaches it, p̂ = 1/4 → weight 4; baseline E[1{p̂>0}] = 1
    close(adv("tailrl", [1, 0, 0, 0], [0] * 4)[:, 0], [3, -1, -1, -1])
    # [0, .5, 1]: τ ∈ (0,.5] (p̂ 2/3, length .5 → .75), τ ∈ (.5,1] (p̂ 1/3 → 1.5)
    # first terms 0, .75, 2.25; minus 1
    close(adv("tailrl", [0, 0.5, 1], [0] * 3)[:, 0], [-1, -0.25, 1.25])
    # fixed range [0, 2], rewards [1, 0]: τ ∈ (0,1] → p̂ ½ → 2·1 over length 2 = 1; τ ∈ (1,2] reaches no one
    # baseline = P(p̂ > 0) = ½ → [0.5, −0.5]
    close(adv("tailrl", [1, 0], [0, 0], low=0.0, high=2.0)[:, 0], [0.5, -0.5])


def test_papo_by_hand():
    # outcome [1,1,0,0]: mean .5, unbiased std 1/√3 → ±0.8660
    # process among the correct: [.9, .5], mean .7, std .28284 → ±0.7071; incorrect get 0
    comps = torch.tensor([[0.9], [0.5], [0.8], [0.1]])
    out = adv("papo", [1, 1, 0, 0], [0] * 4, correct=torch.tensor([True, True, False, False]), components=comps)
    close(out[:, 0], [0.8660 + 0.7071, 0.8660 - 0.7071, -0.8660, -0.8660])


def test_compute_gae_by_hand():
    r, v, m = torch.tensor([1.0]), torch.tensor([[0.5, 0.6, 0.8]]), torch.ones(1, 3)
    a, ret = compute_gae(r, v, m, gamma=1.0, lam=1.0)
    close(a, [[0.5, 0.4, 0.2]])  # λ = 1: r − V_t
    close(ret, [[1.0, 1.0, 1.0]])
    # λ = .5: δ = (.1, .2, .2); A_2 = .2, A_1 = .2 + .5·.2 = .3, A_0 = .1 + .5·.3 = .25
    a, ret = compute_gae(r, v, m, gamma=1.0, lam=0.5)
    close(a, [[0.25, 0.3, 0.2]])
    close(ret, [[0.75, 0.9, 1.0]])
    # a hole in the mask is skipped: δ_0 = V_2 − V_0 = .3, A_0 = .3 + .2 = r − V_0 = .5
    a, _ = compute_gae(r, torch.tensor([[0.5, 9.0, 0.8]]), torch.tensor([[1.0, 0.0, 1.0]]))
    close(a, [[0.5, 0.0, 0.2]])


def test_evpo_gate_by_hand():
    # good critic: residuals ±.1, EV = 1 − .02/.5 = .96 > 0 → critic advantages r − V
    good = torch.tensor([[0.9], [0.1]])
    assert explained_variance(good, torch.tensor([[1.0], [0.0]]), torch.ones(2, 1)) == pytest.approx(0.96)
    close(adv("evpo", [1, 0], [0, 1], values=good)[:, 0], [0.1, -0.1])
    # bad critic: residuals ±1, EV = 1 − 2/.5 = −3 → batch mean baseline r − .5
    close(adv("evpo", [1, 0], [0, 1], values=torch.tensor([[0.0], [1.0]]))[:, 0], [0.5, -0.5])


def test_step_to_token_by_hand():
    vals = torch.tensor([[1.0, 2.0, 3.0], [4.0, nan, nan]])
    ends = torch.tensor([[1, 3, 4], [2, -1, -1]])
    mask = torch.tensor([[1.0] * 6, [1, 1, 1, 1, 0, 0]])
    # row 0: steps cover {0,1}, {2,3}, {4}; token 5 is after the last step; row 1: {0,1,2}, then nothing
    close(step_to_token(vals, ends, mask), [[1, 1, 2, 2, 3, 0], [4, 4, 4, 0, 0, 0]])


def test_pure_by_hand():
    steps = torch.tensor([[0.9, 0.2, 0.8], [0.5, 0.6, nan]])
    ends = torch.tensor([[1, 3, 4], [1, 2, -1]])
    mask = [[1] * 6, [1, 1, 1, 1, 0, 0]]
    # suffix minima: [.2, .2, .8] and [.5, .6]; trajectory values .2 and .5
    # leave-one-out baselines: .5 for row 0, .2 for row 1
    out = adv("pure", [1, 1], [0, 0], mask, step_rewards=steps, step_ends=ends)
    close(out, [[-0.3, -0.3, -0.3, -0.3, 0.3, 0.0], [0.3, 0.3, 0.4, 0.0, 0.0, 0.0]])


def test_grpo_process_by_hand():
    steps = torch.tensor([[1.0, 0.0], [1.0, nan]])
    ends = torch.tensor([[0, 1], [1, -1]])
    # the group's scored steps [1, 0, 1]: mean 2/3, unbiased std 1/√3 → r̃ = [.5774, −1.1547] and [.5774]
    # reward to go: row 0 [−.5774, −1.1547]; row 1 [.5774] over both tokens
    out = adv("grpo_process", [1, 1], [0, 0], [[1, 1], [1, 1]], step_rewards=steps, step_ends=ends)
    close(out, [[-S3, -2 * S3], [S3, S3]])


def test_frpo_by_hand():
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    ref = torch.tensor([[-2.0, -1.0], [-1.0, -1.5]])
    # GRPO ±.7071; future KL: row 0 ℓ = (1, 0) → (1, 0); row 1 ℓ = (0, .5) → (.5, .5); β = .1
    out = adv("frpo", [1, 0], [0, 0], [[1, 1], [1, 1]], logprobs=lp, ref_logprobs=ref, kl_coef=0.1)
    close(out, [[0.6071, 0.7071], [-0.7571, -0.7571]])


def test_requirements():
    assert requirements("grpo") == frozenset()
    assert requirements("gae") == {"values"}
    assert requirements("pure") == {"step_rewards", "step_ends"}
    assert requirements("os.path:join") == frozenset()  # a module:attr plugin that declares nothing
    for name, fn in ADVANTAGES.items():
        assert requirements(name) <= set(EXTRAS.names()), name  # the trainer can provide every declared extra


# ---------------------------------------------------------------- loop references on random inputs


def random_batch(seed, n_groups=4, size=5, T=6, binary=False):
    g = torch.Generator().manual_seed(seed)
    B = n_groups * size
    rewards = torch.randint(0, 2, (B,), generator=g).float() if binary else torch.rand(B, generator=g).round(decimals=1)
    rewards[torch.rand(B, generator=g) < 0.1] = nan
    group = torch.arange(n_groups).repeat_interleave(size)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    return rewards, group, mask, g


def members(group, rewards, i):
    return [j for j in range(len(group)) if group[j] == group[i] and not math.isnan(rewards[j])]


def ref_group_relative(rewards, group, kind):
    out = []
    for i in range(len(rewards)):
        if math.isnan(rewards[i]):
            out.append(0.0)
            continue
        rs = [rewards[j] for j in members(group, rewards, i)]
        n, mean = len(rs), sum(rs) / len(rs)
        std = math.sqrt(sum((r - mean) ** 2 for r in rs) / (n - 1)) if n > 1 else 0.0
        if kind == "grpo":
            out.append((rewards[i] - mean) / (std + 1e-6))
        elif kind == "dr_grpo":
            out.append(rewards[i] - mean)
        else:  # rloo
            out.append(rewards[i] - (sum(rs) - rewards[i]) / (n - 1) if n > 1 else 0.0)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_relative_matches_loop(name, seed):
    rewards, group, mask, _ = random_batch(seed)
    expected = torch.tensor(ref_group_relative(rewards.tolist(), group.tolist(), name))[:, None] * mask
    torch.testing.assert_close(ADVANTAGES.get(name)(rewards, group, mask), expected, atol=1e-5, rtol=1e-5)


def ref_passk(rewards, group, k):
    """Average GRPO over every k-subset: brute force with itertools.combinations."""
    out = [0.0] * len(rewards)
    for i in range(len(rewards)):
        if math.isnan(rewards[i]):
            continue
        idx = members(group, rewards, i)
        kk = min(k, len(idx))
        if len(idx) < 2:
            continue
        subsets = list(itertools.combinations(idx, kk))
        maxes = [max(rewards[j] for j in s) for s in subsets]
        mean = sum(maxes) / len(maxes)
        std = math.sqrt(sum((x - mean) ** 2 for x in maxes) / len(maxes))
        with_i = [mx for s, mx in zip(subsets, maxes) if i in s]
        out[i] = (sum(with_i) / len(with_i) - mean) / (std + 1e-6)
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_passk_matches_brute_force(k, seed):
    rewards, group, mask, _ = random_batch(seed, size=6)
    expected = torch.tensor(ref_passk(rewards.tolist(), group.tolist(), k))[:, None] * mask
    torch.testing.assert_close(ADVANTAGES.get("passk")(rewards, group, mask, k=k), expected, atol=1e-5, rtol=1e-5)


def ref_tailrl(rewards, group, grid=20000):
    """E_τ[1{r_i ≥ τ}/p̂(τ)] − E_τ[1{p̂ > 0}] by midpoint integration over τ ∈ [min, max]."""
    out = [0.0] * len(rewards)
    for i in range(len(rewards)):
        if math.isnan(rewards[i]):
            continue
        rs = [rewards[j] for j in members(group, rewards, i)]
        lo, hi = min(rs), max(rs)
        if hi <= lo:
            continue
        total = 0.0
        for step in range(grid):
            tau = lo + (hi - lo) * (step + 0.5) / grid
            p = sum(r >= tau for r in rs) / len(rs)
            total += ((rewards[i] >= tau) / p if p > 0 else 0.0) - (p > 0)
        out[i] = total / grid
    return out


@pytest.mark.parametrize("seed", range(2))
def test_tailrl_matches_numeric_integral(seed):
    rewards, group, mask, _ = random_batch(seed, n_groups=2, size=4, T=2)
    expected = torch.tensor(ref_tailrl(rewards.tolist(), group.tolist()))[:, None] * mask
    # midpoint rule on 20k points of a step function: error ≤ G · (#steps) / grid ≈ 1e-3
    torch.testing.assert_close(ADVANTAGES.get("tailrl")(rewards, group, mask), expected, atol=2e-3, rtol=0)


def ref_gae(rewards, values, mask, gamma, lam):
    out = []
    for r, v, m in zip(rewards.tolist(), values.tolist(), mask.tolist()):
        pos = [t for t, x in enumerate(m) if x]  # the response tokens, in order
        row, nxt_v, nxt_a = [0.0] * len(m), 0.0, 0.0
        for n, t in enumerate(reversed(pos)):
            reward = 0.0 if math.isnan(r) else (r if n == 0 else 0.0)
            delta = reward + gamma * nxt_v - v[t]
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = v[t]
            row[t] = 0.0 if math.isnan(r) else nxt_a
        out.append(row)
    return torch.tensor(out)


@pytest.mark.parametrize("seed", range(3))
def test_gae_matches_loop(seed):
    rewards, group, mask, g = random_batch(seed)
    mask[0, 1] = 0.0  # a multi-turn hole
    values = torch.rand(mask.shape, generator=g)
    a, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    expected = ref_gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, torch.where((expected != 0) | (mask.bool() & ~rewards.isnan()[:, None]), expected + values, 0.0), atol=1e-5, rtol=1e-5)


def ref_reinforce_pp(rewards, mask, gamma):
    rows, flat = [], []
    for r, m in zip(rewards.tolist(), mask.tolist()):
        pos = [t for t, x in enumerate(m) if x]
        row = [None] * len(m)
        if not math.isnan(r):
            for n, t in enumerate(pos):
                row[t] = r * gamma ** (len(pos) - 1 - n)
                flat.append(row[t])
        rows.append(row)
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1))
    return torch.tensor([[0.0 if x is None else (x - mean) / (std + 1e-8) for x in row] for row in rows])


@pytest.mark.parametrize("seed", range(3))
def test_reinforce_pp_matches_loop(seed):
    rewards, group, mask, _ = random_batch(seed)
    out = ADVANTAGES.get("reinforce_pp")(rewards, group, mask, gamma=0.9)
    torch.testing.assert_close(out, ref_reinforce_pp(rewards, mask, 0.9), atol=1e-5, rtol=1e-5)


def ref_gdpo(comps, rewards, group):
    B, K = comps.shape
    total = [0.0] * B
    for k in range(K):
        col = comps[:, k].tolist()
        normed = ref_group_relative(col, group.tolist(), "grpo")
        total = [t + n for t, n in zip(total, normed)]
    scored = [t for t, r in zip(total, rewards.tolist()) if not math.isnan(r)]
    mean = sum(scored) / len(scored)
    std = math.sqrt(sum((x - mean) ** 2 for x in scored) / (len(scored) - 1))
    return [0.0 if math.isnan(r) else (t - mean) / (std + 1e-6) for t, r in zip(total, rewards.tolist())]


@pytest.mark.parametrize("seed", range(3))
def test_gdpo_matches_loop(seed):
    rewards, group, mask, g = random_batch(seed)
    comps = torch.rand(len(rewards), 3, generator=g).round(decimals=1)
    comps[2, 1] = nan
    expected = torch.tensor(ref_gdpo(comps, rewards, group))[:, None] * mask
    torch.testing.assert_close(ADVANTAGES.get("gdpo")(rewards, group, mask, components=comps), expected, atol=1e-5, rtol=1e-5)


def ref_pure(rewards, group, mask, steps, ends):
    B, T = mask.shape
    S = steps.shape[1]
    traj = []
    for i in range(B):
        ps = [p for p in steps[i].tolist() if not math.isnan(p)]
        traj.append(nan if math.isnan(rewards[i]) or not ps else min(ps))
    out = torch.zeros(B, T)
    for i in range(B):
        others = [traj[j] for j in range(B) if j != i and group[j] == group[i] and not math.isnan(traj[j])]
        if math.isnan(traj[i]) or not others:
            continue
        b = sum(others) / len(others)
        for t in range(T):
            if not mask[i, t]:
                continue
            s = next((s for s in range(S) if ends[i, s] >= t), None)  # the step holding token t
            if s is None:
                continue
            later = [p for p in steps[i, s:].tolist() if not math.isnan(p)]
            if later:
                out[i, t] = min(later) - b
    return out


def random_steps(mask, g, S=3):
    B, T = mask.shape
    lengths = mask.sum(-1).long()
    steps = torch.full((B, S), nan)
    ends = torch.full((B, S), -1)
    for i in range(B):
        n = int(torch.randint(0, min(S, int(lengths[i])) + 1, (1,), generator=g))
        cuts = sorted(torch.randperm(int(lengths[i]), generator=g)[:n].tolist())
        ends[i, :n] = torch.tensor(cuts, dtype=torch.long)
        steps[i, :n] = torch.rand(n, generator=g).round(decimals=1)
    return steps, ends


@pytest.mark.parametrize("seed", range(3))
def test_pure_matches_loop(seed):
    rewards, group, mask, g = random_batch(seed)
    steps, ends = random_steps(mask, g)
    out = ADVANTAGES.get("pure")(rewards, group, mask, step_rewards=steps, step_ends=ends)
    torch.testing.assert_close(out, ref_pure(rewards, group, mask, steps, ends), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_step_to_token_matches_loop(seed):
    _, _, mask, g = random_batch(seed)
    steps, ends = random_steps(mask, g)
    B, T = mask.shape
    expected = torch.zeros(B, T)
    for i in range(B):
        for t in range(T):
            s = next((s for s in range(steps.shape[1]) if ends[i, s] >= t), None)
            if mask[i, t] and s is not None and not math.isnan(steps[i, s]):
                expected[i, t] = steps[i, s]
    torch.testing.assert_close(step_to_token(steps, ends, mask), expected)


def test_group_stats_counts_only_scored():
    mean, std, count = group_stats(torch.tensor([1.0, nan, 3.0, 5.0]), torch.tensor([0, 0, 0, 1]))
    close(mean, [2, 2, 2, 5])
    close(std, [math.sqrt(2)] * 3 + [0])
    close(count, [2, 2, 2, 1])
