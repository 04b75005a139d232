"""The multi-step task `arithmetic_steps`, its step-noisy demonstrations, and the bundled `tiny-steps` policy."""

import itertools
import json
import random
import re

import pytest

from assay.data.tasks import make_task
from assay.errors import AssayError
from assay.models import ALPHABET, BUNDLED_DIR, build_char_tokenizer
from assay.recipes.noisy import add_without_carry, forget_carry_steps, noisy_answers
from assay.rewards.base import REWARDS
from assay.types import Sample, Trajectory


def traj(sample, completion):
    return Trajectory(sample, completion, [], [], [], True)


def test_task_writes_running_sums_and_verifies_the_last_line():
    task = make_task("arithmetic_steps")
    s = next(task.stream("train", 0))
    nums = s.fields["nums"]
    assert s.prompt == "+".join(map(str, nums)) + "=" and len(nums) == 4
    assert s.fields["steps"] == list(itertools.accumulate(nums))[1:]
    a, b, c, d = nums
    x, y, z = s.fields["steps"]
    assert task.solution(s) == f"{a}+{b}={x}\n{x}+{c}={y}\n{y}+{d}={z}" and s.answer == str(sum(nums)) == str(z)
    reward = REWARDS.get(task.reward)()
    wrong = str(int(s.answer) + 1)
    cases = {task.solution(s): 1.0, task.solution(s) + "\n": 1.0, s.answer: 1.0, f"1\n2=3\n5+6 = {s.answer}": 1.0,  # the last line decides
             f"{s.answer}\n{wrong}": 0.0, f"1+2={s.answer}\n3+4={wrong}": 0.0, f"{s.answer}=": 0.0, "": 0.0, "\n\n": 0.0, f"{s.answer} 5": 0.0}
    assert [r.score for r in reward([traj(s, c) for c in cases])] == list(cases.values())
    assert reward([traj(Sample("x", "1+2=", None), "3")])[0].score is None
    held = task.heldout(200)
    assert [r.score for r in reward([traj(h, task.solution(h)) for h in held])] == [1.0] * 200
    with pytest.raises(AssayError, match="arithmetic"):
        make_task("arithmetic_steps", terms=1)


def test_step_noise_forgets_carries_per_step_and_errors_carry_forward():
    task = make_task("arithmetic_steps")
    s = Sample("x", "12+34+56+78=", "180", {"nums": [12, 34, 56, 78], "ops": "+++", "steps": [46, 102, 180]})
    assert forget_carry_steps(s, random.Random(0), 0.0) == task.solution(s) == "12+34=46\n46+56=102\n102+78=180"
    assert forget_carry_steps(s, random.Random(0), 1.0) == "12+34=46\n46+56=92\n92+78=60"  # the carry forgotten, and the error carried on
    assert add_without_carry(92, 78) == 60
    samples = list(itertools.islice(task.stream("train", 0), 2000))
    demos = list(noisy_answers(samples, 0.3, "forget_carry_steps", random.Random(0)))
    right = sum(d == task.solution(x) for (_, d), x in zip(demos, samples)) / len(samples)
    assert 0.45 < right < 0.75  # at most 0.7³ ≈ 0.34 of the three steps all careful, but many steps have no carry to forget
    with pytest.raises(AssayError, match="unknown corruption"):
        list(noisy_answers(samples[:1], 0.3, "nope", random.Random(0)))
    with pytest.raises(AssayError, match="needs a sum"):
        forget_carry_steps(Sample("x", "1-2=", "-1", {"nums": [1, 2], "ops": "-"}), random.Random(0), 0.5)


def test_newline_tokenizer_and_the_default_one_unchanged():
    default = build_char_tokenizer()
    assert json.loads(default.backend_tokenizer.to_str())["pre_tokenizer"]["pattern"] == {"Regex": "."}
    tok = build_char_tokenizer(ALPHABET + "\n")
    ids = tok("1+2=3\n3+4=7", add_special_tokens=False)["input_ids"]
    assert len(ids) == 11 and tok.unk_token_id not in ids and tok.decode(ids) == "1+2=3\n3+4=7"
    assert {k: v for k, v in tok.get_vocab().items() if k != "\n"} == default.get_vocab()


def test_bundled_tiny_steps_writes_multi_line_solutions():
    import torch

    from assay.models import load_policy
    from assay.rollout.base import SamplingParams, make_sampler

    figures = json.loads((BUNDLED_DIR / "tiny-steps" / "model" / "eval.json").read_text())
    assert figures["recipe"] == "tiny-steps" and figures["n"] == 500
    task = make_task("arithmetic_steps")
    held = task.heldout(40)
    policy, tok = load_policy("tiny-steps")
    sampler = make_sampler("torch", policy, tok, None, "cpu")
    trajs = sampler.generate(held, 1, SamplingParams(max_new_tokens=32, temperature=0.0), torch.Generator().manual_seed(0))
    sampler.close()
    lines = [t.completion.strip().split("\n") for t in trajs]
    assert sum(len(x) == 3 for x in lines) >= 36  # three additions, one per line
    assert sum(bool(re.fullmatch(r"\d+\+\d+=\d+", ln)) for x in lines for ln in x) >= 0.9 * sum(map(len, lines))
    scores = [r.score for r in REWARDS.get(task.reward)()(trajs)]
    assert 0.1 <= sum(scores) / len(scores) <= 0.95  # often right, often not: the noise the recipe put in


def test_label_steps_keeps_rollouts():
    from assay.rm.label_steps import label_steps

    rows = label_steps("tiny-steps", "arithmetic_steps", problems=2, samples=1, rollouts=2, steps="newline", max_new_tokens=32, keep_rollouts=True)
    assert rows
    for r in rows:
        assert r["split"] == "newline" and "".join(r["steps"]) == r["completion"]
        assert len(r["finished"]) == 2 * (len(r["steps"]) - 1)
        assert all(isinstance(ok, bool) and text.startswith(r["steps"][0]) for text, ok in r["finished"])
    assert "finished" not in label_steps("tiny-steps", "arithmetic_steps", problems=1, samples=1, rollouts=1, steps="newline", max_new_tokens=32)[0]
