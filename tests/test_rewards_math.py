"""The math verifier on hand-written cases, each failure mode of verifiers.md §3 included."""

import pytest

from _reward_helpers import traj
from assay.rewards.math import MathReward, extract_answer, find_boxes, numbers_match

ACCEPT = [
    (r"so the answer is \boxed{2}.", "2"),
    (r"**Final Answer** \[\boxed{7}\]", "7"),
    (r"The answer is $\frac{1}{2}$.", "0.5"),
    ("Answer: 3", "3"),
    ("42", "42"),
    (r"\fbox{12}", "12"),
    (r"\boxed{1,234}", "1234"),
    (r"\boxed{1{,}234}", "1234"),
    (r"\boxed{5.0}", "5"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34"),
    (r"\boxed{x = 5}", "5"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}"),
    (r"First guess \boxed{117}; final answer: \boxed{116}", "116"),  # a later box after prose replaces the first
    (r"\boxed{3} is wrong, the answer is \boxed{4}", "4"),
    (r"\boxed{4}. Let me double check: \boxed{4}", "4"),
    (r"\boxed{-5 < x \le 1}", "(-5, 1]"),  # inequality against an interval
    (r"\boxed{x \ge 1}", r"[1, \infty)"),
    (r"\boxed{82}", r"82\%"),  # percentage variants when the gold carries %
    (r"\boxed{0.82}", r"82\%"),
    (r"\boxed{5\%}", "5"),
    (r"\boxed{30^\circ}", "30"),
    (r"\boxed{\$5}", "5"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}"),
    (r"\boxed{2}, \boxed{3}", "2, 3"),  # a list gold accepts a list of boxes
    (r"\boxed{C}", "C"),
    (r"\boxed{2}. Wait, let me verify: 1+1=2. Yes.", "2"),
    (r"<think>maybe \boxed{3}</think> The answer is \boxed{4}.", "4"),
    (r"\boxed{0.3333}", r"\frac{1}{3}"),
    (r"The answer is $166$. Actually no, it is 167.", "167"),  # the correction is the final answer
    (r"\boxed{x < -2 \text{ or } x > 3}", r"(-\infty, -2) \cup (3, \infty)"),
    ("The answer is **C**.", "C"),
    ("The answer is −5.", "-5"),  # unicode minus, π, √, ≤
    (r"\boxed{2π}", r"2\pi"),
    (r"\boxed{x ≤ 3}", r"(-\infty, 3]"),
    ("#### 42", "42"),
    ("x = 5", "5"),
]

REJECT = [
    (r"\boxed{2} or \boxed{3}", "2", "multi_answer"),  # hedged boxes
    ("The answer is 2 or 3.", "2", "hedged"),
    (r"\boxed{2 \text{ or } 3}", "2", "hedged"),
    (r"\boxed{\pm 2}", "2", "hedged"),
    (r"\boxed{2, 3}", "2", "multi_answer"),
    (r"\boxed{1} and \boxed{234}", "1234", "multi_answer"),  # merged-box exploit
    (r"It is \boxed{2}, or maybe \boxed{3}", "3", "hedged"),
    (r"The answer is $166$. Actually no, it is 167.", "166", "wrong"),  # correction after the answer
    (r"\boxed{166}. Wait, that's wrong: it is 167.", "166", "wrong"),
    (r"\boxed{5} or 6", "5", "hedged"),
    ("The answer is $5$ and $6$.", "5", "hedged"),
    (r"The answer is \boxed{5}, or possibly 6.", "5", "hedged"),
    (r"\boxed{0.1234568}", "0.1234567", "wrong"),  # 7-digit rounding tolerance
    (r"\boxed{10001}", "10000", "wrong"),
    (r"\boxed{8200}", r"82\%", "wrong"),
    (r"\boxed{500}", "5", "wrong"),  # no x100 variants without %
    (r"\boxed{0.05}", "5", "wrong"),
    (r"\boxed{\{2,3\}}", "(2,3)", "type_mismatch"),  # set against interval
    (r"\boxed{(2,3)}", r"\{2,3\}", "type_mismatch"),
    (r"\boxed{9^{9^{9^9}}}", "5", "too_complex"),  # huge exponents refused before sympy
    (r"\boxed{10^{10^{10}}}", "10", "too_complex"),
    (r"\boxed{2^{100000}}", "2", "too_complex"),
    (r"\boxed{\frac{1}{2^{98}}}", r"\frac{1}{2^{99}}", "wrong"),  # math-verify calls these equal
    (r"\boxed{1+\frac{1}{e}}", r"1-\frac{1}{e}", "wrong"),
    ("The final result is 5", "5", "no_answer"),  # no box, no anchor: never "any number in the text"
    ("", "3", "no_answer"),
    (r"\boxed{}", "3", None),
    (r"\boxed{x}", "3", "wrong"),
    (r"\boxed{5", "5", None),  # unbalanced box
    (r"\boxed{0.67}", r"\frac{2}{3}", "wrong"),  # too few digits to stand for 2/3
]


@pytest.fixture(scope="module")
def math_reward():
    return MathReward()


@pytest.mark.parametrize("completion,gold", ACCEPT)
def test_accepts(math_reward, completion, gold):
    r = math_reward.score(traj(completion, gold))
    assert r.score == 1.0, r.info


@pytest.mark.parametrize("completion,gold,reason", REJECT)
def test_rejects_with_reason(math_reward, completion, gold, reason):
    r = math_reward.score(traj(completion, gold))
    assert r.score == 0.0, r.info
    if reason:
        assert r.info["reason"] == reason


@pytest.mark.parametrize("gold", [None, "", r"\frac{", r"\boxed{}"])
def test_unparseable_gold_is_none(math_reward, gold):
    assert math_reward.score(traj(r"\boxed{1}", gold)).score is None


# references as datasets store them: JSON-escaped LaTeX (every backslash doubled), a box its author left open
AS_MEANT = [
    (r"Thus $(p,q) = \boxed{\left( \frac{1}{5}, \frac{1}{6} \right)}.$", r"$\\left(\\frac{1}{5},\\frac{1}{6}\\right)$", 1.0),
    (r"\boxed{\left( \frac{1}{5}, \frac{1}{7} \right)}", r"$\\left(\\frac{1}{5},\\frac{1}{6}\\right)$", 0.0),
    (r"\boxed{\sqrt{2}}", r"\\sqrt{2}", 1.0),
    (r"\boxed{\{1, 2\}}", r"\\{1, 2\\}", 1.0),
    (r"\boxed{\begin{pmatrix} 1 \\ 2 \end{pmatrix}}", r"\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    (r"\boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{3}}", r"\boxed{\frac{1}{2}$.", 0.0),
    (r"\boxed{1, -1}", r"\\boxed{W(n) = 1 \\text{ and } W(n) = -1", 1.0),
    (r"\boxed{7}", r"the answer is \boxed{3} and \boxed{7", 0.0),  # two parts: 3 and 7
    (r"\boxed{3, 7}", r"the answer is \boxed{3} and \boxed{7", 1.0),
]


@pytest.mark.parametrize("completion,gold,want", AS_MEANT)
def test_references_read_as_their_authors_meant(math_reward, completion, gold, want):
    r = math_reward.score(traj(completion, gold))
    assert r.score == want, r.info


@pytest.mark.parametrize("gold", [r"\boxed{\frac{1}{2", r"\boxed{(1, 2", r"1 \\ 2"])
def test_ambiguous_references_stay_unscored(math_reward, gold):
    """A box left open whose own braces do not balance is a guess; a LaTeX line break alone is no doubling."""
    assert math_reward.score(traj(r"\boxed{1}", gold)).score is None


def test_an_open_box_in_a_completion_is_no_answer(math_reward):
    """A completion cut off inside its box is not repaired: only a reference's open box is read to the end."""
    assert math_reward.score(traj(r"so \boxed{\frac{1}{2}", r"\frac{1}{2}")).score == 0.0


def test_no_box_zero_mode():
    assert MathReward(no_box="zero").score(traj("Answer: 3", "3")).info["reason"] == "no_box"
    assert MathReward(no_box="zero").score(traj(r"\boxed{3}", "3")).score == 1.0


def test_verifier_accepts_its_own_gold(math_reward):
    for gold in ["3", r"\frac{1}{2}", r"(-\infty, 2]", r"\sqrt{3}", r"\begin{pmatrix}1\\2\end{pmatrix}", "x^2-1", r"82\%"]:
        assert math_reward.score(traj(rf"\boxed{{{gold}}}", gold)).score == 1.0, gold


def test_gold_parsed_once(math_reward, monkeypatch):
    calls = []
    orig = MathReward._parse_gold
    monkeypatch.setattr(MathReward, "_parse_gold", lambda self, t: calls.append(t) or orig(self, t))
    m = MathReward()
    for c in [r"\boxed{\sqrt{2}}", r"\boxed{1}", r"\boxed{2}"]:
        m.score(traj(c, r"\sqrt{2}"))
    assert calls == [r"\sqrt{2}"]


def test_find_boxes_balances_braces():
    assert [b[2] for b in find_boxes(r"\boxed{\frac{1}{2}} then \boxed{\{1\}}")] == [r"\frac{1}{2}", r"\{1\}"]
    assert [b[2] for b in find_boxes(r"\boxed 5 and \fbox{6}")] == ["5", "6"]


def test_extract_after_think():
    assert extract_answer(r"<think>\boxed{1}</think>no box here").reason == "no_answer"


def test_numbers_match_policy():
    assert numbers_match("0.5", r"\frac{1}{2}") is True
    assert numbers_match("0.333333", "1/3") is True
    assert numbers_match("0.33", "1/3") is False
    assert numbers_match("3.14", "3.1416") is False
    assert numbers_match("x", "1") is None


def test_bytes_and_invalid_text(math_reward):
    assert math_reward.score(traj(b"\\boxed{4}\xff", "4")).score == 1.0
    assert math_reward.score(traj("\udcff\udcfe", "4")).score == 0.0


def test_large_completion_fast(math_reward):
    import time

    t = time.perf_counter()
    assert math_reward.score(traj("x" * 1_000_000 + r" \boxed{5}", "5")).score == 1.0
    assert time.perf_counter() - t < 5.0  # linear work; anything quadratic in 1e6 characters takes hours


def test_labelled_set_agreement(math_reward):
    """The committed labelled set (benchmarks/data/math_pairs.jsonl) stays at ≥ 98 % agreement."""
    import json
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "data" / "math_pairs.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["verdict"] != "ambiguous"]
    assert len(rows) >= 500
    wrong = [r for r in rows if (math_reward.score(traj(r["completion"], r["answer"])).score == 1.0) != (r["verdict"] == "accept")]
    assert len(wrong) / len(rows) <= 0.02, wrong[:5]
