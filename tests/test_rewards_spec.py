"""Reward blocks, `assay reward score`, the TRL adapter, monitors and the modules' doctests."""

import doctest
import importlib
import json
import pickle

import pytest

from _reward_helpers import traj
from assay.errors import AssayError
from assay.rewards.monitors import FormatOnlyReward, RandomReward, pearson, reward_health
from assay.rewards.scoring import score_file
from assay.rewards.spec import build_reward
from assay.rewards.transforms import Chain, Weighted
from assay.rewards.trl_adapter import to_trl
from assay.types import RewardResult

BLOCK = {
    "name": "weighted",
    "args": {"components": {"correct": {"name": "math"}, "fmt": {"name": "format_only"}}, "weights": {"correct": 1.0, "fmt": 0.5}},
    "transforms": [{"name": "clip", "args": {"high": 1.2}}, "scale"],
}


def test_build_composition_from_block():
    r = build_reward(BLOCK)
    assert isinstance(r, Chain) and isinstance(r.reward, Weighted)
    res = pickle.loads(pickle.dumps(r)).score(traj(r"\boxed{4}", "4"))
    assert res.score == 1.2 and res.components == {"correct": 1.0, "fmt": 1.0}


def test_build_from_yaml_and_path(tmp_path):
    p = tmp_path / "run.yaml"
    p.write_text("task: arithmetic\nreward:\n  name: math\n  args: {no_box: zero}\n")
    assert build_reward(str(p)).no_box == "zero"
    assert type(build_reward("assay.rewards.text:ExactMatch")).__name__ == "ExactMatch"
    assert type(build_reward("arithmetic")).__name__ == "ArithmeticReward"


@pytest.mark.parametrize("block,needle", [
    ({"name": "math", "argz": {}}, "unknown key 'argz'"),
    ({"name": "nope"}, "unknown reward 'nope'"),
    ({"name": "math", "args": {"boxed": 1}}, "unknown argument 'boxed' (value 1); allowed: no_box"),
    ({"name": "math", "args": {"no_box": "maybe"}}, "no_box must be"),
    ({"name": "weighted", "args": {"components": {"a": {"name": "nope"}}}}, "weighted].args.components.a.name"),
    ({"name": "math", "transforms": [{"name": "clipp"}]}, "unknown reward transform 'clipp'"),
    ({"name": "math", "transforms": [{"name": "clip", "args": {"lo": 0}}]}, "unknown argument 'lo'"),
    ({"name": "math", "transforms": "clip"}, "expected a list"),
    (42, "expected a reward name or a block"),
    ("missing.yaml", "reward file not found"),
])
def test_invalid_blocks_name_the_key(block, needle):
    with pytest.raises(AssayError) as e:
        build_reward(block)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_score_file(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    rows = [{"id": "a", "prompt": "p", "completion": r"\boxed{4}", "answer": "4"}, {"prompt": "p", "completion": "5", "answer": "4"},
            {"completion": r"\boxed{1}", "answer": r"\frac{"}]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    out = tmp_path / "out.jsonl"
    summary = score_file("math", str(src), str(out), workers=0, timeout=5.0)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", 1, 2] and [g["score"] for g in got] == [1.0, 0.0, None]
    assert set(got[0]) >= {"id", "score", "components", "info", "error"}
    assert summary["count"] == 3 and summary["mean"] == 0.5 and summary["none"] == 1 and summary["failures"] == 0
    assert "items_per_s" in capsys.readouterr().err


def test_score_file_invalid_utf8(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"completion": "\\\\boxed{4} \xff\xfe", "answer": "4"}\n')
    out = tmp_path / "out.jsonl"
    assert score_file("math", str(src), str(out), workers=0, timeout=1.0)["count"] == 1
    assert json.loads(out.read_text())["score"] == 1.0


def test_score_file_bad_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"completion": "1", "answer": "1"}\n{oops\n')
    with pytest.raises(AssayError, match=r"in.jsonl:2: malformed JSON line"):
        score_file("math", str(src), str(tmp_path / "o.jsonl"), workers=0, timeout=1.0)


def test_trl_adapter_called_like_trl():
    f = to_trl(BLOCK)
    logged = {}
    scores = f(prompts=[[{"role": "user", "content": "2+2?"}]] * 2,
               completions=[[{"role": "assistant", "content": r"\boxed{4}"}], [{"role": "assistant", "content": "five"}]],
               completion_ids=[[1, 2], [3]], answer=["4", "4"], trainer_state=None, log_metric=lambda k, v: logged.update({k: v}))
    assert scores == [1.2, 0.0] and f.__name__ == "Chain" and logged
    g = pickle.loads(pickle.dumps(to_trl("math")))
    assert g(prompts=["q"], completions=[r"\boxed{1}"], solution=[r"\frac{"]) == [None]


def test_reward_health_by_hand():
    results = [RewardResult(1.0, {"c": 1.0}), RewardResult(0.0, {"c": 0.0}), RewardResult(1.0), RewardResult(1.0),
               RewardResult(None), RewardResult.failed("timeout", reason="timeout")]
    m = reward_health(results, [0, 0, 1, 1, 2, 2], [10, 20, 30, 40, 5, 5])
    assert m["reward/mean"] == 0.75 and m["reward/c/mean"] == 0.5
    assert m["reward/failures"] == 1 and m["reward/none"] == 1 and m["reward/timeouts"] == 1
    # groups with a scored member: 0 = {1, 0}, 1 = {1, 1}; group 2 has none
    assert m["reward/saturated_group_frac"] == 0.5 and m["reward/zero_var_group_frac"] == 0.5
    # corr([1, 0, 1, 1], [10, 20, 30, 40]) = 0.2 / (0.4330 · 11.180) = 0.2582
    assert m["reward/length_corr"] == pytest.approx(0.258199, abs=1e-6)
    assert pearson([1.0, 1.0], [1.0, 2.0]) == 0.0


def test_control_rewards():
    r = RandomReward(p=0.5, seed=1)
    scores = [r.score(traj(f"c{i}")).score for i in range(400)]
    assert 150 < sum(scores) < 250 and scores == [r.score(traj(f"c{i}")).score for i in range(400)]
    assert FormatOnlyReward().score(traj(r"\boxed{wrong}", "4")).score == 1.0
    assert FormatOnlyReward().score(traj(r"\boxed{}", "4")).score == 0.0


@pytest.mark.parametrize("mod", ["math", "text", "transforms", "monitors", "spec", "executor", "trl_adapter", "serve"])
def test_doctests(mod):
    assert doctest.testmod(importlib.import_module(f"assay.rewards.{mod}")).failed == 0


def test_an_inline_yaml_block_is_a_reward_spec():
    from assay.rewards.spec import build_reward

    assert type(build_reward("{name: math, args: {}}")).__name__ == "MathReward"
    with pytest.raises(AssayError, match="is not a valid YAML block"):
        build_reward("{name: math")
