"""The in-process torch sampler (`rollout.backend=torch`): batched generation with a KV cache.

Each prompt is prefilled once and its cache is shared by its G completions; finished
sequences leave the batch, so late steps only pay for sequences still running. The
sampler records the logprob of every token it draws, under the same temperature the
trainer uses, so the trainer can score exactly what was sampled and needs no second
pass to get the old policy's logprobs.

Two decoding paths give the same tokens and logprobs: `StaticDecoder`
(`assay.rollout.decoder`, a preallocated cache, for the Llama family) and the generic
Hugging Face path with a `DynamicCache` for every other model. `TorchSampler.path` says
which one a model gets.
"""

from __future__ import annotations

import torch

from assay.models.llama import supported
from assay.rollout.base import SAMPLERS, SamplingParams, encode_prompt, pad_id, stop_ids
from assay.rollout.decoder import StaticDecoder, hf_prefill
from assay.types import Sample, Trajectory


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


class _HFStepper:
    """Decoding through the model's own forward with a growing `DynamicCache` (any causal LM)."""

    def __init__(self, model):
        self.model = model

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int) -> torch.Tensor:
        logits, self.cache = hf_prefill(self.model, ids, mask)
        if repeat > 1:
            self.cache.batch_repeat_interleave(repeat)
        self.mask = mask.repeat_interleave(repeat, 0)
        return logits

    def select(self, idx: torch.Tensor) -> None:
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        out = self.model(input_ids=tok[:, None], attention_mask=self.mask, position_ids=pos, cache=self.cache, use_cache=True)
        return out.logits[:, -1]


class TorchSampler:
    """Generates completions with a Hugging Face causal LM in this process (the `Sampler` interface).

    It shares the learner's model object, so a weight update is seen at once:
    `update_weights` only records the new policy version (and takes a different model
    object when given one); `sleep`, `wake` and `close` have nothing to release.

    Args:
        model, tokenizer: the policy and its tokenizer (left padding is applied here).
        device: where the prompts go; the model must already be there.
        fast: use `StaticDecoder` when the model supports it (set False to force the
            generic Hugging Face path, for example to compare the two).
        compact_frac: finished rows are dropped from the batch once at least this
            fraction of the running rows has finished (dropping copies the cache).
    """

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", fast: bool = True, compact_frac: float = 0.25):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.stop = torch.tensor(stop_ids(model, tokenizer), dtype=torch.long, device=self.device)  # EOS, end of turn
        self.pad_id = pad_id(tokenizer)
        self.fast, self.compact_frac = fast, compact_frac
        self.version = 0

    def update_weights(self, model, version: int) -> None:
        """The learner updated `model` in place (the same object this sampler holds): record the version."""
        self.model = model
        self.version = version

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def path(self) -> str:
        """`static` (StaticDecoder) or `hf` (generic), with the reason when the fast path is not taken.

        Judged without a length; `generate` also takes the fast path for a sliding-window
        model when its sequences fit in the window.
        """
        why = supported(self.model) if self.fast else "fast=False"
        return "static" if why is None else f"hf ({why})"

    def encode(self, samples: list[Sample]) -> list[list[int]]:
        return [encode_prompt(self.tokenizer, s) for s in samples]

    @torch.no_grad()
    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: torch.Generator | None = None) -> list[Trajectory]:
        """Sample `n` completions per prompt; trajectories come grouped, prompt by prompt."""
        was_training = self.model.training
        if was_training:  # a Hugging Face model's train()/eval() walks every module: ~1 ms, so only when it changes
            self.model.eval()
        prompt_ids = self.encode(samples)
        ids, mask = _left_pad(prompt_ids, self.pad_id)
        fast = self.fast and supported(self.model, max_len=ids.shape[1] + params.max_new_tokens) is None
        stepper = StaticDecoder(self.model) if fast else _HFStepper(self.model)
        ids, mask = ids.to(self.device), mask.to(self.device)
        logits = stepper.prefill(ids, mask, n, params.max_new_tokens)
        if n > 1:
            logits = logits.repeat_interleave(n, 0)
        total, steps = len(samples) * n, params.max_new_tokens
        tokens = torch.full((total, steps), self.pad_id, dtype=torch.long, device=self.device)
        logprobs = torch.zeros((total, steps), dtype=torch.float32, device=self.device)
        lengths = torch.full((total,), steps, dtype=torch.long, device=self.device)
        next_pos = mask.sum(-1, keepdim=True).repeat_interleave(n, 0)  # [B, 1]
        active = torch.arange(total, device=self.device)  # batch rows still in the cache
        running = torch.ones(total, dtype=torch.bool, device=self.device)  # of those, not finished yet
        for step in range(steps):
            tok, lp = _pick(logits, params, generator)
            rows = active[running]
            tokens[rows, step], logprobs[rows, step] = tok[running], lp[running]
            ended = running & torch.isin(tok, self.stop)
            lengths[active[ended]] = step + 1
            running = running & ~ended
            alive = int(running.sum())
            if alive == 0 or step == steps - 1:
                break
            if alive <= (1 - self.compact_frac) * running.numel():
                keep = running.nonzero()[:, 0]
                stepper.select(keep)
                active, tok, next_pos, running = active[keep], tok[keep], next_pos[keep], running[keep]
            logits = stepper.step(tok, next_pos)
            next_pos = next_pos + 1
        if was_training:
            self.model.train()
        lengths_l, tokens_l, logprobs_l = lengths.tolist(), tokens.tolist(), logprobs.tolist()
        stop = set(self.stop.tolist())
        finished = [tokens_l[r][k - 1] in stop for r, k in enumerate(lengths_l)]  # ended on EOS, not on the limit
        trajs = []
        for row in range(total):
            g, k = row // n, lengths_l[row]
            ids_row = tokens_l[row][:k]
            text = self.tokenizer.decode(ids_row, skip_special_tokens=True)
            trajs.append(Trajectory(samples[g], text, prompt_ids[g], ids_row, logprobs_l[row][:k], finished[row], group=g, version=self.version))
        return trajs


@SAMPLERS.register("torch")
def torch_sampler(model, tokenizer, rollout=None, device="cpu") -> TorchSampler:
    """The in-process sampler over the learner's own model."""
    return TorchSampler(model, tokenizer, device)
