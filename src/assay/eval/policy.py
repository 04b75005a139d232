"""Policy evaluation on a task's held-out split: greedy accuracy, pass@k, length.

pass@k uses the unbiased estimator of Chen et al., "Evaluating Large Language Models
Trained on Code" (2021), arXiv:2107.03374: with n samples of which c are correct,
pass@k = 1 − C(n−c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import comb
from typing import Callable

import torch

from assay.rollout.base import Sampler, SamplingParams
from assay.types import RewardResult, Sample, Trajectory

#: anything that scores a batch: a `Reward`, or a run's `TrainingRewards.scorer(training=False)`
Score = Callable[[list[Trajectory]], list[RewardResult]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `c` correct out of `n` samples (n ≥ k)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class EvalResult:
    n: int
    accuracy: float
    pass_at_k: float | None
    k: int
    mean_length: float
    unscored: int

    def as_dict(self) -> dict:
        return {"n": self.n, "accuracy": self.accuracy, f"pass@{self.k}": self.pass_at_k, "mean_length": self.mean_length, "unscored": self.unscored}


def _correct(score: Score, trajs) -> list[float | None]:
    return [r.score for r in score(trajs)]


def _episodes(trajs: list[Trajectory]) -> list[Trajectory]:
    """One trajectory per episode: a chat episode split into parts (`info["segment"]` of `info["segments"]`,
    `assay.rollout.multiturn`) is its last part, which carries the episode's reward and its final answer.
    Every part counted would weigh a split episode more and shift each later problem's pass@k group."""
    return [t for t in trajs if t.info.get("segment", 0) == t.info.get("segments", 1) - 1]


def evaluate(sampler: Sampler, score: Score, problems: list[Sample], max_new_tokens: int, k: int = 0,
             batch_size: int = 256, seed: int = 0, temperature: float = 1.0) -> EvalResult:
    """Greedy accuracy, mean completion length (tokens) and, when k > 0, pass@k at `temperature`.

    `sampler` is any backend (`assay.rollout.base.Sampler`); `score` any function from
    trajectories to results (a reward, or a run's non-training scorer).
    """
    greedy, lengths, unscored = [], [], 0
    for i in range(0, len(problems), batch_size):
        trajs = _episodes(sampler.generate(problems[i : i + batch_size], 1, SamplingParams(max_new_tokens, temperature=0.0)))
        for t, s in zip(trajs, _correct(score, trajs)):
            lengths.append(len(t.completion_ids))
            if s is None:
                unscored += 1
            else:
                greedy.append(s >= 1.0)
    pk = None
    if k > 0:
        gen = torch.Generator(device="cpu").manual_seed(seed)  # a sampler on a device seeds its own from it
        per_problem = []
        step = max(1, batch_size // k)
        for i in range(0, len(problems), step):
            chunk = problems[i : i + step]
            trajs = _episodes(sampler.generate(chunk, k, SamplingParams(max_new_tokens, temperature=temperature), gen))
            scores = _correct(score, trajs)
            for j in range(len(chunk)):
                group = scores[j * k : (j + 1) * k]
                if any(s is None for s in group):
                    continue
                per_problem.append(pass_at_k(k, sum(s >= 1.0 for s in group), k))
        pk = sum(per_problem) / max(1, len(per_problem))
    return EvalResult(len(problems), sum(greedy) / max(1, len(greedy)), pk, k, sum(lengths) / max(1, len(lengths)), unscored)
