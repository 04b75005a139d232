"""Supervised fine-tuning on (prompt, answer) pairs: the loss covers answer tokens only.

Used by the bundled-model recipes; `noise` lets a recipe supervise on imperfect
demonstrations, which leaves a model that puts real probability on the right answer
without producing it reliably — the situation where RL with a verifier helps most
(see docs/architecture.md, "the bundled model").
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from assay.types import Sample


@dataclass
class SFTConfig:
    """Hyperparameters of one SFT run."""

    steps: int = 700
    batch_size: int = 128
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.01
    seed: int = 0


def encode_pairs(tokenizer, pairs: list[tuple[str, str]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` (−100 outside the answer)."""
    rows, labels = [], []
    for prompt, answer in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, : len(r)], lab[i, : len(l)], mask[i, : len(r)] = torch.tensor(r), torch.tensor(l), 1
    return ids, mask, lab


def sft(model, tokenizer, batches: Iterable[list[tuple[str, str]]], cfg: SFTConfig, on_step: Callable[[int, float], None] | None = None) -> None:
    """Train `model` on answer tokens with AdamW and a warm-up + cosine schedule."""
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    model.train()
    for step, pairs in zip(range(cfg.steps), batches):
        ids, mask, labels = encode_pairs(tokenizer, pairs)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step:
            on_step(step, loss.item())
    model.eval()


def add_without_carry(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry forgotten: 57 + 68 → 15."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def forget_carry(s: Sample, rng: random.Random) -> str:
    """The answer a careless demonstrator writes for `a+b`: every carry forgotten."""
    a, b = s.fields["nums"]
    return str(add_without_carry(a, b))


def offset_error(s: Sample, rng: random.Random, offsets: tuple[int, ...] = (-10, -2, -1, 1, 2, 10)) -> str:
    """The answer shifted by a random small offset."""
    return str(int(s.answer) + rng.choice(offsets))


CORRUPTIONS: dict[str, Callable[[Sample, random.Random], str]] = {"forget_carry": forget_carry, "offset": offset_error}


def noisy_answers(samples: Iterable[Sample], noise: float, corruption: str, rng: random.Random) -> Iterable[tuple[str, str]]:
    """(prompt, answer) pairs where a fraction `noise` of answers is replaced by `CORRUPTIONS[corruption]`."""
    corrupt = CORRUPTIONS[corruption]
    for s in samples:
        yield s.prompt, corrupt(s, rng) if rng.random() < noise else str(s.answer)
