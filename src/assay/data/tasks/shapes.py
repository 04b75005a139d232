"""The `shapes` task (prompts such as "2 red 1 blue" for an image policy) and its image rewards.

The pictures are drawn and read back by `assay.images.shapes`; see docs/images.md.
"""

from __future__ import annotations

import random

import numpy as np

from assay.data.tasks.base import TASKS, Task
from assay.images.shapes import PALETTE, parse_prompt, read_counts
from assay.rewards.base import REWARDS, Reward
from assay.types import RewardResult, Sample, Trajectory


@TASKS.register("shapes")
class Shapes(Task):
    """Prompts `"N COLOUR"` (N in 1..`max_single`) and `"N1 C1 N2 C2"` (two colours, 1..`max_pair` each); the answer is
    the prompt itself, read back from the picture by the `shapes` reward. 20 single-colour and 180 two-colour prompts
    with the defaults, a fifth of them held out (54). The held-out list holds each held-out prompt `heldout_draws` times
    under ids of their own, so an image policy draws each from that many starting noises (`assay.images.sampler`)."""

    reward = "shapes"
    modality = "image"  # its samples are pictures an image policy draws (`assay rm pairs` pairs pictures)

    def __init__(self, max_single: int = 4, max_pair: int = 3, pair_rate: float = 0.8, heldout_fraction: float = 0.2, heldout_draws: int = 4):
        self.max_single, self.max_pair, self.pair_rate, self.heldout_fraction = max_single, max_pair, pair_rate, heldout_fraction
        self.heldout_draws = heldout_draws

    def heldout(self, n: int) -> list[Sample]:
        """Up to `n` rows: every held-out prompt once, then again under new ids (`…-d1`, `…-d2`), up to `heldout_draws` times."""
        prompts = super().heldout(n)
        rows = [Sample(f"{s.id}-d{d}" if d else s.id, s.prompt, s.answer, dict(s.fields)) for d in range(self.heldout_draws) for s in prompts]
        return rows[:n]

    def make(self, rng: random.Random) -> Sample:
        colours = list(PALETTE)
        if rng.random() < self.pair_rate:
            a, b = rng.sample(colours, 2)
            counts = {a: rng.randint(1, self.max_pair), b: rng.randint(1, self.max_pair)}
        else:
            counts = {rng.choice(colours): rng.randint(1, self.max_single)}
        prompt = " ".join(f"{n} {c}" for c, n in counts.items())
        return Sample(id="", prompt=prompt, answer=prompt, fields={"counts": counts})


def _image_of(traj: Trajectory) -> np.ndarray:
    image = traj.info.get("image")
    if image is None:
        raise ValueError("the trajectory holds no image (info['image']); image rewards score an image policy's samples")
    return np.asarray(image)


@REWARDS.register("shapes")
class ShapeCount(Reward):
    """1 when the picture shows exactly the blocks its prompt asks for (every colour counted), else less.

    `credit` says how much less: `exact` 0 (the default), `colours` the share of the palette's colours
    counted right, `error` 1/(1 + E) with E the summed absolute difference of the counts (one block too
    many scores 0.5, two 0.33: the densest signal). A score is 1 only for a right picture under each, so
    accuracy is the same. Components: `count_error` (E).
    """

    CREDITS = ("exact", "colours", "error")

    def __init__(self, credit: str = "exact"):
        if credit not in self.CREDITS:
            raise ValueError(f"credit={credit!r}; allowed: {', '.join(self.CREDITS)}")
        self.credit = credit

    def score(self, traj: Trajectory) -> RewardResult:
        want = parse_prompt(str(traj.sample.answer or traj.sample.prompt))
        got = read_counts(_image_of(traj))
        error = sum(abs(got[c] - want.get(c, 0)) for c in PALETTE)
        right = [got[c] == want.get(c, 0) for c in PALETTE]
        score = {"exact": float(all(right)), "colours": sum(right) / len(right), "error": 1.0 / (1.0 + error)}[self.credit]
        seen = " ".join(f"{n} {c}" for c, n in got.items() if n)
        return RewardResult(score, components={"count_error": float(error)}, info={"extracted": seen or "nothing"})


@REWARDS.register("image_contrast")
class Contrast(Reward):
    """A control reward that knows nothing of the prompt: the picture's mean distance of pixels from black,
    in [0, 1] (bright, saturated pictures pay more). Like `format_only` for text, it shows what a reward
    unrelated to correctness does to the verified checker."""

    verdict = False

    def score(self, traj: Trajectory) -> RewardResult:
        image = _image_of(traj).astype(np.float32) / 255.0
        return RewardResult(float(np.sqrt((image**2).sum(-1) / 3).mean()))
