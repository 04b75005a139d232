"""Text verifiers on hand-written cases, adversarial ones included."""

import pytest

from _reward_helpers import traj
from assay.rewards.text import (ChoiceMatch, ExactMatch, FormatReward, JsonSchemaReward, LengthBounds, NormalizedMatch,
                                NumericMatch, RegexMatch, validate)


def s(reward, completion, answer=None, **fields):
    return reward.score(traj(completion, answer, **fields)).score


def test_exact():
    assert s(ExactMatch(), " Paris\n", "Paris") == 1.0
    assert s(ExactMatch(), "paris", "Paris") == 0.0
    assert s(ExactMatch(strip=False), " Paris", "Paris") == 0.0
    assert s(ExactMatch(field="city"), "Rome", None, city="Rome") == 1.0
    assert s(ExactMatch(), "x", None) is None


def test_normalized():
    assert s(NormalizedMatch(), "The  Eiffel tower!", "eiffel Tower") == 1.0
    assert s(NormalizedMatch(), "tower", ["Eiffel Tower", "the tower"]) == 1.0
    assert s(NormalizedMatch(), "", "a") == 0.0  # the empty answer never matches (Visual-RFT#176)
    assert s(NormalizedMatch(), "Eiffel", "Eiffel Tower") == 0.0  # no substring match


def test_numeric():
    n = NumericMatch(rel_tol=1e-3)
    assert s(n, r"\boxed{3.1416}", "3.14159") == 1.0
    assert s(n, r"\boxed{3.2}", "3.14159") == 0.0
    assert s(n, r"\boxed{3} or \boxed{4}", "3") == 0.0
    assert s(NumericMatch(extract="whole"), "1,000", "1000") == 1.0
    assert s(NumericMatch(extract="whole"), "about 1000", "1000") == 0.0
    assert s(NumericMatch(abs_tol=0.5), r"\boxed{10.4}", "10") == 1.0
    assert s(n, r"\boxed{1e999}", "1") == 0.0
    assert s(n, r"\boxed{1}", "one") is None


def test_choice():
    c = ChoiceMatch(letters="ABCD")
    assert s(c, r"\boxed{C}", "C") == 1.0
    assert s(c, "The answer is (C).", "c") == 1.0
    assert s(c, "B", 1) == 1.0
    assert s(c, r"\boxed{A or C}", "C") == 0.0
    assert s(c, r"\boxed{A, C}", "C") == 0.0
    assert s(c, "Answer: E", "C") == 0.0
    assert s(c, "C", "Z") is None


def test_regex():
    assert s(RegexMatch(r"\d+"), "abc 12") == 1.0
    assert s(RegexMatch(r"\d+", mode="fullmatch"), "abc 12") == 0.0
    assert s(RegexMatch("ABC", flags="i"), "abc") == 1.0
    with pytest.raises(ValueError):
        RegexMatch("x", mode="bogus")


def test_format():
    f = FormatReward()
    assert s(f, "<think>reason</think>\n<answer>4</answer>") == 1.0
    assert s(f, "<think>reason</think><answer>4</answer> trailing") == 0.0
    assert s(f, "<answer>4</answer><think>r</think>") == 0.0
    assert s(f, "<think></think><answer>4</answer>") == 0.0
    assert s(f, "<think>a</think><think>b</think><answer>4</answer>") == 0.0
    assert f.score(traj("<think>x</think>")).components == {"has_think": 1.0, "has_answer": 0.0}


SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "minLength": 1}, "age": {"type": "integer", "minimum": 0}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}


def test_json_schema():
    j = JsonSchemaReward(SCHEMA)
    assert s(j, '{"name": "x", "age": 3}') == 1.0
    assert s(j, 'Here: ```json\n{"name": "x", "age": 3, "tags": ["a"]}\n```') == 1.0
    assert s(j, '{"name": "x", "age": -1}') == 0.0
    assert s(j, '{"name": "x", "age": true}') == 0.0  # a bool is not an integer
    assert s(j, '{"name": "x", "age": 3, "extra": 1}') == 0.0
    assert s(j, '{"name": "x", "age": 3, "tags": ["c"]}') == 0.0
    assert s(j, "{not json") == 0.0
    assert s(JsonSchemaReward(schema_field="schema"), '{"a": 1}', schema='{"type": "object", "required": ["a"]}') == 1.0
    assert s(JsonSchemaReward(schema_field="schema"), '{"a": 1}') is None
    assert validate([1, "x"], {"type": "array", "items": {"type": "number"}}) == "$[1]: expected number"


def test_length():
    assert s(LengthBounds(2, 4), "abc") == 1.0
    assert s(LengthBounds(2, 4), "abcde") == 0.0
    assert s(LengthBounds(max_len=2, unit="words"), "a b c") == 0.0
    t = traj("a")
    t.completion_ids = [1, 2, 3]
    assert LengthBounds(3, 3, unit="tokens").score(t).score == 1.0
