"""Group selection: DAPO dynamic sampling, ground-truth injection, retry buffer, variance priority."""

import json
import math
import random

import pytest

from assay.data.selection import (
    DynamicFilter, RetryBuffer, VariancePriority, informative, inject_ground_truth,
)


def test_informative_groups():
    # mixed: keep; all solved: drop; one scored: drop (twice); mixed: keep; equal within tol: drop; empty: drop
    groups = [[1.0, 0.0], [1.0, 1.0], [0.0, None], [0.5, math.nan], [0.5, 0.7], [0.5, 0.5 + 1e-9], []]
    assert [informative(g) for g in groups] == [True, False, False, False, True, False, False]


def test_dynamic_sampler_fills_the_batch_over_rounds():
    s = DynamicFilter(target_groups=3, max_rounds=5)
    assert s.add([["a"] * 2, ["b"] * 2], [[1, 1], [1, 0]]) == 1  # "a" all solved
    assert not s.done
    assert s.add([["c"] * 2, ["d"] * 2, ["e"] * 2], [[0, 0.5], [0, 0], [1, 0]]) == 2
    assert s.ready and s.done
    assert s.metrics() == {"selection/rounds": 2.0, "selection/kept_frac": 3 / 5, "selection/filled": 1.0}
    groups, rewards = s.take()
    assert [g[0] for g in groups] == ["b", "c", "e"] and rewards[1] == [0, 0.5]
    assert s.rounds == 0 and not s.done  # reset for the next batch


def test_dynamic_sampler_bounds_extra_generation():
    s = DynamicFilter(target_groups=4, max_rounds=2)
    s.add([["a"]], [[1, 0]])
    s.add([["b"]], [[0, 0]])
    assert s.exhausted and s.done and not s.ready  # two rounds used up: train on what there is
    assert s.metrics()["selection/filled"] == 0.25
    groups, _ = s.take()
    assert groups == [["a"]]
    # surplus groups beyond the target are dropped
    s = DynamicFilter(target_groups=1)
    s.add([["x"], ["y"]], [[1, 0], [0, 1]])
    assert s.take()[0] == [["x"]]
    with pytest.raises(ValueError):
        s.add([["x"]], [])
    with pytest.raises(ValueError):
        DynamicFilter(target_groups=0)


def test_inject_ground_truth():
    # all failed: the gold replaces the lowest-reward sample, with the maximal reward
    assert inject_ground_truth(["x", "y", "z"], [0.2, 0.0, 0.5], "gold") == (["x", "gold", "z"], [0.2, 1.0, 0.5], True)
    # unscored samples are never the ones replaced while a scored one exists
    assert inject_ground_truth(["x", "y"], [None, 0.0], "g", gold_reward=2.0) == (["x", "g"], [None, 2.0], True)
    assert inject_ground_truth(["x"], [0.0], "g", replace=False) == (["x", "g"], [0.0, 1.0], True)
    # no injection when one succeeded, none was scored, or there is no gold
    assert inject_ground_truth(["x", "y"], [1.0, 0.0], "g")[2] is False
    assert inject_ground_truth(["x", "y"], [None, math.nan], "g")[2] is False
    assert inject_ground_truth(["x", "y"], [0.0, 0.0], None)[2] is False
    assert inject_ground_truth(["x", "y"], [0.6, 0.0], "g", success=0.5)[2] is False
    # the caller's lists are not modified
    group, rewards = ["x", "y"], [0.0, 0.0]
    inject_ground_truth(group, rewards, "g")
    assert group == ["x", "y"] and rewards == [0.0, 0.0]


def test_retry_buffer_lifecycle():
    rng = random.Random(0)
    buf = RetryBuffer(max_retries=2)
    buf.update("solved", [1, 0])
    buf.update("hard", [0, 0])
    buf.update("unscored", [None, None])  # nothing learned: not added
    assert len(buf) == 1 and "hard" in buf
    assert buf.sample(3, rng) == ["hard"]
    assert len(buf) == 0 and buf.sample(3, rng) == []  # handed out until its next update
    buf.update("hard", [0, 0])  # retry 1 failed: back in
    assert "hard" in buf
    assert buf.sample(1, rng) == ["hard"]
    buf.update("hard", [0, 0])  # retry 2 failed: given up
    assert len(buf) == 0
    buf.update("p", [0, 0])
    buf.sample(1, rng)
    buf.update("p", [1, 1])  # solved on retry: forgotten
    assert len(buf) == 0


def test_retry_buffer_capacity_and_state():
    buf = RetryBuffer(capacity=2, max_retries=5)
    for p in ["a", "b", "c"]:
        buf.update(p, [0.0])
    assert "a" not in buf and len(buf) == 2  # oldest evicted
    buf.sample(1, random.Random(1))
    state = json.loads(json.dumps(buf.state_dict()))
    again = RetryBuffer(capacity=2, max_retries=5)
    again.load_state_dict(state)
    assert again.state_dict() == buf.state_dict()
    assert again.sample(5, random.Random(2)) == buf.sample(5, random.Random(2))


def test_variance_sampler_estimates():
    s = VariancePriority(decay=0.5)
    s.update("p", [1, 0, 1, 0])  # population variance .25
    assert s.variance("p") == pytest.approx(0.25)
    s.update("p", [1, 1, 1, 1])  # EMA: .5 · .25 + .5 · 0
    assert s.variance("p") == pytest.approx(0.125)
    s.update("p", [1, None])  # fewer than two scored: ignored
    assert s.variance("p") == pytest.approx(0.125)
    assert s.variance("unseen") == 0.25 and s.priority("unseen") == pytest.approx(0.26)
    assert s.metrics() == {"selection/var_mean": pytest.approx(0.125), "selection/prompts_seen": 1.0}


def test_variance_sampler_prefers_informative_prompts():
    s = VariancePriority(floor=0.01)
    for i in range(10):
        s.update(f"flat{i}", [1, 1, 1, 1])  # priority .01
    s.update("edge", [1, 0, 1, 0])  # priority .26
    rng = random.Random(0)
    picks = [s.sample([f"flat{i}" for i in range(10)] + ["edge"], 2, rng) for _ in range(300)]
    assert all(len(set(p)) == 2 for p in picks)  # without replacement
    # P(edge among the two) is close to 1 (.26 against ten prompts at .01); a uniform draw gives 2/11
    assert sum("edge" in p for p in picks) / len(picks) > 0.9
    assert s.sample(["a", "b"], 5, rng) and len(s.sample(["a", "b"], 5, rng)) == 2


def test_variance_sampler_state_roundtrip():
    s = VariancePriority()
    s.update("p", [0, 1])
    t = VariancePriority()
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.variance("p") == s.variance("p")
    assert t.sample(["p", "q", "r"], 2, random.Random(3)) == s.sample(["p", "q", "r"], 2, random.Random(3))
