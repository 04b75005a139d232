"""Plain data types that flow between the parts of assay.

Each arrow in the design's data-flow diagram is one of these: prompts become
`Sample`s, the rollout turns them into `Trajectory`s, rewards return one
`RewardResult` per trajectory. Nothing here imports torch: token ids and logprobs
are plain lists so the types pickle cheaply into reward worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One prompt with the dataset fields a reward may ask for.

    Attributes:
        id: stable identifier of the prompt (unique within its split).
        prompt: the text given to the policy, or a conversation: a list of `{"role", "content"}`
            messages, rendered with the tokenizer's chat template (generation prompt added).
        answer: the reference answer (may be None for tasks without one).
        fields: any other dataset columns, by name (for example `nums`, `target`, `tests`).
        prompt_ids: the exact token ids to give the policy, when they are already known (a
            multi-turn episode's next turn); None: the sampler encodes `prompt`
            (`assay.rollout.base.encode_prompt`).
        template_args: keyword arguments of the chat template for a conversational prompt
            (`{"enable_thinking": False}`), from `data.chat_template_kwargs` and the row's own
            `chat_template_kwargs` column.
        vision: with `prompt_ids`, the processor's outputs (numpy arrays) for the pictures whose image tokens
            those ids hold: a multi-turn episode's next turn after an environment showed a picture
            (`assay.rollout.multiturn`); None: the ids hold no pictures.
    """

    id: str
    prompt: str | list[dict[str, Any]]
    answer: Any = None
    fields: dict[str, Any] = field(default_factory=dict)
    prompt_ids: list[int] | None = None
    template_args: dict[str, Any] | None = None
    vision: dict[str, Any] | None = None

    @property
    def conversational(self) -> bool:
        """True when the prompt is a list of chat messages."""
        return isinstance(self.prompt, list)


@dataclass
class Trajectory:
    """One sampled completion of a prompt: exactly the tokens the model saw and produced.

    `prompt_ids + completion_ids` is the whole token sequence, never re-tokenised. In a
    single-turn rollout every completion token was sampled; in a multi-turn episode the
    completion also holds what an environment or tool said between the model's turns, and
    `loss_mask` is 0 on those tokens so they never enter the loss.

    Attributes:
        sample: the prompt it answers.
        completion: decoded completion text (special tokens removed).
        prompt_ids: prompt token ids `[P]`.
        completion_ids: every token after the prompt `[T]`, including a final EOS when one was sampled.
        logprobs: the sampler's logprob of each completion token under the sampling
            temperature `[T]` (0.0 on tokens the model did not sample).
        finished: True when generation stopped on EOS (or the episode ended) rather than on a length limit.
        group: index of the group (prompt) within the batch.
        loss_mask: 1 on tokens the model sampled, 0 on tokens it was shown `[T]`; None: all sampled.
        turns: `(start, end)` token spans of the model's turns in `completion_ids`; None: one turn.
        version: the policy version (optimizer steps taken) of the weights that sampled it.
        finish_reason: why generation stopped: `stop` (EOS), `length` (token limit) or a
            backend's or environment's own reason; by default derived from `finished`.
        info: what made it besides the tokens: for an episode of an environment, its reward,
            per-turn rewards and progress, the index of its first turn and tool calls
            (`assay.rollout.multiturn`); empty otherwise.
    """

    sample: Sample
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool
    group: int = 0
    loss_mask: list[int] | None = None
    turns: list[tuple[int, int]] | None = None
    version: int = 0
    finish_reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.finish_reason:
            self.finish_reason = "stop" if self.finished else "length"

    @property
    def conversation(self) -> list[dict[str, Any]] | None:
        """For a conversational prompt, the whole conversation: its messages and this completion as the
        assistant's reply (appended to a final assistant message the prompt began); None for a plain-text prompt."""
        msgs = self.sample.prompt
        if not isinstance(msgs, list):
            return None
        if msgs and msgs[-1].get("role") == "assistant":
            return [*msgs[:-1], {**msgs[-1], "content": str(msgs[-1].get("content", "")) + self.completion}]
        return [*msgs, {"role": "assistant", "content": self.completion}]

    @property
    def sampled_tokens(self) -> int:
        """How many completion tokens the model itself sampled (the rest it was shown)."""
        return len(self.completion_ids) if self.loss_mask is None else int(sum(self.loss_mask))


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
