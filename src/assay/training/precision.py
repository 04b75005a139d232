"""Parameter precision: what `model.dtype` means for the learner's weights, gradients and optimizer.

- `float32`: parameters, gradients and AdamW's moments in fp32. The CPU default (a CPU's bf16
  matmuls are hundreds of times slower); on a CUDA device fp32 matmuls may use TF32 tensor
  cores (`model.tf32`).
- `bfloat16` (or `float16`): the model's parameters are bf16 — what the sampler decodes with
  and what the learner's forward and backward read — and the optimizer keeps an fp32 *master*
  copy of every trainable parameter with its fp32 moments. Each step copies the bf16
  gradients into the masters, clips their norm and steps in fp32, then writes the masters
  back, rounded to bf16.

Why bf16 parameters with fp32 masters rather than fp32 parameters under bf16 autocast: the
in-process sampler then reads the very bf16 weights the learner trains, with no cast of every
weight at every decoded token and no second copy to keep in sync, and the learner's logprobs
come from the same weights that sampled, so the mismatch check (`algo.mismatch`) measures the
kernels alone. The masters are still needed: bf16 keeps 8 significant bits, so an update
smaller than 1/256 of a weight (most updates at RL learning rates) would round away in a bf16
parameter, while the fp32 master accumulates it. Memory per parameter is the same either way
(2 + 2 + 4 + 8 bytes: bf16 weight and gradient, fp32 master and two moments). Logprobs, the
policy loss and its aggregation are computed in fp32 whatever the dtype: the LM head's matmul
runs in the parameter dtype (fp32 accumulation) and its output is cast to fp32 before the softmax.

`float16` adds dynamic loss scaling (Micikevicius et al., "Mixed Precision Training", ICLR 2018, arXiv:1710.03740):
fp16 has bf16's precision to spare but only five exponent bits, so gradients below 2^-24 (common in the backward of a
long sequence's token-mean loss) flush to zero. The loss is multiplied by a scale before the backward (`backward`), the
fp32 master gradients divided by it, and the scale halved whenever the gradient overflows (that step is skipped) and
doubled after 2,000 steps without overflow, as `torch.amp.GradScaler` does. bf16 has fp32's exponent range and needs none.

Whatever the dtype, a step whose gradient norm is not finite (inf or NaN: an overflow, a poisoned batch) is skipped
rather than written into the weights and AdamW's moments, where one NaN would stay for the rest of the run (verl's actor
does the same); `skipped` counts them (`actor/skipped_updates`).
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Iterable

import torch

from assay.log import log

# a step skipped over an overflow leaves the optimizer unstepped, which a scheduler stepped after it takes for a call out
# of order; under loss scaling that is by design (torch.amp.GradScaler's skipped steps draw the same warning)
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`")


class MasterWeights:
    """The optimizer step for parameters of any dtype, with fp32 master weights where they are not fp32.

    Args:
        params: the model's parameters (only those that require grad are trained; an fp16 one among the rest, a LoRA
            run's frozen base, still turns loss scaling on: the backward runs through it).
        make_optimizer: builds the optimizer over the tensors it should step (the fp32 masters,
            or the parameters themselves when they are fp32), e.g. `lambda ps: torch.optim.AdamW(ps, lr=1e-5)`.

    `optimizer` is that optimizer (a learning-rate scheduler wraps it); `backward(loss)` runs a backward at the loss
    scale (`loss_scale`: 1 unless a parameter is fp16; a caller that runs its own backward multiplies its loss by it);
    `step(max_norm)` unscales, clips and steps, or skips a non-finite gradient; `master_state()` / `load_master(state)`
    carry the masters and the loss scale through a checkpoint.
    """

    INITIAL_SCALE = 2.0**16  # torch.amp.GradScaler's defaults
    GROWTH_INTERVAL = 2000

    def __init__(self, params: Iterable[torch.nn.Parameter], make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]):
        every = list(params)
        self.params = [p for p in every if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.mixed else []
        self.optimizer = make_optimizer(self.master if self.mixed else self.params)
        self.scaled = any(p.dtype == torch.float16 for p in every)
        self.loss_scale = self.INITIAL_SCALE if self.scaled else 1.0
        self.good_steps = 0  # finite steps since the loss scale last changed
        self.skipped = 0  # steps skipped over a non-finite gradient, over the run

    def zero_grad(self) -> None:
        for p in (*self.params, *self.master):
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()` at the loss scale."""
        (loss * self.loss_scale if self.scaled else loss).backward()

    def step(self, max_norm: float) -> float:
        """Unscale, clip the gradient norm to `max_norm` (in fp32) and step; returns the norm before clipping. A norm that
        is not finite skips the step (the weights and the optimizer's state stay as they were) and, under loss scaling,
        halves the scale."""
        if self.mixed:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None  # the fp32 copy is the gradient now: the bf16 one need not stay alive through the step
        stepped = self.master if self.mixed else self.params
        if self.scaled:
            for t in stepped:
                if t.grad is not None:
                    t.grad.div_(self.loss_scale)
        norm = float(torch.nn.utils.clip_grad_norm_(stepped, max_norm))
        if not math.isfinite(norm):
            self.skipped += 1
            self.zero_grad()
            if not self.scaled:
                log.warning(f"the gradient norm is {norm}: this optimizer step is skipped (the weights stay as they were)")
            elif self.loss_scale >= 1 > self.loss_scale / 2:  # 17 overflows in a row: the loss itself is not finite
                log.warning("the fp16 loss scale fell below 1: every step is being skipped, so the loss or its gradient is inf or "
                            "NaN at any scale (model.dtype=bfloat16 has fp32's range)")
            if self.scaled:
                self.loss_scale, self.good_steps = self.loss_scale / 2, 0
            return norm
        self.optimizer.step()
        if self.mixed:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)
        self.good_steps += 1
        if self.scaled and self.good_steps >= self.GROWTH_INTERVAL:
            self.loss_scale, self.good_steps = self.loss_scale * 2, 0
        return norm

    def metrics(self, skipped_before: int, prefix: str = "actor/") -> dict[str, float]:
        """`{prefix}skipped_updates` since the count was `skipped_before` and, under loss scaling, `{prefix}loss_scale`."""
        out = {f"{prefix}skipped_updates": float(self.skipped - skipped_before)}
        return {**out, f"{prefix}loss_scale": self.loss_scale} if self.scaled else out

    def step_with_metrics(self, max_norm: float, prefix: str) -> dict[str, float]:
        """`step(max_norm)` for a trainer whose training step is one optimizer step: `{prefix}grad_norm` and `metrics`'."""
        skipped = self.skipped
        return {f"{prefix}grad_norm": self.step(max_norm), **self.metrics(skipped, prefix)}

    def master_state(self) -> dict[str, Any]:
        """What a resumed run needs beyond the weights: the fp32 masters (None when the parameters are fp32 themselves), the
        loss scale and the counts."""
        return {"masters": [m.detach().cpu() for m in self.master] if self.mixed else None, "loss_scale": self.loss_scale,
                "good_steps": self.good_steps, "skipped": self.skipped}

    def load_master(self, state: dict[str, Any] | list[torch.Tensor] | None) -> None:
        """Restore what `master_state()` saved (a list: the masters alone, as older checkpoints hold them); with None (a
        checkpoint without them), re-read the masters from the parameters."""
        if isinstance(state, dict):
            self.loss_scale = float(state["loss_scale"]) if self.scaled else 1.0
            self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])
            state = state["masters"]
        if not self.mixed:
            return
        with torch.no_grad():
            for i, (m, p) in enumerate(zip(self.master, self.params)):
                m.copy_(p.float() if state is None else state[i])


