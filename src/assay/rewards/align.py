"""Where a prompt ends inside a longer string, so that a reward never scores the prompt's text.

OpenRLHF sends `query` = the tokenizer's decode of prompt + response, and a decode rarely
gives the prompt back byte for byte: SentencePiece adds or drops a leading space,
`clean_up_tokenization_spaces` joins spaces before punctuation, padding and BOS render as
special tokens (`<|endoftext|>`, `<s>`). `completion_after` compares the two without
whitespace and special tokens: the text must begin with the prompt, up to those, and the
completion is what follows the prompt's last character (less the special tokens a decode
leaves at the end: EOS, padding). When the text does not begin with the prompt, there is
no completion to give (None), never a guess: scoring the whole text would pay a few-shot
example's `\\boxed{7}` in the prompt to a response that says nothing.

    >>> completion_after("<pad><s> Q: 2+2 ?\\nA: \\\\boxed{4}</s><pad>", "Q: 2+2?\\n")
    'A: \\\\boxed{4}'
    >>> completion_after("Q: 3+3? I do not know.", "Q: 2+2?") is None
    True
"""

from __future__ import annotations

import functools
import re

#: special tokens as decoders render them: `<|im_start|>`, `<|endoftext|>`, `<|begin_of_text|>`,
#: DeepSeek's `<｜begin▁of▁sentence｜>`, `<s>`, `</s>`, `<pad>`, `<unk>`, Gemma's `<start_of_turn>`, `[CLS]`, ...
SPECIAL = (r"<\|[^<>|\s]{1,64}\|>|<｜[^<>｜]{1,64}｜>|</?s>|<(?:pad|unk|eos|bos|mask|start_of_turn|end_of_turn)>"
           r"|\[(?:CLS|SEP|PAD|UNK|MASK)\]")
_SPACE = r"[\s\u2581]"  # whitespace, and SentencePiece's word marker
_GAP = re.compile(rf"(?:{SPECIAL}|{_SPACE})+")
_SPECIAL_AT_END = re.compile(rf"(?:{SPECIAL})\Z")
_TRAILING_GAP = re.compile(rf"(?:{SPECIAL}|{_SPACE})\Z")


def without_trailing_special(text: str) -> str:
    """`text` less the special tokens at its end (and the whitespace before and among them): `4\\n</s><pad>` -> `4`.

    Reads only the end of `text`, one token at a time (a long completion costs nothing).
    """
    end, cut = len(text), False
    while True:
        end = _before_space(text, end)
        m = _SPECIAL_AT_END.search(text, max(0, end - 80), end)  # a special token is at most 70 characters
        if m is None:
            return text[:end] if cut else text
        token, start = m.group(), m.start()
        while start >= len(token) and text.startswith(token, start - len(token), start):  # a run of padding, at C speed
            start -= len(token)
        end, cut = start, True


def _before_space(text: str, end: int) -> int:
    """The index just after the last character before `end` that is not whitespace."""
    while end and (text[end - 1].isspace() or text[end - 1] == "\u2581"):
        end -= 1
    return end


def completion_after(text: str, prompt: str) -> str | None:
    """The part of `text` after `prompt`, when `text` begins with it up to whitespace and special tokens; else None.

    An empty prompt (or one of only whitespace and special tokens) leaves the whole text. A
    prompt that ends in special tokens or whitespace (a chat template's generation prompt)
    takes those of the text at the same place with it. Special tokens at the end of the
    completion are dropped (`without_trailing_special`).
    """
    start = _GAP.match(text)
    start = start.end() if start else 0
    if text.startswith(prompt, start):  # the usual case, and the cheap one
        return without_trailing_special(text[start + len(prompt):])
    end = _end_of(text, _squeezed(prompt))
    if end is None:
        return None
    gap = _GAP.match(text, end)
    if gap and _TRAILING_GAP.search(prompt[-80:]):  # the prompt's own closing tokens (`<|end_header_id|>\n\n`) are not the completion's
        end = gap.end()
    return without_trailing_special(text[end:])


@functools.lru_cache(maxsize=4096)
def _squeezed(prompt: str) -> str:
    """The prompt without whitespace and special tokens (cached: a group's samples share their prompt)."""
    return _GAP.sub("", prompt)


def _end_of(text: str, want: str) -> int | None:
    """The index in `text` just after the last character of `want`, when `text` with its gaps
    (whitespace, special tokens) left out begins with `want`; None when it does not.

    Reads `text` only as far as `want` reaches (a long completion costs nothing).
    """
    if not want:
        return 0
    done, i = 0, 0  # characters of `want` matched; where the next piece of `text` starts
    for gap in _GAP.finditer(text):
        piece = text[i:gap.start()]
        if done + len(piece) >= len(want):
            return i + len(want) - done if want[done:] == piece[: len(want) - done] else None
        if not want.startswith(piece, done):
            return None
        done, i = done + len(piece), gap.end()
    piece = text[i:]
    if done + len(piece) >= len(want) and want[done:] == piece[: len(want) - done]:
        return i + len(want) - done
    return None
