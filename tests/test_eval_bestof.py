"""`assay eval --best-of N --reward SPEC`: the curves by hand, then real seeded sampling of the bundled model with several selectors."""

import json
import subprocess
import sys

import pytest

from assay.eval.bestof import best_of_curve, majority, pick, sizes
from assay.eval.run import evaluate_best_of
from assay.rewards.base import Reward
from assay.types import RewardResult

N, PROBLEMS, SEED = 8, 40, 3


class AntiVerifier(Reward):
    """1 for a wrong arithmetic answer, 0 for a right one: the worst possible selector."""

    def score(self, traj):
        return RewardResult(float(traj.completion.strip() != str(traj.sample.answer)))


class Unscorable(Reward):
    """Scores only completions that are the right answer; None for every other (unscored counts lowest)."""

    def score(self, traj):
        return RewardResult(1.0 if traj.completion.strip() == str(traj.sample.answer) else None)


def test_the_curves_by_hand():
    assert sizes(1) == [1] and sizes(8) == [1, 2, 4, 8] and sizes(6) == [1, 2, 4, 6]
    assert pick([0.2, 0.9, 0.9]) == 1 and pick([None, -5.0, None]) == 1 and pick([None, None]) == 0
    assert majority(["7", "8", "8", "7"]) == 0 and majority(["1", "2", "2"]) == 1
    correct = [[False, True, False, True], [True, False, False, False]]
    scores = [[0.1, None, 0.7, 0.3], [None, 0.5, 0.5, None]]
    answers = [["5", "6", "5", "6"], ["3", "4", "4", "2"]]
    curve = best_of_curve(correct, scores, answers, [1, 2, 4])
    # n=1: both pick sample 0 (problem 2's None still the only one) -> [F, T]; pass [F, T]; majority = sample 0 -> [F, T]
    # n=2: p1 picks 0 (0.1 > None) F, p2 picks 1 (0.5 > None) F; pass [T, T]; majority p1 "5" (tie, first) F, p2 "3" T
    # n=4: p1 picks 2 (0.7) F, p2 picks 1 (first of the 0.5s) F; pass [T, T]; majority p1 "5" F, p2 "4" F
    assert curve == [{"n": 1, "best_of": 0.5, "pass": 0.5, "majority": 0.5}, {"n": 2, "best_of": 0.0, "pass": 1.0, "majority": 0.5},
                     {"n": 4, "best_of": 0.0, "pass": 1.0, "majority": 0.0}]


@pytest.fixture(scope="module")
def by_verifier():
    return evaluate_best_of(select="arithmetic", best_of=N, n=PROBLEMS, seed=SEED, workers=0)


def by_hand(out, picked):
    """The best-of curve recomputed from the per-problem records with a readable loop; `picked(correct, scores)` -> the pick's verdict."""
    rows = []
    for n in sizes(N):
        hits = [picked(p["correct"][:n], p["scores"][:n]) for p in out["per_problem"]]
        rows.append(sum(hits) / len(hits))
    return rows


def test_picking_by_the_verifier_itself_is_pass_at_n(by_verifier):
    out = by_verifier
    assert out["problems"] == PROBLEMS and [r["n"] for r in out["curve"]] == [1, 2, 4, 8]
    assert all(len(p["completions"]) == N for p in out["per_problem"])
    assert [r["best_of"] for r in out["curve"]] == [r["pass"] for r in out["curve"]]
    assert [r["pass"] for r in out["curve"]] == by_hand(out, lambda c, s: any(c))
    passes = [r["pass"] for r in out["curve"]]
    assert passes == sorted(passes) and passes[-1] > passes[0]  # real sampling: more samples find more right answers
    assert 0.0 < passes[0] < 1.0


def test_a_constant_selector_keeps_the_first_sample(by_verifier):
    out = evaluate_best_of(select="{name: regex, args: {pattern: '.'}}", best_of=N, n=PROBLEMS, seed=SEED, workers=0)
    assert [p["completions"] for p in out["per_problem"]] == [p["completions"] for p in by_verifier["per_problem"]]  # same seed, same samples
    first = sum(p["correct"][0] for p in out["per_problem"]) / PROBLEMS
    assert [r["best_of"] for r in out["curve"]] == [first] * 4 and out["curve"][0]["pass"] == first
    assert [r["majority"] for r in out["curve"]] == [r["majority"] for r in by_verifier["curve"]]  # majority ignores the selector


