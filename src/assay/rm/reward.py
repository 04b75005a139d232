"""A trained reward model as a reward: `reward: {name: rm, args: {path: RUN_DIR or MODEL_DIR}}`, and a process
reward model as `{name: prm, args: {path: ..., reduce: min}}` (per-step scores and spans, reduced to one).

The score of a completion is the reward model's scalar on the prompt followed by the
completion (the text, tokenised by the reward model's own tokenizer, whatever the policy's).
The model is loaded once per process, on the first batch, and shared by every `RMReward`
with the same path and device; the instance itself holds only its arguments, so it pickles
cheaply. A model reward declares `kind = "batch"`: the executor hands it the whole batch in
the caller's process, whatever `reward_workers` says, and it scores it in forwards of
`batch_size` sequences. (In reward worker processes, one item at a time with a model per
worker, `assay eval --best-of 4` took 7× as long: worker processes are for verifiers that
need isolation and per-item deadlines, which a forward pass does not.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.rewards.base import REWARDS, Reward, score_safely
from assay.types import RewardResult, Trajectory

#: (folder, device) → (model, encoder): one load per process
_LOADED: dict[tuple[str, str], tuple[Any, Any]] = {}


def loaded(path: str, device: str) -> tuple[Any, Any]:
    """`(model, encoder)` of the reward model at `path`, loaded on first use in this process."""
    key = (str(Path(path).resolve()), device)
    if key not in _LOADED:
        from assay.rm.model import encoder_for, load_rm

        model, tok, meta = load_rm(path, device)
        _LOADED[key] = (model, encoder_for(tok, meta))
    return _LOADED[key]


class _ModelReward(Reward):
    """What `rm` and `prm` share: a model folder checked at construction, a whole batch scored in
    forwards (the subclass's `_score(batch)`), and one bad item failing alone, never the batch."""

    verdict = False  # a learned score, not right/wrong
    kind = "batch"  # the whole batch in one process, in batched forwards: never one item per worker

    def __init__(self, path: str, batch_size: int, trained_by: str):
        p = Path(path)
        if not ((p / "config.json").is_file() or (p / "final" / "config.json").is_file()):
            raise ValueError(f"path {path!r} holds no reward model (expected the folder `{trained_by}` wrote, or its run folder)")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")

    def score(self, traj: Trajectory) -> RewardResult:
        return self._score([traj])[0]

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        if not batch:
            return []
        try:
            return self._score(batch)
        except Exception:  # one bad item (text the tokenizer refuses) fails alone, never the batch
            return [score_safely(self, t) for t in batch]


@REWARDS.register("rm")
class RMReward(_ModelReward):
    """A trained scalar reward model (`assay rm train`): its score of prompt + completion, or of prompt + picture
    for a picture scorer (`kind=image`; the picture an image policy drew, `info["image"]`).

    Args:
        path: the reward model folder, or the run folder whose `final/` holds it.
        device: where the model runs (`cpu`, `cuda`).
        batch_size: sequences per forward when a batch is scored.
        verifier: a reward block (for example `arithmetic`) run beside the model: its score is
            the result's `verifier` component, never the reward, so the run logs
            `reward/verifier/mean` and how often the two disagree (`reward/verifier_disagreement`).
    """

    preload = ("assay.rm.model",)
    reward_args = ("verifier",)

    def __init__(self, path: str, device: str = "cpu", batch_size: int = 64, verifier: Reward | None = None):
        super().__init__(path, batch_size, "assay rm train")
        self.path, self.device, self.batch_size, self.verifier = str(path), device, batch_size, verifier

    def warm(self) -> None:
        loaded(self.path, self.device)

    def _score(self, batch: list[Trajectory]) -> list[RewardResult]:
        from assay.rm.model import score_texts

        model, encoder = loaded(self.path, self.device)
        if getattr(encoder, "modality", "text") == "image":  # a picture scorer (`kind=image`) reads the picture an image policy drew
            items = [(t.sample.prompt, _picture(t)) for t in batch]
        else:
            items = [(t.sample.prompt, t.completion) for t in batch]
        scores = score_texts(model, encoder, items, self.batch_size)
        results = [RewardResult(s) for s in scores]
        if self.verifier is not None:
            for r, check in zip(results, self.verifier(batch)):
                if check.score is not None and check.error is None:
                    r.components["verifier"] = float(check.score)
        return results


def _picture(traj: Trajectory) -> Any:
    image = traj.info.get("image")
    if image is None:
        raise ValueError("an image reward model scores pictures: this trajectory holds none (info['image']; an image policy's samples do)")
    return image


@REWARDS.register("prm")
class PRMReward(_ModelReward):
    """A trained process reward model (`assay rm train kind=prm`): a score per step, reduced to one.

    Each step of the completion (cut with `split`) is scored σ(logit) at its last token; the
    result's `steps` and `spans` hold them, and its score is their `reduce`: `min` by default,
    the min-form credit of "Stop Summation: Min-Form Credit Assignment Is All Process Reward
    Model Needs for Reasoning" (Cheng et al., arXiv 2504.15275), a solution worth its weakest
    step; `mean`, `last`, `prod` otherwise. A completion without a step (empty or blank)
    cannot be scored: `score=None`, `info.reason`.

    Args:
        path: the model folder, or the run folder whose `final/` holds it.
        reduce: `min`, `mean`, `last`, `prod` or `sum` (pays per step: hackable, for study).
        split: how completions are cut (`newline`, `chars:N`, a marker, `module:function`);
            default: the split the model's training rows were cut with, else `newline`.
        device, batch_size: where the model runs, and completions per forward.
    """

    preload = ("assay.rm.prm",)

    def __init__(self, path: str, reduce: str = "min", split: str | None = None, device: str = "cpu", batch_size: int = 64):
        from assay.rewards.steps import REDUCES
        from assay.rm.steps import check_split

        super().__init__(path, batch_size, "assay rm train kind=prm")
        if reduce not in REDUCES:
            raise ValueError(f"reduce {reduce!r}: use one of {', '.join(REDUCES)}")
        if split is not None:
            check_split(split)
        self.path, self.reduce, self.split, self.device, self.batch_size = str(path), reduce, split, device, batch_size

    def warm(self) -> None:
        loaded_prm(self.path, self.device)

    def _score(self, batch: list[Trajectory]) -> list[RewardResult]:
        from assay.rm.prm import reduce_steps, score_completions

        model, encoder, split = loaded_prm(self.path, self.device)
        per = score_completions(model, encoder, [(t.sample.prompt, t.completion) for t in batch], self.split or split, self.batch_size)
        out = []
        for steps in per:
            if not steps:
                out.append(RewardResult(None, info={"reason": "no steps in the completion"}))
                continue
            scores = [s for s, _ in steps]
            out.append(RewardResult(reduce_steps(scores, self.reduce), steps=scores, spans=[span for _, span in steps]))
        return out


#: (folder, device) → (model, step encoder, split of its training rows)
_LOADED_PRM: dict[tuple[str, str], tuple[Any, Any, str]] = {}


def loaded_prm(path: str, device: str) -> tuple[Any, Any, str]:
    """`(model, StepEncoder, split)` of the process reward model at `path`, loaded on first use in this process."""
    key = (str(Path(path).resolve()), device)
    if key not in _LOADED_PRM:
        from assay.rm.model import load_rm
        from assay.rm.prm import StepEncoder

        model, tok, meta = load_rm(path, device)
        _LOADED_PRM[key] = (model, StepEncoder(tok, int(meta.get("max_length", 256))), meta.get("split") or "newline")
    return _LOADED_PRM[key]
