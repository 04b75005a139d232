"""What `assay serve rewards` is sent, as trainers send it: decoded prompts that are not byte for
byte the prompt, prompts that hold answers, values of the wrong type, the wrong method.

A reward never scores the prompt's text: the completion is found after the prompt up to
whitespace and special tokens, and where the prompt cannot be found the item is unscored
with its reason, never scored whole. A value of the wrong type is a 400, never a wrong answer.
"""

import json
import urllib.error
import urllib.request

import pytest

from assay.rewards.align import completion_after, without_trailing_special
from test_serve_rewards import Server

FEW_SHOT = "Example: what is 2 + 5 ? Answer: \\boxed{7} .\nNow: what is 3 + 4 ?\n"


# ---------------------------------------------------------------- alignment (pure)


@pytest.mark.parametrize("text, prompt, completion", [
    ("Q: 2+2?\nA: 4", "Q: 2+2?\n", "A: 4"),  # byte for byte
    ("<|endoftext|><|endoftext|>Q: 2+2?\nA: 4<|im_end|><|endoftext|>", "Q: 2+2?\n", "A: 4"),  # left and right padding, EOS
    ("<s> Q: 2+2?\nA: 4</s>", "Q: 2+2?\n", "A: 4"),  # BOS and SentencePiece's leading space
    ("<s> Q: 2+2 ?\nA: 4", "Q: 2+2?\n", "A: 4"),  # ... and a space the prompt did not have
    ("Q: 2+2 ?\nA: 4", "Q: 2+2?", "\nA: 4"),  # the completion starts after the prompt's last character
    ("Q: what is 2+2? Say it.A: 4", "Q: what is 2+2 ? Say it .", "A: 4"),  # clean_up_tokenization_spaces joined ' ?' and ' .'
    ("<｜begin▁of▁sentence｜>User: 1+1=?\n\nAssistant: 2", "User: 1+1=?\n\nAssistant:", " 2"),  # DeepSeek's special tokens
    ("[CLS] q ? a [SEP] [PAD]", "q?", " a"),  # BERT-style special tokens
    ("Q: 2+2?", "", "Q: 2+2?"),  # no prompt: the whole text
    ("Q: 3+3? I do not know.", "Q: 2+2?", None),  # another prompt
    ("Q: 2+", "Q: 2+2?", None),  # the text ends inside the prompt
    ("Intro. Q: 2+2? A: 4", "Q: 2+2?", None),  # the text must begin with the prompt
])
def test_the_completion_is_found_after_the_prompt_up_to_whitespace_and_special_tokens(text, prompt, completion):
    assert completion_after(text, prompt) == completion


def test_trailing_special_tokens_are_dropped_and_nothing_else():
    assert without_trailing_special("\\boxed{4}\n<|im_end|><|endoftext|><|endoftext|>") == "\\boxed{4}"
    assert without_trailing_special("\\boxed{4}\n") == "\\boxed{4}\n"  # whitespace goes only with special tokens
    assert without_trailing_special("a <s> b") == "a <s> b"  # only at the end
    assert without_trailing_special("x < y | z >") == "x < y | z >"


def test_a_real_tokenizers_decode_of_padded_prompt_and_response():
    """OpenRLHF's query: `batch_decode(left-padded prompt + response ids, skip_special_tokens=False)`, here with the
    clean-up of spaces before punctuation that WordPiece tokenizers (and transformers 4 by default) apply."""
    from assay.models.chat import build_chat_tokenizer

    tok = build_chat_tokenizer("llama3")
    prompt = tok.apply_chat_template([{"role": "user", "content": FEW_SHOT}], add_generation_prompt=True, tokenize=False)
    ids = [tok.pad_token_id] * 5 + tok(prompt, add_special_tokens=False)["input_ids"] + tok("I do not know.")["input_ids"] + [tok.eos_token_id]
    query = tok.clean_up_tokenization(tok.decode(ids, skip_special_tokens=False))
    assert not query.startswith(prompt) and "\\boxed{7}." in query  # padded, and ' .' joined: not the prompt byte for byte
    assert completion_after(query, prompt) == "I do not know."


# ---------------------------------------------------------------- over HTTP, as OpenRLHF and verl call it


@pytest.fixture(scope="module")
def server():
    s = Server("--reward", "math", "--workers", "1")
    yield s
    assert s.stop() == 0


def openrlhf_client(url: str, queries, prompts, labels):
    """OpenRLHF's `remote_rm_fn`: POST {query, prompts, labels}, take `rewards` from the reply (the whole reply is returned)."""
    req = urllib.request.Request(url + "/get_reward", json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=180) as r:
        reply = json.loads(r.read())
    assert "rewards" in reply
    return reply


