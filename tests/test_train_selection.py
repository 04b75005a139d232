"""Group selection through the trainer: each piece selected from the config trains and logs its metrics."""

import random

import pytest

from assay.config import SelectionConfig
from assay.training.groups import PromptPicker
from assay.training.rl import Trainer
from assay.types import RewardResult, Sample, Trajectory
from test_train_algos import cfg, trained_steps


def run(model_dir, out, name, *extra, monkeypatch=None):
    """A 3-step run; returns its trained rows and, per step, the (completion, reward, group) rows it trained on."""
    seen: list[list[tuple[str, float, int, str]]] = []
    real = Trainer._update

    def spy(self, batch, advantages):
        trajs = self._last_trained
        seen.append([(t.completion, float(r), int(g), t.sample.id) for t, r, g in zip(trajs, batch.rewards, batch.group)])
        return real(self, batch, advantages)

    real_rollout = Trainer._rollout

    def keep(self):
        out = real_rollout(self)
        self._last_trained = out[0]
        return out

    monkeypatch.setattr(Trainer, "_update", spy)
    monkeypatch.setattr(Trainer, "_rollout", keep)
    d = Trainer(cfg(model_dir, out, name, *extra)).fit(progress=False).run_dir
    return trained_steps(d), seen


def groups_of(rows):
    by = {}
    for text, r, g, pid in rows:
        by.setdefault(g, []).append((text, r, pid))
    return list(by.values())


def test_dynamic_sampling_trains_only_informative_groups(tiny_model_dir, tmp_path, monkeypatch):
    rows, seen = run(tiny_model_dir, tmp_path, "dyn", "selection.dynamic=true", "selection.max_rounds=4",
                     "reward={name: random, args: {p: 0.2}}", monkeypatch=monkeypatch)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r, batch in zip(rows, seen):
        assert {"selection/rounds", "selection/kept_frac", "selection/filled"} <= r.keys()
        groups = groups_of(batch)
        assert len(groups) <= 3 and r["selection/filled"] == pytest.approx(len(groups) / 3)
        assert all(len({x for _, x, _ in g}) == 2 for g in groups)  # every trained group has both rewards
        # every round generated 3 prompts × 4 completions of at least one token
        assert r["rollout/tokens"] >= 3 * 4 * r["selection/rounds"]
    # p = 0.2 over 4 completions leaves 41% of the groups all-fail: refilling took extra rounds
    assert max(r["selection/rounds"] for r in rows) > 1 and min(r["selection/kept_frac"] for r in rows) < 1


def test_gold_injection_puts_the_verified_answer_into_all_fail_groups(tiny_model_dir, tmp_path, monkeypatch):
    rows, seen = run(tiny_model_dir, tmp_path, "gold", "selection.inject_gold=true", "reward=arithmetic", monkeypatch=monkeypatch)
    for r, batch in zip(rows, seen):
        # the random tiny model never solves arithmetic: all 3 groups fail, each gets its reference
        assert r["train/accuracy"] == 0.0 and r["selection/gold_injected"] == 3.0 and r["selection/gold_rejected"] == 0.0
        for g in groups_of(batch):
            assert len(g) == 4 and sorted(x for _, x, _ in g) == [0.0, 0.0, 0.0, 1.0]
        assert r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)  # the gold's π_old is the trainer's own
        assert r["actor/grad_norm"] > 0  # GRPO now has a signal: the gold gets A = +1.5, the rest −0.5
    # a reference the reward does not accept is not injected
    rows, _ = run(tiny_model_dir, tmp_path, "nogold", "selection.inject_gold=true", "selection.gold_field=ops", "reward=arithmetic", monkeypatch=monkeypatch)
    assert all(r["selection/gold_injected"] == 0.0 and r["selection/gold_rejected"] == 3.0 for r in rows)


