"""Every composition and transform against values worked out by hand."""

import math

import pytest

from _reward_helpers import traj
from assay.rewards.base import Reward
from assay.rewards.transforms import (Chain, Clip, Gate, LengthNorm, Minimum, OverlongPenalty, Par, Pessimistic, Scale, StepCap,
                                      StepClip, StepDelta, Tiers, Weighted, overlong_penalty, pessimistic_value)
from assay.types import RewardResult


class Const(Reward):
    """Scores a fixed value (with optional steps)."""

    def __init__(self, value, steps=None):
        self.value, self.steps = value, steps

    def score(self, t):
        return RewardResult(self.value, steps=list(self.steps) if self.steps else None)


class FieldScore(Reward):
    """Scores float(completion): lets a test choose the reward of a reference response."""

    def score(self, t):
        return RewardResult(float(t.completion))


T = traj("hello")


def test_weighted():
    r = Weighted({"a": Const(1.0), "b": Const(0.5)}, {"a": 2.0, "b": -1.0}).score(T)
    assert r.score == 1.5  # 2·1 − 1·0.5
    assert r.components == {"a": 1.0, "b": 0.5}
    assert Weighted([Const(1.0), Const(2.0)]).score(T).score == 3.0
    with pytest.raises(ValueError):
        Weighted({"a": Const(1.0)}, {"z": 1.0})


def test_none_and_failure_propagate():
    assert Weighted({"a": Const(1.0), "b": Const(None)}).score(T).score is None

    class Boom(Reward):
        def score(self, t):
            raise RuntimeError("x")

    r = Weighted({"a": Const(1.0), "bad": Boom()}).score(T)
    assert r.error.startswith("component bad: RuntimeError") and r.components == {"a": 1.0}


def test_gate():
    g = Gate(Const(1.0), Const(0.3, steps=[0.1, 0.2]), threshold=1.0, weight=0.5)
    r = g.score(T)
    assert r.score == pytest.approx(1.15) and r.steps == [0.1, 0.2]  # 1 + 0.5·0.3
    r = Gate(Const(0.0), Const(0.3, steps=[0.1, 0.2])).score(T)
    assert r.score == 0.0 and r.steps == [0.0, 0.0] and r.components["gate"] == 0.0


def test_tiers():
    t = Tiers({"compiles": Const(1.0), "passes": Const(0.0)}, levels=[-1.0, -0.5, 1.0])
    assert t.score(T).score == -0.5
    assert Tiers({"compiles": Const(0.0), "passes": Const(1.0)}, levels=[-1.0, -0.5, 1.0]).score(T).score == -1.0  # order matters
    assert Tiers({"a": Const(1.0), "b": Const(1.0)}).score(T).score == 1.0
    assert Tiers({"a": Const(1.0), "b": Const(0.0)}).score(T).score == 0.5  # default levels k/K
    with pytest.raises(ValueError):
        Tiers({"a": Const(1.0)}, levels=[0.0])


def test_minimum():
    assert Minimum({"a": Const(0.2), "b": Const(-0.4)}).score(T).score == -0.4


def test_pessimistic():
    # −β log((e^{−0/1} + e^{−2/1}) / 2) = −log((1 + e^{−2}) / 2)
    assert pessimistic_value([0.0, 2.0], 1.0) == pytest.approx(-math.log((1 + math.exp(-2)) / 2))
    assert pessimistic_value([0.0, 2.0], 1.0) == pytest.approx(0.566219, abs=1e-6)
    assert pessimistic_value([0.0, 2.0], 1e-3) == pytest.approx(0.0 + 1e-3 * math.log(2), abs=1e-9)  # β→0: min
    assert pessimistic_value([0.0, 2.0], 1e4) == pytest.approx(1.0, abs=1e-3)  # β→∞: mean
    assert pessimistic_value([500.0, 1000.0], 0.01) == pytest.approx(500.0 + 0.01 * math.log(2))  # stable
    assert Pessimistic({"a": Const(0.0), "b": Const(2.0)}).score(T).score == pytest.approx(0.566219, abs=1e-6)


def test_par():
    p = Par(FieldScore(), reference_field="ref")
    # σ(2 − 1) = 1 / (1 + e^{−1}) = 0.731059
    assert p.score(traj("2", ref="1")).score == pytest.approx(0.731059, abs=1e-6)
    # mean of σ(0) = 0.5 and σ(2) = 0.880797
    assert p.score(traj("1", ref=["1", "-1"])).score == pytest.approx((0.5 + 0.880797) / 2, abs=1e-6)
    assert Par(FieldScore(), reference_score_field="rs").score(traj("0", rs=0.0)).score == 0.5
    assert p.score(traj("1")).score is None


def test_overlong_penalty():
    # L_max = 10, L_cache = 4: 0 up to 6, (6 − L)/4 in (6, 10], −1 beyond
    assert [overlong_penalty(n, 10, 4) for n in (6, 7, 8, 10, 11)] == [0.0, -0.25, -0.5, -1.0, -1.0]
    r = Chain(Const(1.0), [OverlongPenalty(10, 4, unit="chars")]).score(traj("x" * 8))
    assert r.score == 0.5 and r.components["overlong"] == -0.5


def test_length_norm_clip_scale():
    assert Chain(Const(2.0), [LengthNorm(alpha=1.0, unit="chars")]).score(traj("abcd")).score == 0.5  # 2 / 4
    assert Chain(Const(2.0), [LengthNorm(alpha=0.5, unit="chars")]).score(traj("abcd")).score == 1.0  # 2 / √4
    assert Chain(Const(3.0), [Scale(2.0, -1.0), Clip(-1.0, 4.0)]).score(T).score == 4.0  # clip(2·3 − 1)
    assert Chain(Const(3.0), [Clip(-1.0, 4.0), Scale(2.0, -1.0)]).score(T).score == 5.0  # order matters


def test_step_transforms():
    steps = [0.5, 0.9, 0.2]
    r = Chain(Const(0.0, steps), [StepClip(eta=0.6)]).score(T)
    assert r.steps == pytest.approx([-0.1, 0.0, -0.4]) and r.score == pytest.approx(-0.5)
    r = Chain(Const(0.0, steps), [StepDelta()]).score(T)
    assert r.steps == pytest.approx([-0.4, 0.7, 0.2]) and r.score == pytest.approx(0.5)  # telescopes to r_1
    r = Chain(Const(0.0, steps), [StepCap(1.0)]).score(T)
    assert r.steps == pytest.approx([0.5, 0.5, 0.0]) and r.score == pytest.approx(1.0)
    assert Chain(Const(0.7), [StepClip()]).score(T).score == 0.7  # no steps: unchanged


def test_hparams_readable():
    c = Chain(Weighted({"a": Const(1.0)}, {"a": 2.0}), [Clip(0, 1), OverlongPenalty(10, 2)])
    hp = c.hparams()
    assert hp["transforms"] == [{"clip": {"low": 0, "high": 1}}, {"overlong_penalty": {"max_len": 10, "cache": 2, "weight": 1.0, "unit": "tokens"}}]
    assert hp["reward"]["weights"] == {"a": 2.0} and hp["reward"]["components"]["a"]["name"] == "Const"
