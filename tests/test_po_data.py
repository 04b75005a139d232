"""Preference files: every layout of docs/preference.md read the same, tokenised as generation sees them, bad rows in one line."""

import doctest
import importlib
import json

import pytest

from assay.errors import AssayError
from assay.po.data import PairRow, PairText, SingleRow, SingleText, encode, extract_prompt, read_preferences

USER = [{"role": "user", "content": "1+2="}]
GOOD, BAD = [{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]
TEMPLATE = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


def write(tmp_path, rows, name="p.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def tok():
    from assay.models import build_char_tokenizer

    t = build_char_tokenizer()
    t.chat_template = TEMPLATE
    return t


@pytest.mark.parametrize("row, prompt, chosen, rejected", [
    # explicit prompt, text (assay rm pairs, RewardBench)
    ({"prompt": "1+2=", "chosen": "3", "rejected": "4", "subset": "near_miss", "answer": "3"}, "1+2=", "3", "4"),
    # conversational explicit (TRL's conversational preference)
    ({"prompt": USER, "chosen": GOOD, "rejected": BAD}, USER, GOOD, BAD),
    # whole conversations with a text prompt column (HuggingFaceH4/ultrafeedback_binarized)
    ({"prompt": "1+2=", "chosen": USER + GOOD, "rejected": USER + BAD, "score_chosen": 9.0}, USER, GOOD, BAD),
    # whole conversations, no prompt column (trl-lib/ultrafeedback_binarized)
    ({"chosen": USER + GOOD, "rejected": USER + BAD}, USER, GOOD, BAD),
    # implicit text prompt (Anthropic/hh-rlhf): the space before the split stays with the responses
    ({"chosen": "Human: 1+2? Assistant: 3", "rejected": "Human: 1+2? Assistant: 4"}, "Human: 1+2? Assistant:", " 3", " 4"),
    # a text prompt with assistant-message responses becomes one user message
    ({"prompt": "1+2=", "chosen": GOOD, "rejected": BAD}, USER, GOOD, BAD),
])
def test_layouts_read_to_the_same_pair(tmp_path, row, prompt, chosen, rejected):
    (p,) = read_preferences(write(tmp_path, [row]))
    assert isinstance(p, PairText) and (p.prompt, p.chosen, p.rejected) == (prompt, chosen, rejected)


def test_several_responses_field_mapping_and_unpaired_rows(tmp_path):
    rb2 = read_preferences(write(tmp_path, [{"prompt": "q", "chosen": ["a"], "rejected": ["b", "c"], "subset": "math"}]))
    assert [(p.chosen, p.rejected, p.subset) for p in rb2] == [("a", "b", "math"), ("a", "c", "math")]
    mapped = read_preferences(write(tmp_path, [{"q": {"text": "x="}, "good": "1", "bad": "2", "uid": 7}]),
                              {"prompt": "q.text", "chosen": "good", "rejected": "bad", "id": "uid"})
    assert (mapped[0].id, mapped[0].prompt, mapped[0].chosen) == ("7", "x=", "1")
    singles = read_preferences(write(tmp_path, [{"prompt": "1+1=", "completion": "2", "label": True},
                                                {"prompt": "1+1=", "completion": "3", "label": 0}]))
    assert [(type(s), s.desirable) for s in singles] == [(SingleText, True), (SingleText, False)]


@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "x", "good": "1"}], "row 1 has neither chosen and rejected columns nor completion and label"),
    ([{"prompt": "x", "chosen": "1", "rejected": "2"}, {"prompt": "y", "chosen": "1"}], "row 2 has no rejected column 'rejected'"),
    ([{"prompt": "x", "completion": "1", "label": "yes"}], "label must be true/false"),
    ([{"prompt": "x", "chosen": 3, "rejected": "2"}], "column 'chosen' must be text"),
    ([{"chosen": "abc", "rejected": "xyz"}], "share no prefix"),
    ([{"chosen": USER + GOOD, "rejected": USER + GOOD}], "the same conversation"),
    ([], "no rows"),
])
def test_bad_files_are_one_line(tmp_path, rows, needle):
    with pytest.raises(AssayError) as e:
        read_preferences(write(tmp_path, rows))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_tokens_are_what_generation_sees(tmp_path, tok):
    from assay.rollout.base import encode_prompt
    from assay.types import Sample

    items = read_preferences(write(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "45"},
                                              {"prompt": USER, "chosen": GOOD, "rejected": BAD}]))
    text, chat = encode(items, tok, 64, "p")
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    # text: the prompt as every sampler encodes it, each response with EOS, each a trajectory whose every token is the model's
    assert text.chosen.prompt_ids == encode_prompt(tok, Sample("0", "1+2=")) == ids("1+2=")
    assert text.chosen.completion_ids == ids("3") + [tok.eos_token_id] and text.rejected.completion_ids == ids("45") + [tok.eos_token_id]
    assert text.chosen.loss_mask is None and text.chosen.completion == "3"
    # a conversation: the prompt rendered with the generation prompt, the response what the template adds after it
    assert chat.chosen.prompt_ids == ids("u:1+2=;a:") and chat.chosen.completion_ids == ids("3;")
    # too long for max_length: left out with a count
    assert len(encode(items, tok, 7, "p")) == 1  # the text pair is 4 + 3 tokens, the conversation 9 + 2


def test_unpaired_rows_encode_and_extract_prompt_keeps_trl_semantics(tmp_path, tok):
    (s,) = encode(read_preferences(write(tmp_path, [{"prompt": "2+2=", "completion": "4", "label": True}])), tok, 64, "p")
    assert isinstance(s, SingleRow) and s.desirable and s.traj.completion_ids[-1] == tok.eos_token_id
    assert extract_prompt("ab cd", "ab ce") == ("ab c", "d", "e")  # split mid-word: nothing to move
    assert isinstance(PairRow(s.traj, s.traj), PairRow)


@pytest.mark.parametrize("name", ["assay.po.losses", "assay.po.data", "assay.po.pairs"])
def test_docstring_examples(name):
    assert doctest.testmod(importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
