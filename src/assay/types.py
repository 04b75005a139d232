"""Plain data types that flow between the parts of assay.

Each arrow in the design's data-flow diagram is one of these: prompts become
`Sample`s, the rollout turns them into `Trajectory`s, rewards return one
`RewardResult` per trajectory, and the trainer works on `Group`s. Nothing here
imports torch: token ids and logprobs are plain lists so the types pickle cheaply
into reward worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt with the dataset fields a reward may ask for.

    Attributes:
        id: stable identifier of the prompt (unique within its split).
        prompt: the text given to the policy.
        answer: the reference answer (may be None for tasks without one).
        fields: any other dataset columns, by name (for example `nums`, `target`, `tests`).
    """

    id: str
    prompt: str
    answer: Any = None
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One sampled completion of a prompt, with the sampler's own numbers.

    Attributes:
        sample: the prompt it answers.
        completion: decoded completion text (special tokens removed).
        prompt_ids: prompt token ids `[P]`.
        completion_ids: generated token ids `[T]`, including a final EOS when one was sampled.
        logprobs: the sampler's logprob of each generated token `[T]`.
        finished: True when the sampler stopped on EOS rather than on the length limit.
        group: index of the group (prompt) within the batch.
    """

    sample: Sample
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool
    group: int = 0


@dataclass
class RewardResult:
    """What a reward says about one trajectory.

    Attributes:
        score: the reward, or None when the sample cannot be scored (for example an
            unparseable reference answer). None is left out of baselines and counted.
        components: named partial scores that stay visible in metrics.
        steps: optional per-step scores, one per span.
        spans: optional `(start, end)` character spans of the completion, one per step.
        info: why the score is what it is: extracted answer, reason for a 0, timings.
        error: set when the reward failed (raised, timed out, crashed its worker).
    """

    score: float | None
    components: dict[str, float] = field(default_factory=dict)
    steps: list[float] | None = None
    spans: list[tuple[int, int]] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @classmethod
    def failed(cls, error: str, score: float | None = 0.0, **info: Any) -> "RewardResult":
        """A result for a reward that could not run on this sample."""
        return cls(score=score, info=dict(info), error=error)


@dataclass
class Group:
    """The G trajectories sampled for one prompt, with their rewards."""

    sample: Sample
    trajectories: list[Trajectory]
    results: list[RewardResult]

    @property
    def scores(self) -> list[float | None]:
        return [r.score for r in self.results]
