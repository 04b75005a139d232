"""The project's own chat tokenizers: byte-level BPE trained here, with the chat templates of two families.

Instruction-tuned models read prompts through their tokenizer's chat template. To test
that path without downloading a tokenizer, assay trains a small byte-level BPE (the kind
GPT-2, Qwen2 and Llama 3 use) on a built-in corpus with the `tokenizers` library and gives
it one of two templates written here:

- `chatml`: ChatML as Qwen2 and Qwen3 use it (`<|im_start|>role\\n…<|im_end|>`), with
  Qwen3's thinking switch: `enable_thinking=False` adds an empty `<think>` block after the
  generation prompt. EOS is `<|im_end|>`; `<|endoftext|>` pads.
- `llama3`: Llama 3's header format (`<|begin_of_text|><|start_header_id|>role<|end_header_id|>\\n\\n…<|eot_id|>`).
  As in the first Llama 3 Instruct release, the tokenizer's EOS is `<|end_of_text|>` and
  the end of a turn, `<|eot_id|>`, is a stop token only through the model's generation
  config (`stop_token_ids` of this module gives both to `build_tiny_model`).

    >>> tok = build_chat_tokenizer("chatml")
    >>> tok.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True, tokenize=False)
    '<|im_start|>user\\n2+2?<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

from typing import Any

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
LLAMA3 = (
    "{%- for message in messages %}"
    "{%- set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}"
    "{%- if loop.index0 == 0 %}{%- set content = bos_token + content %}{%- endif %}"
    "{{- content }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

#: style → (chat template, special tokens, extra special tokens, end-of-turn token)
STYLES: dict[str, tuple[str, dict[str, str], list[str], str]] = {
    "chatml": (CHATML, {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, ["<|im_start|>", "<think>", "</think>"], "<|im_end|>"),
    "llama3": (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|end_of_text|>"},
               ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
}


def corpus() -> list[str]:
    """The built-in training text: chat-like questions and answers, arithmetic, a little Python (deterministic)."""
    lines = [
        "You are a helpful assistant.", "Answer with a number only.", "Think step by step, then give the answer.",
        "The answer is 42.", "Put your final answer within \\boxed{}.", "What is the capital of France? Paris.",
        "def add(a, b):\n    return a + b", "assert add(1, 2) == 3", "for i in range(10):\n    print(i * i)",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
        "How many clips did Natalia sell altogether in April and May? #### 72",
    ]
    for a in range(0, 100, 7):
        for b in range(0, 100, 11):
            lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is \\boxed{{{a + b}}}.")
    return lines


def build_chat_tokenizer(style: str = "chatml", vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on `corpus()`, with the chat template and special tokens of `style`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template, special, extra, _ = STYLES[style]
    names = list(dict.fromkeys([*special.values(), *extra]))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=names, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, extra_special_tokens=extra, padding_side="left", **special)


def stop_token_ids(tokenizer: Any, style: str) -> list[int]:
    """EOS and the end-of-turn token of `style`: what the model's generation config lists as `eos_token_id`."""
    end = tokenizer.convert_tokens_to_ids(STYLES[style][3])
    return list(dict.fromkeys([tokenizer.eos_token_id, end]))