def test_the_worst_selector_is_right_only_when_every_sample_is(by_verifier):
    out = evaluate_best_of(select=AntiVerifier(), best_of=N, n=PROBLEMS, seed=SEED, workers=0)
    assert out["selector"] == "AntiVerifier"
    got = [r["best_of"] for r in out["curve"]]
    assert got == by_hand(out, lambda c, s: all(c)) and got == sorted(got, reverse=True) and got[0] > got[-1]


def test_unscored_samples_count_lowest(by_verifier):
    out = evaluate_best_of(select=Unscorable(), best_of=N, n=PROBLEMS, seed=SEED, workers=0)
    assert any(s is None for p in out["per_problem"] for s in p["scores"])
    assert [r["best_of"] for r in out["curve"]] == [r["pass"] for r in by_verifier["curve"]]  # a scored (right) sample always wins


def test_a_reward_model_picks(tmp_path, tiny_model_dir):
    from assay.rm.config import load_rm_config
    from assay.rm.pairs import build_pairs, write_pairs
    from assay.rm.train import train_rm

    write_pairs(tmp_path / "pairs.jsonl", build_pairs(n=64, seed=0))
    cfg = load_rm_config(None, [f"model={tiny_model_dir}", f"data.path={tmp_path / 'pairs.jsonl'}", f"output_dir={tmp_path}", "run_name=rm",
                                "train.threads=1", "train.batch_size=8", "train.steps=4", "data.eval_fraction=0.25"])
    run = train_rm(cfg).run_dir
    out = evaluate_best_of(select={"name": "rm", "args": {"path": str(run)}}, best_of=4, n=12, seed=SEED, workers=0)
    assert out["selector"] == "rm" and all(isinstance(s, float) for p in out["per_problem"] for s in p["scores"])
    curve = out["curve"]
    assert curve[0]["best_of"] == curve[0]["pass"]  # one sample: every selector picks it
    assert all(r["best_of"] <= r["pass"] for r in curve)
    picked = [sum(p["correct"][max(range(n), key=lambda j: (p["scores"][j], -j))] for p in out["per_problem"]) / 12 for n in (1, 2, 4)]
    assert [r["best_of"] for r in curve] == picked


def assay(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_cli_prints_the_table_and_writes_json_and_png(tmp_path):
    p = assay("eval", "--best-of", "4", "--reward", "arithmetic", "--n", "20", "--seed", "1", "--workers", "0", "--out", str(tmp_path / "bo"))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "best-of-n by arithmetic, verified by arithmetic, on 20 problems:" and lines[1].split() == ["n", "best_of", "pass@n", "maj@n"]
    out = json.loads((tmp_path / "bo" / "bestof.json").read_text())
    assert [line.split()[0] for line in lines[2:]] == ["1", "2", "4"] and len(out["per_problem"]) == 20
    assert [float(line.split()[1]) for line in lines[2:]] == [round(r["best_of"], 4) for r in out["curve"]]
    assert (tmp_path / "bo" / "bestof.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    p = assay("eval", "--best-of", "4", "--reward", "arithmetic", "--n", "20", "--seed", "1", "--workers", "0", "--out", str(tmp_path / "again"),
              "--json")
    assert json.loads(p.stdout)["curve"] == out["curve"]  # seeded: the same samples, the same curve


@pytest.mark.parametrize("args, needle", [
    (["--best-of", "4", "--reward", "nope"], "unknown reward 'nope'"),
    (["--best-of", "4", "--reward", "{name: rm, args: {path: /no/such/rm}}"], "holds no reward model"),
    (["--best-of", "0", "--reward", "arithmetic"], "--best-of must be at least 1"),
    (["--best-of", "4"], "--best-of needs --reward SPEC"),
    (["--verifier", "arithmetic"], "--verifier goes with --best-of"),
])
def test_bad_input_is_one_line(tmp_path, args, needle):
    p = assay("eval", *args, "--n", "4", "--out", str(tmp_path / "x"))
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("assay: error:") and needle in lines[0], p.stderr


def test_docstring_examples():
    import doctest

    import assay.eval.bestof

    assert doctest.testmod(assay.eval.bestof).failed == 0