def test_openrlhf_a_prompt_holding_an_answer_never_pays_a_non_answer(server):
    shifted = " " + FEW_SHOT.replace(" ?", "?").replace(" .", ".")  # a detokenised, whitespace-shifted prompt
    queries = ["<|endoftext|>" * 3 + shifted + "I do not know.<|endoftext|>",  # a non-answer after a prompt holding \boxed{7}
               shifted + "3 + 4 = \\boxed{7}",  # the right answer
               "Now: what is 3 + 4 ? \\boxed{7}",  # a query that does not begin with its prompt
               shifted + "\\boxed{8}"]
    reply = openrlhf_client(server.url, queries, [FEW_SHOT] * 4, ["7"] * 4)
    assert reply["rewards"] == [0.0, 1.0, 0.0, 0.0] and reply["scores"] == reply["rewards"]
    assert reply["unscored"] == [2] and reply["extra_logs"]["unscored"] == [0.0, 0.0, 1.0, 0.0]
    assert reply["reasons"] == ["", "", "prompt_not_in_query", ""]


def test_verl_a_solution_that_begins_with_its_prompt_is_scored_after_it(server):
    items = [{"data_source": "math", "solution_str": FEW_SHOT.replace(" ?", "?") + "I do not know.", "ground_truth": "7",
              "extra_info": {"prompt": FEW_SHOT}},  # a decode of the whole sequence: the prompt's box is not the answer
             {"data_source": "math", "solution_str": "\\boxed{7}", "ground_truth": "7", "extra_info": {"prompt": FEW_SHOT}}]
    status, body = server.post("/compute_score", items)
    assert status == 200 and [b["score"] for b in body] == [0.0, 1.0] and not any(b["unscored"] for b in body)


def test_a_number_label_is_a_reference_not_a_wrong_answer(server):
    reply = openrlhf_client(server.url, ["q\\boxed{1.5}", "q\\boxed{42}"], ["q", "q"], [1.5, 42])
    assert reply["rewards"] == [1.0, 1.0] and reply["unscored"] == []
    status, body = server.post("/compute_score", {"solution_str": "\\boxed{12}", "ground_truth": 12})
    assert status == 200 and body["score"] == 1.0


@pytest.mark.parametrize("path, payload, words", [
    ("/get_reward", {"query": ["a", "b"], "labels": [1.5, {"a": 1}]}, "'labels[1]' must be a string, a number or null, got object"),
    ("/get_reward", {"query": ["a"], "labels": [True]}, "'labels[0]' must be a string, a number or null, got boolean"),
    ("/get_reward", {"query": ["a"], "prompts": [None]}, "'prompts[0]' must be a string, got null"),
    ("/get_reward", {"query": [3]}, "'query[0]' must be a string, got number"),
    ("/get_reward", {"query": ["a"], "labels": [["1"]]}, "'labels[0]' must be a string, a number or null, got array"),
    ("/compute_score", {"solution_str": "1", "ground_truth": ["1", "2"]}, "'ground_truth' must be a string, a number or null, got array"),
    ("/compute_score", {"solution_str": "1", "ground_truth": {"x": 1}}, "'ground_truth' must be a string, a number or null, got object"),
    ("/compute_score", [{"solution_str": "1"}, {"solution_str": None}], "item 1: 'solution_str' must be a string, got null"),
    ("/compute_score", {"solution_str": "1", "data_source": 5}, "'data_source' must be a string, got number"),
    ("/compute_score", {"solution_str": "1", "extra_info": {"prompt": 5}}, "'extra_info.prompt' must be a string or a list of messages, got number"),
    ("/score", {"rows": [{"completion": "1", "answer": {"a": 1}}]}, "row 0: 'answer' must be a string, a number or null, got object"),
    ("/score", {"rows": [{"completion": None}]}, "row 0: 'completion' must be a string or a list of messages, got null"),
    ("/score", {"rows": [{"completion": "1", "prompt": 7}]}, "row 0: 'prompt' must be a string or a list of messages, got number"),
])
def test_a_value_of_the_wrong_type_is_a_400_never_a_wrong_answer(server, path, payload, words):
    status, body = server.post(path, payload)
    assert status == 400 and body["error"] == words


@pytest.mark.parametrize("method, path, allowed", [("PUT", "/get_reward", "POST"), ("GET", "/get_reward", "POST"), ("GET", "/compute_score", "POST"),
                                                   ("DELETE", "/score", "POST"), ("POST", "/health", "GET")])
def test_the_wrong_method_is_a_one_line_json_405(server, method, path, allowed):
    req = urllib.request.Request(server.url + path, data=b"{}" if method != "GET" else None, method=method)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 405 and e.value.headers["Allow"] == allowed
    assert json.loads(e.value.read()) == {"error": f"{method} is not allowed on {path}; use {allowed}"}
