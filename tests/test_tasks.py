import itertools
from fractions import Fraction

import pytest

from assay.data.tasks import TASKS, in_heldout, make_task, parse_expression
from assay.data.tasks.countdown import ParseError
from assay.errors import AssayError
from assay.rewards.base import REWARDS
from assay.types import Sample, Trajectory


def traj(sample, completion):
    return Trajectory(sample, completion, [], [], [], True)


CALC_MIX = {"parts": [{"task": "arithmetic", "args": {"min_value": 1000, "max_value": 9999}},
                      {"task": "arithmetic", "args": {"min_value": 10, "ops": "*"}, "weight": 3}]}
TASK_CASES = [("arithmetic", {}), ("arithmetic", {"terms": 4, "ops": "+-*", "max_value": 20}), ("countdown", {}), ("countdown", {"count": 4, "max_value": 25}),
              ("mix", CALC_MIX)]


@pytest.mark.parametrize("name,args", TASK_CASES)
def test_verifier_accepts_its_own_gold(name, args):
    task = make_task(name, **args)
    reward = REWARDS.get(task.reward)()
    samples = task.heldout(300) + list(itertools.islice(task.stream("train", 1), 300))
    scores = [r.score for r in reward([traj(s, str(s.answer)) for s in samples])]
    assert scores == [1.0] * len(samples)


@pytest.mark.parametrize("name,args", TASK_CASES)
def test_splits_never_overlap_and_are_deterministic(name, args):
    task = make_task(name, **args)
    held = task.heldout(500)
    assert len({s.prompt for s in held}) == 500
    assert [s.prompt for s in held] == [s.prompt for s in make_task(name, **args).heldout(500)]
    train = {s.prompt for s in itertools.islice(task.stream("train", 7), 5000)}
    assert not train & {s.prompt for s in held}
    assert all(in_heldout(p, task.heldout_fraction) for p in (s.prompt for s in held))


def test_training_stream_depends_on_seed():
    task = make_task("arithmetic")
    a = [s.prompt for s in itertools.islice(task.stream("train", 0), 20)]
    b = [s.prompt for s in itertools.islice(task.stream("train", 1), 20)]
    assert a == [s.prompt for s in itertools.islice(task.stream("train", 0), 20)] and a != b


def test_arithmetic_values():
    reward = REWARDS.get("arithmetic")()
    s = Sample("x", "12+34-5=", "41")
    assert [r.score for r in reward([traj(s, c) for c in ["41", " 41 ", "42", "41 or 42", "41.0", "", "4 1"]])] == [1, 1, 0, 0, 0, 0, 0]
    assert reward([traj(Sample("y", "1+1=", "two"), "2")])[0].score is None
    assert reward([traj(s, "x")])[0].info["reason"] == "no_answer"


def test_arithmetic_bad_args():
    with pytest.raises(AssayError):
        make_task("arithmetic", ops="/")
    with pytest.raises(AssayError, match="min_value=100, max_value=99"):
        make_task("arithmetic", min_value=100)
    with pytest.raises(AssayError, match="unknown task"):
        make_task("nope")
    assert "countdown" in TASKS.names()


def test_parse_expression():
    assert parse_expression("(7-5)*3") == (Fraction(6), [7, 5, 3])
    assert parse_expression("10/4+ -1") == (Fraction(3, 2), [10, 4, 1])
    assert parse_expression("2×3÷4")[0] == Fraction(3, 2)
    for bad in ["", "1+", "(1+2", "1+2)", "3/(2-2)", "2**3", "__import__('os')", "1" * 7, "(" * 30 + "1" + ")" * 30, "1+" * 150 + "1"]:
        with pytest.raises(ParseError):
            parse_expression(bad)


def test_countdown_counts_numbers():
    reward = REWARDS.get("countdown")()
    s = Sample("c", "3 5 7>22:", "3*5+7", {"nums": [3, 5, 7], "target": 22})
    cases = {"3*5+7": 1.0, "7+3*5": 1.0, "3*5+7+0": 0.0, "7*3+1": 0.0, "3*5+7*1": 0.0, "5*5-3": 0.0, "(7+5)*3-14": 0.0, "3*5+7=22": 0.0, "21": 0.0}
    got = {c: reward([traj(s, c)])[0].score for c in cases}
    assert got == cases
    twice = Sample("d", "5 5 2>12:", "5+5+2", {"nums": [5, 5, 2], "target": 12})
    assert reward([traj(twice, "5+5+2")])[0].score == 1.0
    assert reward([traj(twice, "5+5+2")])[0].score == 1.0
    assert reward([traj(Sample("e", "", "", {"nums": [5, 2], "target": 7}), "5+5-3")])[0].info["reason"] == "numbers_not_allowed"
    assert reward([traj(Sample("f", "", "", {}), "1")])[0].score is None


def test_mix_draws_each_part_by_weight():
    samples = list(itertools.islice(make_task("mix", **CALC_MIX).stream("train", 0), 4000))
    sums = [s for s in samples if s.fields["ops"] == "+"]
    products = [s for s in samples if s.fields["ops"] == "*"]
    assert all(1000 <= n <= 9999 for s in sums for n in s.fields["nums"]) and all(10 <= n <= 99 for s in products for n in s.fields["nums"])
    assert 0.2 < len(sums) / len(samples) < 0.3  # weights 1 and 3


def test_mix_bad_parts():
    with pytest.raises(AssayError, match="share one verifier; got arithmetic, countdown"):
        make_task("mix", parts=[{"task": "arithmetic"}, {"task": "countdown"}])
    with pytest.raises(AssayError, match="parts is a list"):
        make_task("mix", parts=[{"name": "arithmetic"}])
    with pytest.raises(AssayError, match="unknown task"):
        make_task("mix", parts=[{"task": "nope"}])


def test_mix_docstring_example():
    import doctest

    import assay.data.tasks.mix

    assert doctest.testmod(assay.data.tasks.mix).failed == 0
