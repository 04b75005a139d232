"""The in-process torch sampler: batched generation with a KV cache.

Each prompt is prefilled once and its cache is shared by its G completions; finished
sequences leave the batch, so late steps only pay for sequences still running. The
sampler records the logprob of every token it draws, under the same temperature the
trainer uses, so the trainer can score exactly what was sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from assay.types import Sample, Trajectory


@dataclass
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: length limit of a completion, in tokens (EOS included).
        temperature: logits are divided by this before sampling; 0 means greedy.
        top_p: nucleus sampling threshold (1.0 keeps the whole distribution).
    """

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0


def _left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
    return ids, mask


def _pick(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens [A], logprobs [A]) under the sampling temperature."""
    logits = logits.float()
    if params.temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logp.argmax(dim=-1)
        return tok, logp.gather(-1, tok[:, None])[:, 0]
    logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [A, V]
    probs = logp.exp()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    tok = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tok, logp.gather(-1, tok[:, None])[:, 0]


class TorchSampler:
    """Generates completions with a Hugging Face causal LM in this process."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    def encode(self, prompts: list[str]) -> list[list[int]]:
        return [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]

    @torch.no_grad()
    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: torch.Generator | None = None) -> list[Trajectory]:
        """Sample `n` completions per prompt; trajectories come grouped, prompt by prompt."""
        from transformers import DynamicCache

        was_training = self.model.training
        self.model.eval()
        prompt_ids = self.encode([s.prompt for s in samples])
        ids, mask = _left_pad(prompt_ids, self.pad_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]  # [U, V]
        if n > 1:
            cache.batch_repeat_interleave(n)
            logits, mask = logits.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
        next_pos = mask.sum(-1, keepdim=True)  # [B, 1]
        total = len(samples) * n
        tokens: list[list[int]] = [[] for _ in range(total)]
        logprobs: list[list[float]] = [[] for _ in range(total)]
        finished = [False] * total
        active = torch.arange(total, device=self.device)  # rows of the batch still running
        for step in range(params.max_new_tokens):
            tok, lp = _pick(logits, params, generator)
            for row, t, l in zip(active.tolist(), tok.tolist(), lp.tolist()):
                tokens[row].append(t)
                logprobs[row].append(l)
                if t == self.eos_id:
                    finished[row] = True
            if step == params.max_new_tokens - 1:
                break
            keep = tok != self.eos_id  # [A]
            if not bool(keep.any()):
                break
            if not bool(keep.all()):
                idx = keep.nonzero()[:, 0]
                cache.batch_select_indices(idx)
                active, tok, mask, next_pos = active[idx], tok[idx], mask[idx], next_pos[idx]
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, cache=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_pos = next_pos + 1
        self.model.train(was_training)
        trajs = []
        for row in range(total):
            g = row // n
            text = self.tokenizer.decode(tokens[row], skip_special_tokens=True)
            trajs.append(Trajectory(samples[g], text, prompt_ids[g], tokens[row], logprobs[row], finished[row], group=g))
        return trajs
