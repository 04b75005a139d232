"""The math verifier on whole classes of input (issue 15): thinking sections, references with
several parts, digit-group separators, the bare-answer rule, and the strictness that stays.

Every expected value is written by hand from the rules in docs/rewards.md.
"""

import pytest

from _reward_helpers import traj
from assay.rewards.math import MathReward, extract_answer, group_digits, response_span, split_answer
from assay.rewards.math.parts import interval_pieces, match_parts


@pytest.fixture(scope="module")
def math_reward():
    return MathReward()


def _score(reward, completion, gold):
    r = reward.score(traj(completion, gold))
    return r.score, r.info.get("reason")


# ------------------------------------------------------------------ the issue's reproductions

ISSUE = [
    ("<think>Let me compute. 2+3 = 6? Wait, no, it is 5.</think>\nThe sum is \\boxed{6}.", "5", 0.0),
    ("<think>Hmm. Wait, it is 6.</think>\n\\boxed{5}", "5", 1.0),
    ("\\boxed{-2}", "\\(\\boxed{1}\\) and \\(\\boxed{-2}\\).", 0.0),
    ("The answer is $12, 345$.", "12345", 0.0),
    ("\\boxed{6,8}", "6 \\text{ and } 8", 1.0),
]


@pytest.mark.parametrize("completion,gold,want", ISSUE)
def test_issue_reproductions(math_reward, completion, gold, want):
    assert math_reward.score(traj(completion, gold)).score == want


# ---------------------------------------------------------------------------------- thinking

THINKING = [
    # (completion, gold, score): nothing inside a thinking section counts, corrections included
    (r"<think>Wait, no: \boxed{6}.</think> \boxed{5}", "5", 1.0),
    (r"<think>It is \boxed{5}.</think> So \boxed{6}.", "5", 0.0),
    (r"<think>The answer is \boxed{5}</think>", "5", 0.0),  # all thinking: no answer
    (r"<think>I think it is \boxed{5}", "5", 0.0),  # unclosed: all thinking
    (r"\boxed{5} <think>wait, it is \boxed{6}", "5", 1.0),  # an unclosed tag ends the response
    (r"\boxed{5} <think>wait, it is \boxed{6}", "6", 0.0),
    (r"Thinking in the prompt's open tag. Actually 7.</think> \boxed{5}", "5", 1.0),
    (r"<think>a</think> first \boxed{3} <think>no, 4</think> final \boxed{4}", "4", 1.0),  # after the last block
    (r"<think>a</think> first \boxed{3} <think>no, 4</think> final \boxed{4}", "3", 0.0),
    (r"<think>x</think> The answer is $5$. Wait, no, it is 6.", "6", 1.0),  # a correction after thinking counts
    (r"<think>Wait, no, 6.</think> The answer is $5$.", "5", 1.0),
    (r"<think>x</think> \boxed{5} or \boxed{6}", "5", 0.0),
    (r"<|begin_of_thought|>Wait, it is 6.<|end_of_thought|><|begin_of_solution|>\boxed{5}<|end_of_solution|>", "5", 1.0),
    (r"[THINK]Wait, it is 6.[/THINK]\boxed{5}", "5", 1.0),
    (r"<thinking>no, 6</thinking>The answer is 5.", "5", 1.0),
    (r"◁think▷no, 6◁/think▷\boxed{5}", "5", 1.0),
    (r"<seed:think>no, 6</seed:think>\boxed{5}", "5", 1.0),
    ("<think>x</think>\n42", "42", 1.0),
]


@pytest.mark.parametrize("completion,gold,want", THINKING)
def test_thinking_never_counts(math_reward, completion, gold, want):
    assert math_reward.score(traj(completion, gold)).score == want


def test_response_span_and_offsets():
    text = "<think>a</think>xy<think>b"
    assert response_span(text) == (16, 18)
    ex = extract_answer(r"<think>Wait, it is 6.</think> \boxed{5}. Done.")
    assert (ex.answer, ex.response[ex.end :], ex.offset) == ("5", ". Done.", 29)


