"""Multi-turn episodes through a chat template: observations as messages, separators kept, history rewrites split."""

import pytest
import torch
from transformers import AutoTokenizer

from assay.envs import Environment, Step
from assay.models import build_tiny_model, quiet_hf
from assay.models.chat import CHATML, build_chat_tokenizer, stop_token_ids
from assay.rollout.base import SamplingParams, make_sampler, stop_ids
from assay.rollout.multiturn import Budget, MultiTurn
from assay.types import Sample

#: ChatML whose rendering of an earlier assistant turn drops its content (as templates that strip past reasoning do)
REWRITES = CHATML.replace("message['content']", "(message['content'] if message['role'] != 'assistant' or loop.last else '')")


class Echo(Environment):
    def reset(self, sample):
        self.k = 0
        return sample.prompt

    def step(self, action):
        self.k += 1
        return Step(f"result {self.k}", 1.0 if self.k == 3 else 0.0, self.k == 3, {"finish_reason": "answer"} if self.k == 3 else {})


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    quiet_hf()
    tok = build_chat_tokenizer("chatml")
    out = tmp_path_factory.mktemp("chat")
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, arch="qwen2", eos_ids=stop_token_ids(tok, "chatml")).save_pretrained(out)
    tok.save_pretrained(out)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)


def episodes(model, tok, n=3, max_turns=5):
    loop = MultiTurn(make_sampler("torch", model, tok), tok, Echo, Budget(max_turns=max_turns, max_tokens=512), chat=True, stop=stop_ids(model, tok))
    return loop.run([Sample("a", "What is 2 + 2?")], n, SamplingParams(6, 1.0), torch.Generator().manual_seed(0))


def test_observations_are_the_templates_own_tokens_with_the_separator(chat):
    model, tok = chat
    end = tok.convert_tokens_to_ids("<|im_end|>")
    trajs = episodes(model, tok)
    for t in trajs:
        assert len(t.turns) == 3 and t.info["reward"] == 1.0 and t.info["segments"] == 1
        assert t.prompt_ids == tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"]
        for k in range(2):  # the tokens between turn k and turn k + 1 are the environment's, masked out
            (_, a_end), (b_start, _) = t.turns[k], t.turns[k + 1]
            shown = t.completion_ids[a_end:b_start]
            assert t.loss_mask[a_end:b_start] == [0] * len(shown) and t.logprobs[a_end:b_start] == [0.0] * len(shown)
            ended = t.completion_ids[a_end - 1] == end
            want = ("" if ended else "<|im_end|>") + f"\n<|im_start|>tool\nresult {k + 1}<|im_end|>\n<|im_start|>assistant\n"
            assert tok.decode(shown) == want  # the "\n" after the model's <|im_end|> is there, not dropped


def test_a_template_that_rewrites_history_splits_the_episode_explicitly(chat):
    model, tok = chat
    tok = AutoTokenizer.from_pretrained(tok.name_or_path)
    tok.chat_template = REWRITES
    trajs = episodes(model, tok, n=2)
    assert len(trajs) == 6  # each episode: three parts, one per turn
    for i in range(0, 6, 3):
        parts = trajs[i : i + 3]
        assert [p.info["segment"] for p in parts] == [0, 1, 2] and all(p.info["segments"] == 3 for p in parts)
        assert [p.info["first_turn"] for p in parts] == [0, 1, 2]  # each part's turn is its episode's turn (turn credit)
        assert [p.finish_reason for p in parts] == ["split", "split", "answer"]
        assert all(len(p.turns) == 1 and all(p.loss_mask) and p.info["reward"] == 1.0 for p in parts)
        assert tok.decode(parts[2].prompt_ids).endswith("<|im_start|>tool\nresult 2<|im_end|>\n<|im_start|>assistant\n")

    trajs = episodes(model, tok, n=2, max_turns=2)  # split after turn 2, then out of turns: no empty third part
    assert [p.finish_reason for p in trajs] == ["split", "max_turns"] * 2 and all(len(p.turns) == 1 for p in trajs)
    assert [p.info["first_turn"] for p in trajs] == [0, 1] * 2
