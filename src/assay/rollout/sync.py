"""Verifying a weight sync: the engine's logprobs of a fixed probe against the learner's.

An engine backend holds its own copy of the policy's weights. After every
`update_weights` it scores one fixed token sequence (the *probe*) with its new weights,
the learner scores the same sequence with its model, and the two must agree. A sync that
was silently skipped (an engine asleep during the update, a parameter name the engine
did not recognise, a repacked kernel weight left stale) leaves the engine scoring with
the old weights, and the run stops with one line instead of training off-policy
unnoticed.
"""

from __future__ import annotations

from typing import Any

import torch

from assay.devices import generator_for
from assay.errors import AssayError

#: default tolerance on the probe's mean |Δ logprob| per parameter dtype
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}


def probe_ids(vocab_size: int, length: int = 24, seed: int = 0, avoid: tuple[int, ...] = ()) -> list[int]:
    """A fixed pseudo-random token sequence `[length]` (the same for every run of a model size).

    `avoid`: ids the probe must not hold (a vision-language model's image placeholder, which its forward
    replaces with picture features and so cannot take without a picture); each is moved to the next id.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(0, vocab_size, (length,), device="cpu", generator=generator_for(gen, "cpu")).tolist()
    for _ in range(len(avoid) + 1):
        ids = [(i + 1) % vocab_size if i in avoid else i for i in ids]
    return ids



def picture_probe():
    """A fixed prompt with one picture (seeded noise, 32×32) for a vision-language policy's sync check: the text probe
    does not pass through the vision tower, so a stale vision tower or stale cached picture features would go unseen."""
    import numpy as np
    from PIL import Image

    from assay.types import Sample

    pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    return Sample("sync-probe", [{"role": "user", "content": [{"type": "image", "image": Image.fromarray(pixels)}, {"type": "text", "text": "1+2"}]}])


@torch.no_grad()
def learner_probe_logprobs(model: Any, ids: list[int], inputs: dict[str, Any] | None = None) -> list[float]:
    """log p(ids[t] | ids[:t]) for t = 1 … L−1 under `model` at temperature 1 `[L − 1]`; `inputs`: a picture prompt's
    processor outputs (`assay.vision.inputs.encode_sample`)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    extra = {k: torch.as_tensor(v, device=device) for k, v in (inputs or {}).items()}
    logits = model(input_ids=torch.tensor([ids], device=device), **extra).logits[0, :-1].float()  # [L − 1, V]
    if was_training:
        model.train()
    lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids[1:], device=device)[:, None])[:, 0]
    return lp.tolist()


def tolerance_for(model: Any, configured: float | None) -> float:
    """The configured tolerance, else the default for the model's parameter dtype."""
    if configured is not None:
        return configured
    return TOLERANCE.get(next(model.parameters()).dtype, 5e-2)


def check_sync(engine_lp: list[float], learner_lp: list[float], tolerance: float, what: str, version: int) -> dict[str, float]:
    """`engine/sync_diff_mean` and `engine/sync_diff_max` of the probe; one `AssayError` line when they disagree.

    Args:
        engine_lp, learner_lp: the probe's logprobs from the engine and from the learner `[L − 1]`.
        tolerance: largest mean |Δ logprob| accepted.
        what: the engine, for the message ("vLLM engine", "server http://…").
        version: the policy version just synced.
    """
    if len(engine_lp) != len(learner_lp):
        raise AssayError(f"{what}: weight sync check got {len(engine_lp)} probe logprobs, expected {len(learner_lp)}")
    diffs = [abs(a - b) for a, b in zip(engine_lp, learner_lp)]
    mean, worst = sum(diffs) / max(1, len(diffs)), max(diffs, default=0.0)
    if not mean <= tolerance:  # NaN fails too
        raise AssayError(f"{what}: weight sync to version {version} failed: the engine's logprobs of a fixed probe differ from the "
                         f"learner's by {mean:.3g} on average (max {worst:.3g}; tolerance {tolerance:g}, rollout.sync_tolerance)")
    return {"engine/sync_diff_mean": mean, "engine/sync_diff_max": worst}