def test_retry_buffer_brings_back_unsolved_prompts(tiny_model_dir, tmp_path, monkeypatch):
    rows, seen = run(tiny_model_dir, tmp_path, "retry", "selection.retry=true", "selection.retry_frac=0.5", "selection.retry_max=3", "reward=arithmetic",
                     monkeypatch=monkeypatch)
    # every group fails: step 1 fills the buffer with 3 prompts; steps 2 and 3 retry round(0.5 · 3) = 2 of them
    # (which fail again and go back) and add 1 fresh failure each
    assert [r["selection/retry_size"] for r in rows] == [3.0, 4.0, 5.0]
    assert [r["selection/retried_frac"] for r in rows] == [0.0, pytest.approx(2 / 3), pytest.approx(2 / 3)]
    assert rows[0]["selection/retry_solved_frac"] is None and rows[1]["selection/retry_solved_frac"] == 0.0
    ids = [{pid for *_, pid in batch} for batch in seen]
    assert len(ids[1] & ids[0]) == 2 and len(ids[2] & (ids[0] | ids[1])) == 2


def test_variance_prioritised_prompts_train_and_log(tiny_model_dir, tmp_path, monkeypatch):
    rows, seen = run(tiny_model_dir, tmp_path, "var", "selection.prompts=variance", "selection.pool_size=6",
                     "reward={name: random, args: {p: 0.5}}", monkeypatch=monkeypatch)
    distinct = set()
    for r, batch in zip(rows, seen):
        distinct |= {pid for *_, pid in batch}
        assert r["selection/prompts_seen"] == len(distinct)  # one estimate per prompt rolled out
        assert 0.0 <= r["selection/var_mean"] <= 0.25 and 0.0 <= r["selection/picked_var"] <= 0.25
    assert rows[0]["selection/picked_var"] == 0.25  # step 1: every candidate is new, at the prior


class Stream:
    """A stand-in for PromptSource: prompts p0, p1, … in order."""

    def __init__(self):
        self.i = 0

    def next_batch(self, n):
        out = [Sample(f"p{self.i + k}", f"{self.i + k}=") for k in range(n)]
        self.i += n
        return out


def group(sample, rewards):
    """One group's (trajectory, result) pairs, as the trainer hands them to the picker."""
    return [(Trajectory(sample, "", [], [], [], True), RewardResult(x)) for x in rewards]


def test_variance_picker_prefers_prompts_that_vary():
    """Priority (v̂ + floor)^4: 0.26⁴ ≈ 5e-3 against 0.01⁴ = 1e-8 makes the choice all but certain."""
    picker = PromptPicker(Stream(), SelectionConfig(prompts="variance", pool_size=8, var_temperature=4.0), batch=2, seed=0)
    first = picker.next(8)  # the pool is p0..p7, all new
    assert sorted(s.id for s in first) == sorted(f"p{i}" for i in range(8))
    picker.observe([group(s, [1, 0, 1, 0] if s.id == "p7" else [1, 1, 1, 1]) for s in first])
    flat = {f"p{i}" for i in range(7)}  # observed with variance 0
    for _ in range(6):
        picked = picker.next(2)  # adds 2 new prompts to the pool and drops its 2 oldest
        assert len(picked) == 2 and not {s.id for s in picked} & flat
        picker.observe([group(s, [1, 1, 1, 1]) for s in picked if s.id != "p7"])
        flat |= {s.id for s in picked if s.id != "p7"}
    assert picker.metrics()["selection/prompts_seen"] == len(flat) + 1


def test_picker_state_round_trips():
    c = SelectionConfig(prompts="variance", retry=True, retry_frac=0.5)
    a, b = PromptPicker(Stream(), c, 4, seed=0), PromptPicker(Stream(), c, 4, seed=0)
    for _ in range(3):
        picked = a.next(4)
        a.observe([group(s, [float(random.Random(f"{s.id}{k}").random() < 0.3) for k in range(4)]) for s in picked])
    assert len(a.retry) > 0
    a.metrics()  # a step ends: its counters reset, as at a checkpoint
    b.source.i = a.source.i
    b.load_state_dict(a.state_dict())
    assert [s.id for s in a.next(4)] == [s.id for s in b.next(4)]
    assert a.metrics() == b.metrics()
