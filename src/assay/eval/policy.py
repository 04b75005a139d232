"""Policy evaluation on a task's held-out split: greedy accuracy, pass@k, length, and a learned reward's mean.

Accuracy counts a verifier's verdicts (score ≥ 1 is right). A reward whose scores are not
verdicts (a reward model, a judge: `assay.rewards.base.gives_verdicts`) is reported as the
mean score of the greedy completions (`mean_reward`), beside the verifier's accuracy when
there is one, never as an accuracy.

pass@k uses the unbiased estimator of Chen et al., "Evaluating Large Language Models
Trained on Code" (2021), arXiv:2107.03374: with n samples of which c are correct,
pass@k = 1 − C(n−c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

import math
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
    accuracy: float | None
    pass_at_k: float | None
    k: int
    mean_length: float
    unscored: int
    mean_reward: float | None = None
    sampled: float | None = None
    """When k > 0: the share of the k samples at `temperature` the verifier accepts (pass@1 estimated from k samples)."""

    def as_dict(self) -> dict:
        """`{n, accuracy, pass@k, sampled_accuracy, mean_reward, mean_length, unscored}`: accuracy and pass@k when a
        verifier scored, pass@k and sampled_accuracy when k > 0, mean_reward when a learned reward did."""
        out: dict = {"n": self.n}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
            if self.k > 0:
                out[f"pass@{self.k}"] = self.pass_at_k
                if self.sampled is not None:
                    out["sampled_accuracy"] = self.sampled
        if self.mean_reward is not None:
            out["mean_reward"] = self.mean_reward
        return {**out, "mean_length": self.mean_length, "unscored": self.unscored}


def _correct(score: Score, trajs) -> list[float | None]:
    return [r.score for r in score(trajs)]


def _episodes(trajs: list[Trajectory]) -> list[Trajectory]:
    """One trajectory per episode: a chat episode split into parts (`info["segment"]` of `info["segments"]`,
    `assay.rollout.multiturn`) is its last part, which carries the episode's reward and its final answer.
    Every part counted would weigh a split episode more and shift each later problem's pass@k group."""
    return [t for t in trajs if t.info.get("segment", 0) == t.info.get("segments", 1) - 1]


def evaluate(sampler: Sampler, score: Score | None, problems: list[Sample], max_new_tokens: int, k: int = 0,
             batch_size: int = 256, seed: int = 0, temperature: float = 1.0, reward: Score | None = None, top_p: float = 1.0) -> EvalResult:
    """Greedy accuracy, mean completion length (tokens) and, when k > 0, pass@k and the sampled accuracy (the share of
    all k samples that are right) at `temperature`, drawn from a generator seeded by `seed` (the same draws for the
    same policy, so two evaluations of a run differ by what the policy learned, not by the dice), with nucleus
    sampling at `top_p` as training samples. The sampled accuracy counts every scored sample; pass@k only the problems
    whose k samples were all scored.

    `sampler` is any backend (`assay.rollout.base.Sampler`); `score` the verifier, any function
    from trajectories to results whose scores are verdicts (a reward, or a run's non-training
    scorer); `reward`, a learned reward that scores the same greedy completions for
    `mean_reward`. Without `score` there is no accuracy, and no pass@k. `unscored` counts the
    greedy completions the verifier (else the reward) could not score.
    """
    greedy, lengths, unscored, rewards = [], [], 0, []
    for i in range(0, len(problems), batch_size):
        trajs = _episodes(sampler.generate(problems[i : i + batch_size], 1, SamplingParams(max_new_tokens, temperature=0.0)))
        lengths += [len(t.completion_ids) for t in trajs]
        learned = _correct(reward, trajs) if reward is not None else []
        rewards += [s for s in learned if s is not None]
        checked = _correct(score, trajs) if score is not None else learned
        unscored += sum(s is None for s in checked)
        greedy += [s >= 1.0 for s in checked if s is not None] if score is not None else []
    mean_reward = sum(rewards) / len(rewards) if rewards else (math.nan if reward is not None else None)
    if score is None:
        return EvalResult(len(problems), None, None, k, sum(lengths) / max(1, len(lengths)), unscored, mean_reward)
    pk = sampled = None
    if k > 0:
        gen = torch.Generator(device="cpu").manual_seed(seed)  # a sampler on a device seeds its own from it
        per_problem, right, drawn = [], 0, 0
        step = max(1, batch_size // k)
        for i in range(0, len(problems), step):
            chunk = problems[i : i + step]
            trajs = _episodes(sampler.generate(chunk, k, SamplingParams(max_new_tokens, temperature=temperature, top_p=top_p), gen))
            scores = _correct(score, trajs)
            for j in range(len(chunk)):
                group = scores[j * k : (j + 1) * k]
                scored = [s >= 1.0 for s in group if s is not None]
                right, drawn = right + sum(scored), drawn + len(scored)
                if len(scored) == k:
                    per_problem.append(pass_at_k(k, sum(scored), k))
        pk = sum(per_problem) / max(1, len(per_problem))
        sampled = right / drawn if drawn else None  # nothing scored: no figure, not a 0 a monitor would read as a fall
    return EvalResult(len(problems), sum(greedy) / max(1, len(greedy)), pk, k, sum(lengths) / max(1, len(lengths)), unscored, mean_reward,
                      sampled)