def test_thinking_setting():
    assert MathReward(thinking="none").score(traj(r"<think>\boxed{5}</think>", "5")).score == 1.0
    custom = MathReward(thinking=[["<scratch>", "</scratch>"]])
    assert custom.score(traj(r"<scratch>\boxed{6}</scratch> \boxed{5}", "5")).score == 1.0
    assert custom.score(traj(r"<think>\boxed{6}</think> \boxed{5}", "6")).score == 0.0  # <think> is not a tag here
    with pytest.raises(ValueError, match="thinking"):
        MathReward(thinking="sometimes")


# ---------------------------------------------------------------- references with several parts

PARTS = [
    # several boxes in the reference: one answer, any order
    (r"\boxed{1, -2}", r"\(\boxed{1}\) and \(\boxed{-2}\).", 1.0, "correct"),
    (r"\boxed{-2, 1}", r"\(\boxed{1}\) and \(\boxed{-2}\).", 1.0, "correct"),
    (r"\boxed{1} and \boxed{-2}", r"\(\boxed{1}\) and \(\boxed{-2}\).", 1.0, "correct"),
    (r"The roots are $x = \boxed{1}$ and $x = \boxed{-2}$.", r"\boxed{1} and \boxed{-2}", 1.0, "correct"),
    (r"\boxed{1}", r"\(\boxed{1}\) and \(\boxed{-2}\).", 0.0, "wrong"),  # one part of two
    (r"\boxed{1, -2, 3}", r"\(\boxed{1}\) and \(\boxed{-2}\).", 0.0, "wrong"),  # a part too many
    (r"\boxed{5}", r"The answer is $\boxed{5}$. Check: $\boxed{5}$.", 1.0, "correct"),  # repeated box: one part
    # "and" / "or" lists
    (r"\boxed{8, 6}", r"6 \text{ and } 8", 1.0, "correct"),
    (r"\boxed{6 \text{ and } 8}", "6, 8", 1.0, "correct"),
    (r"\boxed{6}", r"6 \text{ and } 8", 0.0, "wrong"),
    (r"\boxed{x = 1 \text{ or } x = -2}", "1, -2", 1.0, "correct"),
    (r"\boxed{-2}", r"1 \text{ or } -2", 0.0, "wrong"),
    ("The answer is $5$ and $6$.", "5, 6", 1.0, "correct"),
    (r"\boxed{5} or \boxed{6}", "5, 6", 1.0, "correct"),
    (r"\boxed{\text{Carla and Evelyn}}", r"\text{Evelyn and Carla}", 1.0, "correct"),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn and Carla}", 0.0, "wrong"),
    # sets
    (r"\boxed{1,2,3}", r"\{1,2,3\}", 1.0, "correct"),
    (r"\boxed{\{3,2,1\}}", r"\{1,2,3\}", 1.0, "correct"),
    (r"\boxed{x \in \{3, 2, 1\}}", "1, 2, 3", 1.0, "correct"),
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}", 0.0, "wrong"),
    (r"\boxed{1, 1, 2}", "1, 2", 1.0, "correct"),  # repeats mean nothing in a set
    (r"\boxed{(1, -2)}", "1, -2", 0.0, "type_mismatch"),  # a pair is not the set of solutions
    # tuples: in order
    (r"\boxed{(3,-1)}", "(3, -1)", 1.0, "correct"),
    (r"\boxed{3, -1}", "(3, -1)", 1.0, "correct"),
    (r"\boxed{(-1, 3)}", "(3, -1)", 0.0, "wrong"),
    (r"\boxed{(1,4.5)}", r"(1,\frac{9}{2})", 1.0, "correct"),
    (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"(3, \frac{\pi}{2})", 1.0, "correct"),
    (r"\boxed{(\frac{\pi}{2}, 3)}", r"\left( 3, \frac{\pi}{2} \right)", 0.0, "wrong"),
    (r"(p,q,r) = \boxed{(6,31,-1)}", "(6,31,-1)", 1.0, "correct"),
    (r"\boxed{(p, q) = (3,2)}", "(p,q)=(3,2)", 1.0, "correct"),
    (r"\boxed{(2,3)}", "(p,q)=(3,2)", 0.0, "wrong"),
    (r"\boxed{\langle 2, 1 \rangle}", r"\langle 1,2\rangle", 0.0, "wrong"),
    (r"\boxed{(4, 0, 6), (0, 0, 0)}", "(0;0;0),(4;0;6)", 1.0, "correct"),  # a set of points
    (r"\boxed{(4, 0, 6), (0, 0, 1)}", "(0;0;0),(4;0;6)", 0.0, "wrong"),
    # labelled parts: by name, or in the reference's order
    (r"\boxed{b = 3, a = 2}", "a = 2, b = 3", 1.0, "correct"),
    (r"\boxed{2, 3}", "a = 2, b = 3", 1.0, "correct"),
    (r"\boxed{3, 2}", "a = 2, b = 3", 0.0, "wrong"),
    (r"\boxed{a = 3, b = 2}", "a = 2, b = 3", 0.0, "wrong"),
    # \pm: two parts
    (r"\boxed{1 + \sqrt{19}, 1 - \sqrt{19}}", r"1 \pm \sqrt{19}", 1.0, "correct"),
    (r"\boxed{1 \pm \sqrt{19}}", r"1 - \sqrt{19}, 1 + \sqrt{19}", 1.0, "correct"),
    (r"\boxed{1 + \sqrt{19}}", r"1 \pm \sqrt{19}", 0.0, "wrong"),
    (r"\boxed{-2, 1+\sqrt5, 1-\sqrt5}", r"\{1\pm\sqrt{5},-2\}", 1.0, "correct"),
    # intervals: whole, brackets and endpoints
    (r"\boxed{(1, 3)}", "[1, 3)", 0.0, "wrong"),
    (r"\boxed{1, 3}", "[1, 3)", 0.0, "type_mismatch"),
    (r"\boxed{\{1, 3\}}", "[1, 3)", 0.0, "type_mismatch"),
    (r"\boxed{1}", "[1, 3)", 0.0, "wrong"),
    (r"\boxed{[3, \infty) \cup (-\infty, 2]}", r"(-\infty, 2] \cup [3, \infty)", 1.0, "correct"),
    (r"\boxed{(-\infty, 2) \cup [3, \infty)}", r"(-\infty, 2] \cup [3, \infty)", 0.0, "wrong"),
    (r"\boxed{(0.6,2.6667]}", r"(\frac{3}{5},\frac{8}{3}]", 1.0, "correct"),  # endpoints by the number rules
    (r"\boxed{(0.6,2.7]}", r"(\frac{3}{5},\frac{8}{3}]", 0.0, "wrong"),
    (r"\boxed{(2,12) \cup (12,102)}", r"(2, 12) \cup (12, 102)", 1.0, "correct"),
    (r"\boxed{2 < x < 3}", "(2,3)", 1.0, "correct"),  # (2, 3) also reads as an open interval
    (r"\boxed{(0,1)}", "0<f(x)<1", 1.0, "correct"),
]


