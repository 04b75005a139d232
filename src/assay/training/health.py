"""Health gates: a run that cannot learn says so, instead of reporting success.

Three conditions are watched after every step:

- **Nothing could be scored.** When no completion of a step got a score (every reward
  `None` or failed) for `train.stop_unscored_steps` steps in a row, the run stops with one
  line: how many completions were unscored, the commonest reasons, and one example.
- **No learning signal.** When at least `train.zero_var_warn` of a step's groups have
  all-equal rewards (GRPO's advantage is then 0 for all of them) for
  `train.zero_var_steps` steps in a row, a warning goes to the progress bar, to that step's
  row of `metrics.jsonl` (`"warning"`) and to the report, with a hint that depends on
  whether the groups all fail (too hard, or a broken reward) or all succeed (nothing left
  to learn).
- **Cut-off completions.** In a run on a data file (`max_new_tokens` given), the first step
  in which at least `TRUNCATED_WARN` of the completions stopped at `rollout.max_new_tokens`
  (finish reason `length`) rather than at EOS warns once, the same three ways: the default
  limit (6 tokens) fits the bundled tasks' answers, not a user's data, whose answers then
  never get written.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from assay.data.selection import scored_rewards
from assay.errors import AssayError
from assay.training.hacking import repetition
from assay.types import RewardResult, Trajectory
from assay.vision.inputs import jsonable

__all__ = ["HealthGates", "RunCannotLearn", "log_samples", "rollout_metrics", "sample_rows"]


#: the share of a step's completions cut off at the length limit from which the run warns (once)
TRUNCATED_WARN = 0.5


class RunCannotLearn(AssayError):
    """The run stopped because no reward could be scored for several steps."""


@dataclass
class HealthGates:
    """Streak counters across steps. `check` returns a warning when one is due; `stop` is set
    (to the one-line reason) when the run must end."""

    stop_unscored_steps: int = 3
    zero_var_warn: float = 0.9
    zero_var_steps: int = 10
    max_new_tokens: int | None = None
    unscored_streak: int = 0
    zero_var_streak: int = 0
    truncated_warned: bool = False
    warnings: list[tuple[int, str]] = field(default_factory=list)
    stop: str | None = None

    def check(self, step: int, metrics: dict[str, float], trajs: list[Trajectory], results: list[RewardResult]) -> str | None:
        """Update the streaks with one step; a warning for this step, if one is due."""
        scored = [r for r in results if r.score is not None and r.error is None]
        self.unscored_streak = 0 if scored else self.unscored_streak + 1
        if self.stop_unscored_steps and self.unscored_streak >= self.stop_unscored_steps:
            self.stop = unscored_message(self.unscored_streak, trajs, results)
        due = [w for w in (self._truncated(trajs), self._zero_var(metrics)) if w]
        if not due:
            return None
        warning = "; ".join(due)
        self.warnings.append((step, warning))
        return warning

    def _truncated(self, trajs: list[Trajectory]) -> str | None:
        cut = sum(t.finish_reason == "length" for t in trajs)
        if self.max_new_tokens is None or self.truncated_warned or not trajs or cut / len(trajs) < TRUNCATED_WARN:
            return None
        self.truncated_warned = True
        return (f"{cut} of {len(trajs)} completions stopped at rollout.max_new_tokens={self.max_new_tokens} before EOS: their "
                "answers are cut off; raise rollout.max_new_tokens to fit this data's answers (the default, 6, fits the bundled tasks)")

    def _zero_var(self, metrics: dict[str, float]) -> str | None:
        zero_var = metrics.get("reward/zero_var_group_frac")
        high = zero_var is not None and zero_var == zero_var and zero_var >= self.zero_var_warn
        self.zero_var_streak = self.zero_var_streak + 1 if high else 0
        if not self.zero_var_steps or self.zero_var_streak == 0 or self.zero_var_streak % self.zero_var_steps:
            return None
        return zero_var_message(self.zero_var_streak, metrics)

    def state_dict(self) -> dict:
        return {"unscored_streak": self.unscored_streak, "zero_var_streak": self.zero_var_streak, "warnings": list(self.warnings),
                "truncated_warned": self.truncated_warned}

    def load_state_dict(self, state: dict) -> None:
        self.unscored_streak, self.zero_var_streak = state["unscored_streak"], state["zero_var_streak"]
        self.warnings = [tuple(w) for w in state["warnings"]]
        self.truncated_warned = state.get("truncated_warned", False)  # checkpoints written before the warning existed


def unscored_message(steps: int, trajs: list[Trajectory], results: list[RewardResult]) -> str:
    reasons = Counter(str(r.info.get("reason") or r.error or "no score") for r in results)
    top = ", ".join(f"{reason} ×{n}" for reason, n in reasons.most_common(3))
    example = ""
    if trajs:
        t, r = trajs[0], results[0]
        why = r.info.get("reason") or r.error or "no score"
        example = f"; example: prompt {_clip(t.sample.prompt)} → completion {_clip(t.completion)} ({why})"
    return (f"no reward could be scored for {steps} steps in a row: the last step's {len(results)} of {len(results)} completions "
            f"were unscored ({top}){example}; check that the reward fits the task and the completions "
            "(train.stop_unscored_steps=0 keeps going)")


def zero_var_message(steps: int, metrics: dict[str, float]) -> str:
    frac = metrics.get("reward/zero_var_group_frac", 0.0)
    unsolved = metrics.get("reward/unsolved_group_frac", 0.0) or 0.0
    saturated = metrics.get("reward/saturated_group_frac", 0.0) or 0.0
    if unsolved >= saturated:
        hint = ("almost every group fails: raise rollout.group_size, check the reward, and check the task's difficulty for "
                "this model with assay eval --k 8 (a pass@8 near 0 leaves nothing to learn from)")
    else:
        hint = "almost every group succeeds: little is left to learn from these prompts (harder data, or selection.dynamic=true)"
    return f"{frac:.0%} of groups had all-equal rewards (no learning signal) for {steps} steps in a row; {hint}"


def _clip(text: object, n: int = 60) -> str:
    s = str(text)
    return repr(s if len(s) <= n else s[: n - 1] + "…")


def folded(text: str) -> str:
    """`text` with each run of four or more copies of one special token written once with its count (`<image>×36`)."""
    return re.sub(r"(<[^<>\s]{1,40}>)\1{3,}", lambda m: f"{m.group(1)}×{len(m.group(0)) // len(m.group(1))}", text)


def rollout_metrics(trajs, results, verdicts: bool = True) -> dict[str, float]:
    """Sampled accuracy (when the reward's scores are verdicts) and completion lengths of every generated completion
    (reward statistics come from `reward_health`)."""
    scored = scored_rewards([r.score for r in results])
    lengths = [len(t.completion_ids) for t in trajs]
    accuracy = {"train/accuracy": sum(x >= 1.0 for x in scored) / len(scored) if scored else math.nan} if verdicts else {}
    return {
        **accuracy,
        "rollout/response_length": sum(lengths) / len(lengths),
        "rollout/truncated_frac": sum(not t.finished for t in trajs) / len(trajs),
        "rollout/repetition": sum(repetition(t.completion_ids) for t in trajs) / len(trajs),
    }


def log_samples(log, step: int, trajs: list[Trajectory], results: list[RewardResult], train, tokenizer, note) -> None:
    """At step 1 and every `train.samples_every` steps, a few prompts with their completions to `log` (`samples.jsonl`),
    and the first completion to `note` (the console) with `train.show_samples`."""
    every = train.samples_every
    if not every or (step != 1 and step % every):
        return
    rows = sample_rows(trajs, results, train.samples_n, tokenizer=tokenizer)
    for row in rows:
        log.log(step, row)
    if train.show_samples and rows and rows[0]["completions"]:
        c = rows[0]["completions"][0]
        note(f"step {step}: {rows[0].get('prompt_text', rows[0]['prompt'])!r} → {c['text']!r} reward {c['reward']} ({c['reason'] or 'ok'})")


def sample_rows(trajs: list[Trajectory], results: list[RewardResult], prompts: int, per_prompt: int = 4, tokenizer=None) -> list[dict]:
    """A few prompts of a step with their completions, rewards and reasons (rows of `samples.jsonl`).

    A conversation's row also has `prompt_text`: what the model saw, its prompt token ids decoded
    with `tokenizer` (the chat template's rendering, special tokens included).
    """
    rows: list[dict] = []
    by_group: dict[int, list[tuple[Trajectory, RewardResult]]] = {}
    for t, r in zip(trajs, results):
        by_group.setdefault(t.group, []).append((t, r))
    for g in sorted(by_group)[:prompts]:
        items = by_group[g]
        s = items[0][0].sample
        rendered = {"prompt_text": folded(tokenizer.decode(items[0][0].prompt_ids))} if tokenizer is not None and not isinstance(s.prompt, str) else {}
        rows.append({
            "id": s.id, "prompt": jsonable(s.prompt), **rendered,
            "answer": s.answer if isinstance(s.answer, (str, int, float, type(None))) else str(s.answer),
            "completions": [{"text": t.completion, "reward": r.score, "reason": r.info.get("reason"), "error": r.error,
                             "extracted": r.info.get("extracted", r.info.get("answer"))} for t, r in items[:per_prompt]],
        })
    return rows
