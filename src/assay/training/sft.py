"""Supervised fine-tuning on (prompt, answer) pairs: the loss covers answer tokens only.

Used by the bundled-model recipes (`assay.recipes`), which feed it imperfect
demonstrations (`assay.recipes.noisy`) or episodes of an environment (`assay.recipes.demos`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch



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
    rows = []
    for prompt, answer in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        a = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        rows.append((p + a, [-100] * len(p) + a))
    return encode_rows(tokenizer.pad_token_id, rows)


def encode_rows(pad_id: int, rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask` and `labels` of `(ids, labels)` rows (labels −100 where not trained)."""
    width = max(len(r) for r, _ in rows)
    ids = [list(r) + [pad_id] * (width - len(r)) for r, _ in rows]
    lab = [list(l) + [-100] * (width - len(l)) for _, l in rows]
    mask = [[1] * len(r) + [0] * (width - len(r)) for r, _ in rows]
    return tuple(torch.tensor(x, dtype=torch.long, device="cpu") for x in (ids, mask, lab))


def sft(model, tokenizer, batches: Iterable[list], cfg: SFTConfig, on_step: Callable[[int, float], None] | None = None,
        encode: Callable[[list], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> None:
    """Train `model` on answer tokens with AdamW and a warm-up + cosine schedule.

    Each batch is a list of (prompt, answer) pairs, or whatever `encode` turns into
    `input_ids`, `attention_mask` and `labels` (`encode_rows` for token rows), moved to the
    model's device.
    """
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    model.train()
    device = next(model.parameters()).device
    for step, pairs in zip(range(cfg.steps), batches):
        ids, mask, labels = (t.to(device) for t in (encode(pairs) if encode else encode_pairs(tokenizer, pairs)))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step:
            on_step(step, loss.item())
    model.eval()