@pytest.mark.parametrize("completion,gold,want,reason", PARTS)
def test_references_with_several_parts(math_reward, completion, gold, want, reason):
    assert _score(math_reward, completion, gold) == (want, reason)


def test_split_answer_kinds():
    assert split_answer(r"6 \text{ and } 8") == ("list", ["6", "8"])
    assert split_answer(r"\{1, 2\}") == ("set", ["1", "2"])
    assert split_answer(r"\left( 3, -1 \right)") == ("tuple", ["3", "-1"])
    assert split_answer("(0;-2;6)") == ("tuple", ["0", "-2", "6"])
    assert split_answer("[1, 3)") == ("interval", ["[1, 3)"])
    assert split_answer(r"x \le 2") == ("relation", [r"x \le 2"])
    assert split_answer(r"\gcd(12, 18)") == ("scalar", [r"\gcd(12, 18)"])  # commas inside brackets stay
    assert split_answer(r"a=4,\,-8,\,-10") == ("list", ["a=4", "-8", "-10"])  # `\,` is a space, not a comma
    assert interval_pieces(r"(-\infty, 2] \cup [3, \infty)") == [("(", r"-\infty", "2", "]"), ("[", "3", r"\infty", ")")]


def test_match_parts_is_a_matching():
    same = lambda p, g: p == g  # noqa: E731
    assert match_parts(["b", "a"], ["a", "b"], same, ordered=False) is True
    assert match_parts(["b", "a"], ["a", "b"], same, ordered=True) is False
    assert match_parts(["a"], ["a", "b"], same, ordered=False) is False
    # a greedy pairing would give pred "x" the gold "1" and fail; the matching reassigns it
    loose = lambda p, g: p == "x" or p == g  # noqa: E731
    assert match_parts(["x", "1"], ["1", "2"], loose, ordered=False) is True


