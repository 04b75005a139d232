"""`rollout.backend=image`: the sampler of an image policy (`FlowPolicy`), behind the same interface as text.

A trajectory is one picture. Its `completion_ids` are the indices of its first K denoising
steps, the actions (`sampling.train_steps`, else all of them), its `logprobs` their SDE
log-likelihoods, `info["actions"]` the chain of
latents `[K+1, C, H, W]` (float32 numpy) that the learner recomputes the likelihoods from
(`collate` stacks them into `Batch.actions`), and `info["image"]` the picture as `[H, W, 3]`
uint8 numpy, which image rewards read. Temperature 0 samples the deterministic ODE with
`sampling.eval_steps` steps from noise seeded by the prompt's id, so a held-out prompt gets
the same starting noise at every evaluation (the report's before/after grids).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from assay.devices import generator_for, release_memory
from assay.images.flow import FlowPolicy, sample_chain, seeded_noise, to_pixels
from assay.rollout.base import SAMPLERS, SamplingParams, encode_prompt, pad_id
from assay.types import Sample, Trajectory


def prompt_seed(sample: Sample) -> int:
    """A seed fixed by the prompt's id (its greedy picture's starting noise)."""
    return int.from_bytes(hashlib.blake2b(str(sample.id).encode(), digest_size=8).digest(), "big") >> 1


class ImageSampler:
    """Pictures of prompts from a `FlowPolicy`, in place (its weights are the learner's: `update_weights` only counts)."""

    def __init__(self, model: FlowPolicy, tokenizer: Any, rollout: Any = None, device: Any = "cpu"):
        self.model, self.tokenizer, self.device = model, tokenizer, torch.device(device)
        self.version = 0
        self.last_greedy: list[tuple[Sample, np.ndarray]] = []  # the pictures of the last greedy call (evaluation)

    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: Any = None) -> list[Trajectory]:
        model, C, S = self.model, self.model.config.channels, self.model.config.sample_size
        stochastic = params.temperature > 0
        steps = model.sampling.steps if stochastic else model.sampling.eval_steps
        prompt_ids = [encode_prompt(self.tokenizer, s) for s in samples]
        rows = [i for i in range(len(samples)) for _ in range(n)]
        L = max([len(p) for p in prompt_ids] + [1])
        ids = torch.tensor([[pad_id(self.tokenizer)] * (L - len(prompt_ids[i])) + prompt_ids[i] for i in rows], dtype=torch.long, device="cpu")
        mask = torch.tensor([[0] * (L - len(prompt_ids[i])) + [1] * len(prompt_ids[i]) for i in rows], dtype=torch.long, device="cpu")
        if stochastic and model.sampling.shared_noise:  # one starting noise per prompt, its group's pictures differ by their steps
            noise = torch.randn(len(samples), C, S, S, generator=generator_for(generator, "cpu"), device="cpu").repeat_interleave(n, 0)
        elif stochastic:
            noise = torch.randn(len(rows), C, S, S, generator=generator_for(generator, "cpu"), device="cpu")
        else:  # each prompt's own starting noise: the same picture of it at every evaluation
            noise = torch.stack([seeded_noise(prompt_seed(samples[i]), (C, S, S)) for i in rows])
        was_training = model.training
        model.eval()
        with torch.no_grad():
            cond = model.condition(ids.to(self.device), mask.to(self.device))
            chain, logprobs = sample_chain(model, cond, noise.to(self.device), steps, stochastic, generator, model.sampling.actions)
        model.train(was_training)
        pictures = to_pixels(chain[:, -1])
        chains = chain.float().cpu().numpy()
        out = []
        acts = model.sampling.actions if stochastic else steps  # the steps that train (the first ones)
        for r, i in enumerate(rows):
            lp = logprobs[r].tolist() if logprobs is not None else [0.0] * acts
            out.append(Trajectory(samples[i], "<image>", list(prompt_ids[i]), list(range(acts)), lp, True, group=i, version=self.version,
                                  info={"image": pictures[r], "actions": chains[r]}))
        if not stochastic:
            self.last_greedy = [(samples[i], pictures[r]) for r, i in enumerate(rows)]
        return out

    def save_greedy(self, path, n: int = 32) -> None:
        """A grid of the last greedy call's first `n` pictures (framed green where the shapes checker finds them right, red
        where not), with their prompts, to `path` (PNG, written atomically)."""
        from assay.images.shapes import grid, is_right

        shown = self.last_greedy[:n]
        if not shown:
            return
        sheet = grid([img for _, img in shown], captions=[str(s.prompt) for s, _ in shown], right=[is_right(s, img) for s, img in shown])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp-{path.name}")
        sheet.save(tmp, format="PNG")
        tmp.replace(path)

    def update_weights(self, model: Any, version: int) -> None:
        self.model, self.version = model, version

    def sleep(self) -> None:
        """Between rollout and update: what sampling cached on the device goes back to it."""
        release_memory(self.device)

    def wake(self) -> None:
        """Nothing to take back: the weights are the learner's own."""

    def close(self) -> None:
        release_memory(self.device)


@SAMPLERS.register("image")
def _image_sampler(model, tokenizer, rollout=None, device="cpu") -> ImageSampler:
    return ImageSampler(model, tokenizer, rollout, device)
