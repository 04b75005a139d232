"""Scored trajectories as tensors: the learner's `Batch`, and the per-step reward tensors of process rewards.

Below both the learner (`assay.training.learner`) and the samplers that check their logprobs
against it (`assay.rollout.openai_sampler`), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from assay.types import RewardResult, Trajectory
from assay.vision.inputs import VisionInputs


@dataclass
class Batch:
    """Scored rollouts as tensors: prompts left-padded to P, completions right-padded to T.

    Every field lives on the learner's device (the per-row rewards, group ids and components
    too), so any index selects from all of them alike.
    """

    input_ids: torch.Tensor  # [B, P+T]
    attention_mask: torch.Tensor  # [B, P+T]
    position_ids: torch.Tensor  # [B, P+T]
    mask: torch.Tensor  # [B, T] the loss mask: 1 on completion tokens the model sampled
    old_logprobs: torch.Tensor  # [B, T] the sampler's logprobs
    rewards: torch.Tensor  # [B] NaN where unscored
    group: torch.Tensor  # [B]
    components: torch.Tensor  # [B, K] named reward components (sorted names), NaN where absent
    is_weights: torch.Tensor | None = None  # [B, T] TIS/MIS weights on the policy loss (algo.mismatch); None: off
    # [B, T] the sampler's logprobs when the update's own forward is the proximal policy (algo.mismatch with one optimizer
    # step per batch): the loss then takes π_old from that forward, detached, and the TIS/MIS weights against these
    behaviour: torch.Tensor | None = None
    # [B, K+1, ...] what a policy whose actions are not tokens recomputes its step likelihoods from (an image policy's
    # denoising chains, `assay.images`); None for a language model
    actions: torch.Tensor | None = None
    # each row's prompt pictures as the model's processor made them (`assay.vision.inputs.VisionInputs`: `kwargs()` is what
    # the forward takes besides the tokens); None when no row has pictures
    vision: VisionInputs | None = None
    # draws a loss on the forward process reads, fixed for all the optimizer steps the batch takes: each picture's
    # noisings and the rollout policy's output there (`assay.images.flow.Noisings`, DiffusionNFT); None otherwise
    draws: Any = None

    @property
    def response_len(self) -> int:
        return self.mask.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """`[B]` completion tokens per row, sampled or shown (the loss mask may have holes; this counts them)."""
        return self.attention_mask[:, -self.response_len :].sum(-1)

    def select(self, idx: torch.Tensor) -> "Batch":
        """The rows `idx [N]` (an index on any device) of every field."""
        idx = idx.to(self.mask.device)
        return Batch(*(None if (v := getattr(self, f)) is None else v[idx] for f in self.__dataclass_fields__))


def collate(trajs: list[Trajectory], results: list[RewardResult], pad_id: int, device: torch.device) -> Batch:
    """Pack trajectories and their rewards into one `Batch`: exactly their token ids, left-padded prompts.

    The loss mask is each trajectory's `loss_mask` (0 on tokens the model was shown rather
    than sampled) over its completion, 0 on padding; a single-turn trajectory's is all ones.
    """
    B = len(trajs)
    P = max(len(t.prompt_ids) for t in trajs)
    T = max(1, max(len(t.completion_ids) for t in trajs))
    # rows built as Python lists and converted once: one tensor per row costs more than the rest of the step at small shapes
    ids, attn, old, loss = [], [], [], []
    for t in trajs:
        p, c = len(t.prompt_ids), len(t.completion_ids)
        ids.append([pad_id] * (P - p) + list(t.prompt_ids) + list(t.completion_ids) + [pad_id] * (T - c))
        attn.append([0] * (P - p) + [1] * (p + c) + [0] * (T - c))
        old.append(list(t.logprobs) + [0.0] * (T - c))
        loss.append(([1] * c if t.loss_mask is None else [int(bool(x)) for x in t.loss_mask]) + [0] * (T - c))
    names = sorted({k for r in results for k in r.components})
    comps = [[float(r.components.get(k, float("nan"))) for k in names] for r in results]
    acts = [t.info.get("actions") for t in trajs]
    actions = torch.from_numpy(np.stack(acts)).to(device) if all(a is not None for a in acts) else None
    pictures = [t.info.get("vision") for t in trajs]
    vision = VisionInputs.collate(pictures, device) if any(p is not None for p in pictures) else None
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    attn_t = torch.tensor(attn, dtype=torch.long, device=device)
    mask = torch.tensor(loss, dtype=torch.float32, device=device)
    return Batch(
        ids_t, attn_t, (attn_t.cumsum(-1) - 1).clamp(min=0), mask,
        torch.tensor(old, dtype=torch.float32, device=device) * mask,  # logprobs only where the model sampled
        torch.tensor([float("nan") if r.score is None else float(r.score) for r in results], dtype=torch.float32, device=device),
        torch.tensor([t.group for t in trajs], dtype=torch.long, device=device),
        torch.tensor(comps, dtype=torch.float32, device=device).reshape(B, len(names)),
        actions=actions, vision=vision,
    )


def step_tensors(trajs: list[Trajectory], results: list[RewardResult], tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-step rewards `[B, S]` (NaN-padded) and the token index where each step ends `[B, S]` (−1 padded).

    A reward gives step scores with character spans of the completion; a step ends at the
    first token whose decoded prefix reaches the span's end.
    """
    S = max([len(r.steps or []) for r in results] + [1])
    rewards = torch.full((len(trajs), S), float("nan"), device="cpu")  # extras are made on the CPU; the estimator gets them on the batch's device
    ends = torch.full((len(trajs), S), -1, dtype=torch.long, device="cpu")
    for i, (t, r) in enumerate(zip(trajs, results)):
        if not r.steps:
            continue
        prefix = [len(tokenizer.decode(t.completion_ids[: k + 1], skip_special_tokens=True)) for k in range(len(t.completion_ids))]
        spans = r.spans or [(0, len(t.completion))] * len(r.steps)
        for j, (score, (_, end)) in enumerate(zip(r.steps, spans)):
            rewards[i, j] = float(score)
            ends[i, j] = next((k for k, n in enumerate(prefix) if n >= end), len(prefix) - 1)
    return rewards, ends