# -------------------------------------------------------------------------------- separators

SEPARATORS = [
    (r"\boxed{12,345}", "12345", 1.0, "correct"),
    (r"\boxed{12, 345}", "12345", 0.0, "multi_answer"),  # comma-space: two numbers
    ("The answer is 12, 345.", "12345", 0.0, "multi_answer"),
    (r"\boxed{12 345}", "12345", 1.0, "correct"),  # SI space
    (r"\boxed{12\,345}", "12345", 1.0, "correct"),  # LaTeX thin space
    (r"\boxed{12345}", r"12\,345", 1.0, "correct"),
    (r"\boxed{10000}", r"10,\!000", 1.0, "correct"),  # MATH's `,\!`
    (r"\boxed{11,\! 111,\! 111,\! 100}", "11111111100", 1.0, "correct"),
    (r"\boxed{14{,}916}", "14916", 1.0, "correct"),
    (r"\boxed{1,234,567}", "1234567", 1.0, "correct"),
    (r"\boxed{1,234,56}", "123456", 0.0, "multi_answer"),  # not three-digit groups
    (r"\boxed{1,000.5}", "1000.5", 1.0, "correct"),
    (r"\boxed{\$1,000}", "1000", 1.0, "correct"),
    (r"\boxed{1.234.567,89}", "1234567.89", 1.0, "correct"),  # German, two dot groups
    (r"\boxed{1.234,5}", "1234.5", 0.0, "multi_answer"),  # one dot group: ambiguous, not read as German
    (r"\boxed{3{,}14}", "3.14", 1.0, "correct"),  # braced comma before non-groups: decimal
    (r"\boxed{1,22}", "1.22", 0.0, "multi_answer"),  # a bare decimal comma is a list comma here
    (r"\boxed{0,5}", "0, 5", 1.0, "correct"),
    (r"\boxed{1 2}", "12", 0.0, "multi_answer"),  # spaces in no grouping pattern: two numbers
    (r"\boxed{(12,102)}", "(12, 102)", 1.0, "correct"),  # inside brackets a comma separates elements
    (r"\boxed{12,102}", "12102", 1.0, "correct"),
    (r"\boxed{1,000}", "1", 0.0, "wrong"),
    (r"\boxed{10 \text{ ways}}", "10", 1.0, "correct"),  # Minerva's unit words are dropped
]


@pytest.mark.parametrize("completion,gold,want,reason", SEPARATORS)
def test_separators(math_reward, completion, gold, want, reason):
    assert _score(math_reward, completion, gold) == (want, reason)