def step_means(values: dict[str, list[float]]) -> dict[str, float]:
    """The mean of each metric over a training step's optimizer steps (minibatches, epochs); a gradient norm's over the
    steps that were not skipped (NaN, written as null, when every one was)."""
    out = {}
    for k, v in values.items():
        if k.endswith("grad_norm"):
            v = [x for x in v if math.isfinite(x)] or [math.nan]
        out[k] = sum(v) / len(v)
    return out


def warmup(steps: int) -> Callable[[int], float]:
    """The learning-rate factor of a linear warm-up over `steps` optimizer steps (1 throughout when 0), for `LambdaLR`:
    the recipes use it, and `lr_schedule` starts with it."""
    return lambda s: min(1.0, (s + 1) / steps) if steps else 1.0


def lr_schedule(optim: Any, total: int) -> Callable[[int], float]:
    """The learning-rate factor at each of `total` training steps, for `LambdaLR`: a linear warm-up over
    `optim.warmup_steps`, then `optim.decay` — `constant`, or `linear` or `cosine` from 1 toward `optim.min_lr_ratio`, which
    step `total` would reach (the half-cosine of Loshchilov & Hutter, "SGDR: Stochastic Gradient Descent with Warm Restarts", ICLR 2017,
    without restarts; `get_cosine_schedule_with_warmup` in transformers). The RL loop and the reward-model and preference
    trainers share it; a resumed run that asks for more steps stretches the decay over the new total."""
    ramp, steps, floor = warmup(optim.warmup_steps), optim.warmup_steps, optim.min_lr_ratio

    def factor(s: int) -> float:
        if s < steps or optim.decay == "constant":
            return ramp(s)
        done = min(1.0, (s - steps) / max(1, total - steps))
        shape = 1.0 - done if optim.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * done))
        return floor + (1.0 - floor) * shape

    return factor
