"""Chat templates and conversational data, on the project's own byte-level BPE tokenizers and tiny Qwen2 and Llama models.

The tokenizers are trained here (`assay.models.chat`) and carry ChatML (Qwen2) or Llama 3's
header template. A conversational row's prompt reaches the model exactly as the tokenizer's
`apply_chat_template` renders it, in the sampler and in the update; plain text keeps its
old encoding; a model without a template refuses conversational data in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from _train_helpers import LEARNING_SIGNAL, assert_learned
from assay.config import load_config
from assay.data.datasets import as_chat, rows_to_samples
from assay.errors import AssayError
from assay.models import build_tiny_model, quiet_hf
from assay.models.chat import CHATML, build_chat_tokenizer, stop_token_ids
from assay.rollout.base import encode_prompt, stop_ids
from assay.training.rl import Trainer
from assay.types import Sample, Trajectory

FAMILIES = {"qwen2": "chatml", "llama": "llama3"}
SYSTEM = "Answer with a number only."


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def chat_model(request, tmp_path_factory):
    """`(folder, tokenizer)`: a tiny random model of the family with its chat tokenizer, saved in HF format."""
    quiet_hf()
    arch, style = request.param, FAMILIES[request.param]
    tok = build_chat_tokenizer(style)
    out = tmp_path_factory.mktemp(f"chat-{arch}")
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, arch=arch, eos_ids=stop_token_ids(tok, style)).save_pretrained(out)
    tok.save_pretrained(out)
    return out, AutoTokenizer.from_pretrained(out)


def conversations(n: int = 20) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is {a} + {a + 7}?"}], "answer": str(2 * a + 7)} for a in range(n)]


def rendered(tok, messages, **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)["input_ids"])


def test_the_saved_tokenizer_is_byte_level_bpe_with_its_template(chat_model):
    folder, tok = chat_model
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "BPE"
    assert tok.chat_template
    text = "Ünïcode ✓ and 12 + 30 = 42"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: nothing is unknown
    ids = rendered(tok, [{"role": "user", "content": "hi"}])
    specials = [t for t in tok.convert_ids_to_tokens(ids) if t.startswith("<|")]
    assert specials and all(t in tok.all_special_tokens for t in specials)  # each control token is one special token


def test_encode_prompt_renders_conversations_with_the_template_and_keeps_plain_text(chat_model):
    _, tok = chat_model
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 3?"}]
    assert encode_prompt(tok, Sample("a", msgs)) == rendered(tok, msgs)
    kwargs = {"enable_thinking": False}
    assert encode_prompt(tok, Sample("b", msgs, template_args=kwargs)) == rendered(tok, msgs, **kwargs)
    assert encode_prompt(tok, Sample("c", "What is 2 + 3?")) == tok("What is 2 + 3?", add_special_tokens=False)["input_ids"]
    prefill = [*msgs, {"role": "assistant", "content": "The answer is"}]  # a started reply is continued, not closed
    ids = encode_prompt(tok, Sample("d", prefill))
    assert tok.decode(ids).endswith("The answer is") and ids == list(tok.apply_chat_template(prefill, continue_final_message=True)["input_ids"])


def test_thinking_switch_reaches_the_template():
    tok = build_chat_tokenizer("chatml")
    msgs = [{"role": "user", "content": "2+2?"}]
    off, on = (tok.decode(encode_prompt(tok, Sample("x", msgs, template_args={"enable_thinking": v}))) for v in (False, True))
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and on.endswith("<|im_start|>assistant\n")


def test_the_models_stop_tokens_include_the_end_of_turn(chat_model):
    folder, tok = chat_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    end = tok.convert_tokens_to_ids("<|im_end|>" if "im_start" in tok.chat_template else "<|eot_id|>")
    assert tok.eos_token_id in stop_ids(model, tok) and end in stop_ids(model, tok)


def test_data_settings_make_conversations(tmp_path):
    data = load_config(None, ["data.chat=true", f"data.system_prompt={SYSTEM}", "data.chat_template_kwargs={enable_thinking: false}"]).data
    rows = [{"prompt": "What is 1 + 1?", "answer": "2"},
            {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}}]
    plain, conv = as_chat(rows_to_samples(rows, {}, "f"), data, "f")
    assert plain.prompt == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 1 + 1?"}]
    assert plain.template_args == {"enable_thinking": False}
    assert conv.prompt[0] == {"role": "system", "content": "own"} and conv.template_args == {"enable_thinking": True}  # the row's own wins
    off = load_config(None, [f"data.system_prompt={SYSTEM}"]).data
    with pytest.raises(AssayError, match="data.chat=true"):
        as_chat(rows_to_samples(rows[:1], {}, "f"), off, "f")
    with pytest.raises(AssayError, match="row 1: message 1 of the prompt is not a"):
        rows_to_samples([{"prompt": [{"content": "no role"}]}], {}, "f")


def test_the_reward_sees_the_completion_and_the_whole_conversation():
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "2+2?"}]
    t = Trajectory(Sample("0", msgs, "4"), "4", [], [], [], True)
    assert t.completion == "4" and t.conversation == [*msgs, {"role": "assistant", "content": "4"}]
    assert Trajectory(Sample("1", "2+2?", "4"), "4", [], [], [], True).conversation is None


def test_a_model_without_a_template_refuses_conversational_data_in_one_line(tiny_model_dir, tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    base = [f"model.path={tiny_model_dir}", "data.task=null", f"data.path={path}", f"output_dir={tmp_path}", "reward=math", "reward_workers=0"]
    with pytest.raises(AssayError, match="has no chat template; give one with model.chat_template"):
        Trainer(load_config(None, [*base, "run_name=none"]))
    assert not (tmp_path / "none").exists()  # refused before the run folder is made
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    trainer = Trainer(load_config(None, [*base, "run_name=given", f"model.chat_template={template}"]))
    assert trainer.tokenizer.chat_template == CHATML


def _record_rows(model) -> dict[bool, list[list[int]]]:
    """Every 2-D batch of token ids the model embeds, row by row, split by whether gradients were on (the update)."""
    seen: dict[bool, list[list[int]]] = {True: [], False: []}

    def hook(module, args):
        if args[0].dim() == 2:
            seen[torch.is_grad_enabled()].extend(args[0].tolist())

    model.model.embed_tokens.register_forward_pre_hook(hook)
    return seen


def embedded(seen: list[list[int]], ids: list[int], pads: set[int]) -> bool:
    """Some row is exactly `ids` after left padding (the sampler pads with the pad id, the update's shared-prefix forward with 0)."""
    n = len(ids)
    return any(len(r) >= n and r[len(r) - n :] == ids and set(r[: len(r) - n]) <= pads for r in seen)


def test_post_training_a_chat_model_feeds_it_exactly_the_templates_rendering(chat_model, tmp_path):
    folder, tok = chat_model
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in conversations()))
    kwargs = {"enable_thinking": False}
    cfg = load_config(None, [
        f"model.path={folder}", "data.task=null", f"data.path={path}", "data.eval_fraction=0.2", f"data.system_prompt={SYSTEM}",
        "data.chat_template_kwargs={enable_thinking: false}", f"output_dir={tmp_path}", "run_name=chat", "train.steps=3",
        "train.eval_every=0", "train.eval_n=4", "train.save_every=0", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=4", "reward_workers=0", "train.threads=1", "optim.warmup_steps=0", "optim.lr=1e-3", LEARNING_SIGNAL,
        "train.skip_zero_advantage=false",  # every row goes through the update, so every prompt is embedded there
    ])
    trainer = Trainer(cfg)
    seen = _record_rows(trainer.model)
    pads = {tok.pad_token_id, 0}
    trajs: list[Trajectory] = []
    generate = trainer.sampler.generate
    trainer.sampler.generate = lambda *a, **k: trajs.extend(out := generate(*a, **k)) or out
    result = trainer.fit(progress=False)

    assert len(trajs) == (3 * 4 + 2 * 4) * 2 - 2 * 4  # 3 steps × 4 prompts × G=2, and the held-out prompts greedily twice (start, end)
    for t in trajs:
        conv = [{"role": "system", "content": SYSTEM}, *[m for m in t.sample.prompt if m["role"] != "system"]]
        want = rendered(tok, conv, **kwargs)
        assert t.sample.prompt == conv and t.prompt_ids == want  # what the sampler gave the model is the template's rendering
        assert embedded(seen[False], want, pads)  # ... and what its prefill embedded
        assert t.conversation[-1] == {"role": "assistant", "content": t.completion}
    trained = [t.prompt_ids for t in trajs if t.sample.id not in {s.id for s in trainer.source.heldout}]
    assert trained and all(embedded(seen[True], ids, pads) for ids in trained)  # the update's forward embedded the same prompt ids
    assert_learned(result.run_dir, folder)
    # samples.jsonl and the report show what the model saw, the template's rendering, beside the message list
    import html

    dumps = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    page = (result.run_dir / "report.html").read_text()
    for d in dumps:
        conv = [{"role": "system", "content": SYSTEM}, *[m for m in d["prompt"] if m["role"] != "system"]]
        assert d["prompt"] == conv and d["prompt_text"] == tok.decode(rendered(tok, conv, **kwargs))
    assert html.escape(dumps[-1]["prompt_text"]) in page and "[{&#x27;role&#x27;" not in page