def test_group_digits():
    assert group_digits("12,345") == "12345"
    assert group_digits("12, 345") == "12, 345"
    assert group_digits(r"10\,000 and 1 000 000") == "10000 and 1000000"
    assert group_digits(r"10,\!000") == "10000"
    assert group_digits("14{,}916 and 3{,}14 and 0{,}500") == "14916 and 3.14 and 0.500"
    assert group_digits("1.234.567,89 and 1.234,5") == "1234567.89 and 1.234,5"
    assert group_digits("(12,102) and 12,102") == "(12,102) and 12102"
    assert group_digits("12 34") == "12, 34"
    assert group_digits("x^2 345") == "x^2 345"  # an exponent starts no run


# ------------------------------------------------------------------------------ bare answers

BARE = [
    ("42", "42", 1.0),
    ("x = 5", "5", 1.0),
    (r"$\frac{1}{2}$.", "0.5", 1.0),
    (r"\[ \frac{1}{2} \]", "0.5", 1.0),
    (r"$\text{odd}$", r"\text{odd}", 1.0),  # a single math span may hold words
    (r"$19, 46, \text{ and } 82$", "19, 46, and 82", 1.0),
    ("5 apples", "5", 0.0),  # a word of three letters: prose, not a bare answer
    ("The final result is 5", "5", 0.0),
    ("$1$ and $2$", "1", 0.0),  # two spans: no bare answer
    ("$45$ %", r"45\%", 1.0),  # one wordless line across math spans
    ("$y$ = $-3$", "-3", 1.0),
    ("$45$ %", "46", 0.0),
    (r"$3$, $4$", "3", 0.0),  # a list for a one-value reference
    ("$45$ percent of it", r"45\%", 0.0),  # prose
    ("#### 1,234", "1234", 1.0),  # GSM8K's marker is an answer statement
]


@pytest.mark.parametrize("completion,gold,want", BARE)
def test_bare_answer_rule(math_reward, completion, gold, want):
    assert math_reward.score(traj(completion, gold)).score == want


# ------------------------------------------------------------- answers stated around the anchor

STATED = [
    # (completion, gold, score, reason): "X is the answer" states X; a firm statement after a box restates it
    ("Adding them, $7$ is the answer.", "7", 1.0, "correct"),
    ("So 42 is our final answer.", "42", 1.0, "correct"),
    (r"Hence \(y \ge 3\) was the answer.", r"y \geq 3", 1.0, "correct"),
    ("Adding them, $7$ is the answer.", "8", 0.0, "wrong"),
    ("Adding them, $7$ or $8$ is the answer.", "7", 0.0, "hedged"),  # a list before it: a hedge
    ("The answer is.", "7", 0.0, "no_answer"),  # an empty claim is no answer
    (r"The tax is \boxed{40}, so the total is $440$.\nFinal Answer: The final answer is $440$.", "440", 1.0, "correct"),
    (r"The tax is \boxed{40}. The final answer is $440$.", "40", 0.0, "wrong"),  # the box was a step
    (r"The tax is \boxed{40}, and $440$ is the answer.", "440", 1.0, "correct"),
    (r"The tax is \boxed{40}. Or maybe the answer is $440$.", "440", 0.0, "hedged"),  # hedging prose before it
    (r"\boxed{12}. To check the answer: $3 \cdot 4 = 12$.", "12", 1.0, "correct"),  # a loose anchor restates nothing
    (r"\boxed{12}. I am sure the answer is right.", "12", 1.0, "correct"),  # prose restates nothing
    (r"\boxed{0.5}. The final answer is $\frac{1}{2}$.", "1/2", 1.0, "correct"),
    (r"\boxed{6}. A common mistake is to think $5$ is the answer.", "5", 0.0, "wrong"),  # prose about an answer restates nothing
    (r"\boxed{6}. Earlier I thought $5$ was the answer.", "6", 1.0, "correct"),
    (r"\boxed{6}. So $7$ is the answer.", "7", 1.0, "correct"),  # a clause of its own restates
    (r"Checking each case, the solution is $x \neq 4$.", r"x \ne 4", 1.0, "correct"),  # "the solution(s) is/are" anchors
    ("The solutions are $x = 1$ and $x = 6$.", "1, 6", 1.0, "correct"),
    ("The solution is either $3$ or $4$.", "3", 0.0, "hedged"),
    # prose after "the solution is" is about the solution: the answer stated before it stands
    ("So the answer is 12. The solution is complete.", "12", 1.0, "correct"),
    ("Final answer: 12\nThe solution is valid since 12 > 0.", "12", 1.0, "correct"),
    ("#### 12\nThe solution is verified.", "12", 1.0, "correct"),
    ("The answer is 12. The solution is not unique.", "12", 1.0, "correct"),
]


