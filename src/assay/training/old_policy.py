"""The rollout policy as a moving average of the trained one (`algo.old_ema`).

DiffusionNFT ("DiffusionNFT: Online Diffusion Reinforcement with Forward Process", Zheng et al.,
arXiv 2509.16117) samples with an "old" policy that trails the trained one: after each step
θ_old ← d·θ_old + (1 − d)·θ, with d rising linearly from 0 (`algo.old_ema_rate` a step, after
`algo.old_ema_after` steps) up to `algo.old_ema`. The old policy draws the batch, gives the
loss its v_old (`FlowPolicy.draw_noisings`) and, for a text policy, the sampled tokens' logprobs
(π_old of the ratio); evaluation, checkpoints' weights and `final/` are the trained policy.
With d = 0 the old policy is the trained one after every step, which is the loop without it.

The moving average is kept in fp32 beside the copy (a bf16 copy could not take steps of
(1 − d) = 0.001 of a difference) and saved in each checkpoint as `old-policy.safetensors`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from assay.errors import AssayError
from assay.training.checkpoint import load_tensors

#: the checkpoint file stem of the old policy's weights
STEM = "old-policy"


def old_decay(step: int, top: float, rate: float | None, after: int) -> float:
    """d after `step` finished steps (0-based: the update of step 0 uses `old_decay(0, ...)`): 0 for the first `after`
    steps, then `rate`·(step − after) up to `top`; `rate` None: `top` from the first step.

    >>> [old_decay(s, 0.5, 0.125, 2) for s in (0, 2, 3, 4, 9)]
    [0.0, 0.0, 0.125, 0.25, 0.5]
    >>> old_decay(0, 0.9, None, 0)
    0.9
    """
    if step < after:
        return 0.0
    return top if rate is None else min(top, rate * (step - after))


class OldPolicy:
    """A copy of the trained policy that samples the batches, trailing it by a moving average.

    Args:
        trainer: the run (`assay.training.rl.Trainer`), its policy placed where it trains; from now on its rollouts are
            drawn with this copy's sampler (`trainer.rollout_model`, `trainer.rollout_sampler`).
    """

    def __init__(self, trainer: Any):
        from assay.training.async_rollouts import producer_policy

        if trainer.ranks.active:
            raise AssayError("algo.old_ema under torchrun: the moving-average rollout policy runs in one process for now")
        algo = trainer.cfg.algo
        self.top, self.rate, self.after = algo.old_ema, algo.old_ema_rate, algo.old_ema_after
        self.model, self.sampler = producer_policy(trainer)
        mine = dict(self.model.named_parameters())
        self.names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        self.params = {n: mine[n] for n in self.names}  # the copy's own tensors (the frozen ones are shared)
        self.ema = {n: p.detach().float().clone() for n, p in self.params.items()}
        trainer.rollout_model, trainer.rollout_sampler = self.model, self.sampler

    @torch.no_grad()
    def after_update(self, trained: torch.nn.Module, step: int) -> dict[str, float]:
        """Move the old policy toward `trained` after step `step`'s update; the step's `actor/old_ema`."""
        d = old_decay(step, self.top, self.rate, self.after)
        now = dict(trained.named_parameters())
        for n in self.names:
            self.ema[n].lerp_(now[n].detach().float(), 1.0 - d)
            self.params[n].copy_(self.ema[n])
        self.sampler.update_weights(self.model, step + 1)
        return {"actor/old_ema": d}

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """The moving average, device-free, under its file stem: what a checkpoint saves (`save_checkpoint`'s `tensors`)."""
        return {STEM: {n: t.detach().cpu() for n, t in self.ema.items()}}

    @torch.no_grad()
    def load(self, ckpt: Path, step: int) -> None:
        """Put back the moving average the checkpoint folder `ckpt` saved, as of `step`."""
        if not (ckpt / f"{STEM}.safetensors").is_file():
            raise AssayError(f"--resume: {ckpt} has no {STEM}.safetensors, the rollout policy of algo.old_ema")
        tensors = load_tensors(ckpt, STEM)
        missing = sorted(set(self.names) - set(tensors))
        if missing:
            raise AssayError(f"the checkpoint's {STEM}.safetensors lacks {len(missing)} of the policy's weights ({missing[0]}, ...): "
                             "it was not written by a run with these settings")
        for n in self.names:
            self.ema[n].copy_(tensors[n])
            self.params[n].copy_(self.ema[n])
        self.sampler.update_weights(self.model, step)