@pytest.mark.parametrize("completion,gold,want,reason", STATED)
def test_answers_stated_around_the_anchor(math_reward, completion, gold, want, reason):
    assert _score(math_reward, completion, gold) == (want, reason)


def test_restatement_scan_stays_cheap(math_reward):
    import time

    t = time.perf_counter()
    assert math_reward.score(traj(r"\boxed{7}" + " answer" * 100_000, "7")).score == 1.0
    assert math_reward.score(traj(r"\boxed{7}" + " $7$ is the answer" * 50_000, "7")).score == 1.0
    assert time.perf_counter() - t < 5.0


def test_claim_before_an_anchor_stays_cheap_on_runs_of_spaces():
    # every anchor with no claim after it reads back up to 2,000 characters for "… is the answer":
    # a leading \s* in that search made each read quadratic in a run of spaces (2.4 s for 100k characters)
    import time

    from assay.rewards.math.extract import _IS_BEFORE

    t = time.perf_counter()
    assert extract_answer(("answer$$" + " " * 2000) * 50).reason == "no_answer"
    assert extract_answer(("the solution is$$" + " " * 2000) * 50).reason == "no_answer"
    assert time.perf_counter() - t < 0.5
    assert _IS_BEFORE.search("$7$   is   the ").start() == 6  # what is before it is unchanged: `$7$` after rstrip


# --------------------------------------------------------------------- "not equal", any spelling

NOT_EQUAL = [
    # a reference saying "not equal" in one spelling accepts the others; a value reference still refuses it
    (r"\boxed{y \neq -1}", "y != -1", 1.0, "correct"),
    (r"\boxed{y \ne -1}", r"y \neq -1", 1.0, "correct"),
    (r"\boxed{y \neq -1}", "y ≠ -1", 1.0, "correct"),
    (r"\boxed{y \neq 2}", "y != -1", 0.0, "wrong"),
    (r"\boxed{y \ne -1}", "4", 0.0, "hedged"),  # `\ne` is a qualifier like `\neq`
    ("The answer is $y ≠ -1$.", "4", 0.0, "hedged"),
]


@pytest.mark.parametrize("completion,gold,want,reason", NOT_EQUAL)
def test_not_equal_spellings(math_reward, completion, gold, want, reason):
    assert _score(math_reward, completion, gold) == (want, reason)


# -------------------------------------------------------------------------- solution groups

GROUPS = [
    # several solutions, each naming the same unknowns: a set of labelled tuples
    (r"\boxed{(1, 4), (3, 0)}", "a=1, b=4; a=3, b=0", 1.0, "correct"),
    (r"\boxed{(3, 0), (1, 4)}", "a=1, b=4; a=3, b=0", 1.0, "correct"),  # solutions in any order
    (r"\boxed{b=0, a=3; b=4, a=1}", "a=1, b=4; a=3, b=0", 1.0, "correct"),  # read by name
    (r"\boxed{a=1, b=4 \text{ or } a=3, b=0}", "(1, 4), (3, 0)", 1.0, "correct"),
    (r"\boxed{(4, 1), (0, 3)}", "a=1, b=4; a=3, b=0", 0.0, "wrong"),  # coordinates in order
    (r"\boxed{(1, 4)}", "a=1, b=4; a=3, b=0", 0.0, "type_mismatch"),  # one solution of two
    (r"\boxed{a=1, b=4 \text{ or } a=3, b=0}", "a=1, b=4", 0.0, "wrong"),
]


@pytest.mark.parametrize("completion,gold,want,reason", GROUPS)
def test_solution_groups(math_reward, completion, gold, want, reason):
    assert _score(math_reward, completion, gold) == (want, reason)


def test_solution_groups_split():
    assert split_answer("a=1, b=4; a=3, b=0") == ("list", ["(a=1, b=4)", "(a=3, b=0)"])
    assert split_answer("a=1, b=4; c=3, b=0") == ("list", ["a=1", "b=4", "c=3", "b=0"])  # different names: a flat list
    assert split_answer("a=1; b=4") == ("list", ["a=1", "b=4"])


# ----------------------------------------------------------------------- strictness that stays

STRICT = [
    (r"\boxed{either 5 or 6}", "5", "hedged"),
    ("The answer is either 5 or 6.", "5", "hedged"),
    ("The answer is probably 5.", "5", "hedged"),
    (r"It is either \boxed{5} or maybe \boxed{6}.", "5, 6", "hedged"),  # hedges stay hedges for lists
    ("The answer is $5$, or possibly $6$.", "5, 6", "hedged"),
    (r"\boxed{either 1 or -2}", "1, -2", "hedged"),
    (r"\boxed{5} and \boxed{6}", "5", "multi_answer"),
    ("The answer is $5$ and $6$.", "5", "hedged"),
    (r"\boxed{1, -2}. Actually no, it is 3.", "1, -2", "wrong"),  # corrected to 3
    (r"\boxed{1 + \frac{1}{\mathrm{e}}}", "1", "wrong"),  # math-verify's expression parser read this as 1
    (r"\boxed{1 + \frac{1}{\mathrm{e}}}", r"1 - \frac{1}{\mathrm{e}}", "wrong"),
    (r"\boxed{2x + 1}", "1", "wrong"),
    (r"\boxed{2021}", r"\pm 2021", "wrong"),
    ("So we have 10 ways, which is the answer", "10", "no_answer"),
]


@pytest.mark.parametrize("completion,gold,reason", STRICT)
def test_strictness_stays(math_reward, completion, gold, reason):
    assert _score(math_reward, completion, gold) == (0.0, reason)


def test_references_accept_themselves(math_reward):
    golds = [r"3 \pmod{5}", r"\(\boxed{1}\) and \(\boxed{-2}\).", r"6 \text{ and } 8", r"\{1\pm\sqrt{5},-2\}", "(6,31,-1)", "a = 2, b = 3",
             r"(-\infty, 2] \cup [3, \infty)", r"10,\!000", r"\text{Evelyn and Carla}", "(0;0;0),(4;0;6)"]
    for gold in golds:
        boxed = gold if r"\boxed" in gold else rf"\boxed{{{gold}}}"
        assert math_reward.score(traj(boxed, gold)).score == 1.0, gold


def test_large_inputs_stay_cheap(math_reward):
    import time

    t = time.perf_counter()
    assert _score(math_reward, r"\boxed{" + "1, " * 300_000 + "1}", "1") == (0.0, "too_long")
    assert _score(math_reward, r"\boxed{" + ", ".join(map(str, range(100))) + "}", "1, 2") == (0.0, "too_complex")
    assert math_reward.score(traj("<think>" + "Wait, it is 6. " * 100_000 + r"</think>\boxed{5}", "5")).score == 1.0
    rev = r"\boxed{" + ", ".join(rf"\sqrt{{{i}}}" for i in range(60)) + "}"
    assert math_reward.score(traj(rev, ", ".join(rf"\sqrt{{{i}}}" for i in range(59, -1, -1)))).score == 1.0
    assert time.perf_counter() - t < 10.0  # linear work; anything quadratic in these sizes takes hours


@pytest.mark.parametrize("name", ["assay.rewards.math", "assay.rewards.math.extract", "assay.rewards.math.numbers",
                                  "assay.rewards.math.parts", "assay.rewards.math.policy"])
def test_docstring_examples(name):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
