"""Rubrics: a weighted list of criteria, each checked deterministically where it can be and by a judge otherwise.

    reward:
      name: rubric
      args:
        judge: {url: http://127.0.0.1:8000, model: NAME}     # only needed for `check: judge`
        criteria:
          - {name: boxed, check: regex, pattern: '\\\\boxed\\{', gate: true}
          - {name: cites, check: contains, text: [Source:], weight: 0.5}
          - {name: clear, check: judge, question: The answer explains each step., weight: 2}
          - {name: short, check: mypkg.checks:short_enough}

r = Σ_k w_k s_k / Σ_k w_k over the criteria (`normalize: false`: the plain sum), each s_k in
[0, 1]; a gating criterion (`gate: true`) whose s_k falls below its `threshold` (0.5) makes
r = 0 whatever the rest. This is the explicit aggregation of "Rubrics as Rewards:
Reinforcement Learning Beyond Verifiable Domains" (Gunjal et al., 2025, arXiv:2507.17746),
with two changes from the seed catalogue: criteria that a program can check are routed to a
deterministic verifier and only the rest to the judge (RLR^3, "RL with Robust Rubric
Rewards"), and safety-critical criteria gate the reward to zero (HealthCraft's dual-layer
rubric). Every criterion's s_k is a component (`reward/<name>/mean` in metrics).

Checks: `regex` (`pattern`, searched in the completion; `ignore_case`), `contains` (`text`, a
string or a list that must all appear; `ignore_case`), `reward` (a reward block of assay's
own, such as a verifier: `reward: arithmetic`, scored in [0, 1]), `judge` (`question`, asked of the
rubric's `judge`, which answers [[1]] or [[0]] by default, or a rating on its `low`..`high`
scale), or a `module:function` taking the trajectory and returning a bool or a number in
[0, 1] (None: cannot check). `negate: true` turns a check into its complement (1 − s).
Deterministic gates are checked first: a failed one gives 0 without asking the judge. A rubric
with judge criteria is a `batch` reward (the executor hands it whole batches, and the judge
requests of a batch go out together); one without runs like any rule reward, in worker
processes with a deadline per item. A judge criterion the judge cannot score (timeout, HTTP
error, an unparsable reply) leaves the whole sample unscored with that reason, never 0; so
does a check function returning None.

    >>> from assay.types import Sample, Trajectory
    >>> r = Rubric([{"name": "four", "check": "contains", "text": "4", "weight": 3}, {"name": "short", "check": "regex", "pattern": "^.{0,3}$"}])
    >>> res = r.score(Trajectory(Sample("0", "2+2="), "4!!!", [], [], [], True))
    >>> res.score, res.components
    (0.75, {'four': 1.0, 'short': 0.0})
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from assay.errors import AssayError
from assay.registry import load_path
from assay.rewards.base import REWARDS, Reward, score_safely
from assay.rewards.judge import Judge, render, unscored
from assay.types import RewardResult, Trajectory

CHECKS = ("regex", "contains", "judge", "reward")
KEYS = ("name", "weight", "check", "gate", "threshold", "negate", "pattern", "text", "ignore_case", "question", "reward")

RUBRIC_JUDGE = (
    "[Instruction]\nPlease act as an impartial judge. Decide whether the response below to the user question satisfies this "
    "criterion:\n{criterion}\nAfter a short explanation, answer by strictly following this format: \"[[1]]\" if it does, "
    "\"[[0]]\" if it does not.\n\n[Question]\n{prompt}\n\n[The Start of Assistant's Answer]\n{completion}\n[The End of Assistant's Answer]")


@dataclass
class Criterion:
    """One rubric line: its check, weight, and whether it gates the reward."""

    name: str
    check: str
    weight: float = 1.0
    gate: bool = False
    threshold: float = 0.5
    negate: bool = False
    pattern: str | None = None
    text: list[str] | None = None
    ignore_case: bool = False
    question: str | None = None
    reward: Reward | None = None

    @property
    def deterministic(self) -> bool:
        return self.check != "judge"


def criterion(spec: Any, i: int) -> Criterion:
    """A `Criterion` from one entry of `criteria`; ValueError naming the entry and field when it is wrong."""
    where = f"criteria[{i}]"
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: expected a mapping {{name, check, weight, gate, ...}}, got {spec!r}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
    name, check = spec.get("name"), spec.get("check")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name: expected a non-empty string, got {name!r}")
    where = f"criteria[{i}] ({name})"
    if not isinstance(check, str) or (check not in CHECKS and ":" not in check):
        raise ValueError(f"{where}.check: expected one of {', '.join(CHECKS)} or module:function, got {check!r}")
    weight, threshold = spec.get("weight", 1.0), spec.get("threshold", 0.5)
    for key, v in (("weight", weight), ("threshold", threshold)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}.{key}: expected a number >= 0, got {v!r}")
    text = spec.get("text")
    if check == "contains":
        text = [text] if isinstance(text, str) else text
        if not isinstance(text, list) or not text or not all(isinstance(x, str) and x for x in text):
            raise ValueError(f"{where}.text: a contains check needs a string or a list of strings, got {spec.get('text')!r}")
    pattern = spec.get("pattern")
    if check == "regex":
        if not isinstance(pattern, str):
            raise ValueError(f"{where}.pattern: a regex check needs a pattern, got {pattern!r}")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{where}.pattern: {pattern!r} is not a valid regular expression: {e}") from None
    question = spec.get("question")
    if check == "judge" and (not isinstance(question, str) or not question.strip()):
        raise ValueError(f"{where}.question: a judge check needs the criterion as a question or statement, got {question!r}")
    reward = None
    if check == "reward":
        if spec.get("reward") is None:
            raise ValueError(f"{where}.reward: a reward check needs a reward block, for example reward: arithmetic")
        from assay.rewards.spec import build_reward

        try:
            reward = build_reward(spec["reward"])
        except AssayError as e:
            raise ValueError(f"{where}.reward: {e}") from None
    return Criterion(name, check, float(weight), bool(spec.get("gate", False)), float(threshold), bool(spec.get("negate", False)),
                     pattern, text, bool(spec.get("ignore_case", False)), question, reward)


@REWARDS.register("rubric")
class Rubric(Reward):
    """Weighted rubric criteria with gates; deterministic checks where possible, a judge for the rest (module docstring).

    Args:
        criteria: the rubric, a list of `{name, check, weight, gate, threshold, negate, ...}`.
        judge: the `judge` reward's arguments (url, model, api, timeout, ...) for `check: judge`
            criteria; its `template` must hold `{criterion}` (default: a yes/no question answered [[1]]/[[0]], low 0, high 1).
        normalize: divide the weighted sum by the sum of the weights.
    """

    verdict = False  # a weighted sum of criteria, not right/wrong
    example_args = {"criteria": [{"name": "digit", "check": "regex", "pattern": r"\d", "gate": True},
                                 {"name": "boxed", "check": "contains", "text": "\\boxed", "weight": 2}]}

    def __init__(self, criteria: list[dict[str, Any]], judge: dict[str, Any] | None = None, normalize: bool = True):
        if not isinstance(criteria, list) or not criteria:
            raise ValueError(f"criteria must be a non-empty list of criteria, got {criteria!r}")
        self.criteria = [criterion(c, i) for i, c in enumerate(criteria)]
        names = [c.name for c in self.criteria]
        if len(set(names)) != len(names):
            raise ValueError(f"criterion names must be unique, got {names}")
        if normalize and sum(c.weight for c in self.criteria) <= 0:
            raise ValueError("with normalize, the weights must not all be 0")
        self.normalize = bool(normalize)
        self._checks = {c.name: None for c in self.criteria if c.check not in CHECKS}  # module:function, loaded on first use
        self._judge: Judge | None = None
        if any(c.check == "judge" for c in self.criteria):
            if not isinstance(judge, dict) or "url" not in judge:
                raise ValueError("criteria with check: judge need judge: {url, model, ...} (the judge reward's arguments)")
            args = {"low": 0.0, "high": 1.0, **judge, "mode": "pointwise"}
            template = args.pop("template", RUBRIC_JUDGE)
            if not isinstance(template, str) or "{criterion}" not in template:
                raise ValueError(f"judge.template must contain {{criterion}}, got {template!r}")
            try:
                self._judge = Judge(**args)
            except TypeError as e:
                raise ValueError(f"judge: {e}") from None
            self._judge.template = template  # a rubric's judge template needs {criterion}, not {completion}
        self.judge = dict(judge or {})
        # with a judge it sees the batch whole (one round of concurrent requests); without one it runs like any
        # rule reward, in worker processes with a deadline per item
        kinds = {"batch" if c.check == "judge" else c.reward.kind if c.reward is not None else "cpu" for c in self.criteria}
        self.kind = "batch" if "batch" in kinds else "io" if "io" in kinds else "cpu"

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_checks": dict.fromkeys(self._checks)}  # loaded functions are imported again

    def hparams(self) -> dict[str, Any]:
        criteria = [{k: (type(v).__name__ if isinstance(v, Reward) else v) for k, v in vars(c).items() if v is not None} for c in self.criteria]
        return {"criteria": criteria, "judge": self.judge, "normalize": self.normalize, "kind": self.kind}

    # ---------------------------------------------------------------- scoring

    def score(self, traj: Trajectory) -> RewardResult:
        return self([traj])[0]

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        scores: list[dict[str, float]] = [{} for _ in batch]
        done: dict[int, RewardResult] = {}
        for i, t in enumerate(batch):
            for c in self.criteria:
                if c.deterministic:
                    s = self._check(c, t)
                    if isinstance(s, RewardResult):
                        done[i] = s
                        break
                    scores[i][c.name] = s
        todo = [(i, c) for i in range(len(batch)) if i not in done and not self._gated(scores[i])
                for c in self.criteria if not c.deterministic]
        if todo:
            assert self._judge is not None
            prompts = [self._judge.ask_form(batch[i], render(self._judge.template, **self._judge.values(batch[i]), completion=batch[i].completion,
                                                             criterion=c.question))
                       for i, c in todo]
            for (i, c), r in zip(todo, self._judge.rate(prompts)):
                if i in done:
                    continue
                if r.score is None:
                    done[i] = RewardResult(None, components=dict(scores[i]), info={**r.info, "criterion": c.name},
                                           error=f"criterion {c.name}: {r.error}")
                else:
                    scores[i][c.name] = 1.0 - r.score if c.negate else r.score
        return [done[i] if i in done else self._total(scores[i]) for i in range(len(batch))]

    def _gated(self, s: dict[str, float]) -> bool:
        return any(c.gate and c.name in s and s[c.name] < c.threshold for c in self.criteria)

    def _total(self, s: dict[str, float]) -> RewardResult:
        failed = [c.name for c in self.criteria if c.gate and c.name in s and s[c.name] < c.threshold]
        if failed:
            return RewardResult(0.0, components=s, info={"reason": "gate", "gate": failed})
        total = sum(c.weight * s[c.name] for c in self.criteria)
        weights = sum(c.weight for c in self.criteria)
        return RewardResult(total / weights if self.normalize else total, components=s)

    def _check(self, c: Criterion, t: Trajectory) -> float | RewardResult:
        """A deterministic criterion's score in [0, 1], or the result to return when it cannot be checked."""
        text = t.completion
        if c.check == "regex":
            s = float(re.search(c.pattern or "", text, re.IGNORECASE if c.ignore_case else 0) is not None)
        elif c.check == "contains":
            hay = text.lower() if c.ignore_case else text
            s = float(all((x.lower() if c.ignore_case else x) in hay for x in c.text or []))
        elif c.check == "reward":  # a verifier of assay's own, scored here, in this process
            r = score_safely(c.reward, t)
            if r.error is not None or r.score is None:
                reason = r.info.get("reason") or ("raised" if r.error is not None else "criterion_none")
                return RewardResult(None, info={"reason": reason, "criterion": c.name}, error=f"criterion {c.name}: {r.error or 'unscored'}")
            if not 0.0 <= r.score <= 1.0:
                return RewardResult.failed(f"criterion {c.name}: the reward gave {r.score!r}, not a score in [0, 1]", score=None, reason="raised")
            s = float(r.score)
        else:
            try:
                value = self._function(c)(t)
            except AssayError as e:
                return RewardResult.failed(f"criterion {c.name}: {e}", score=None, reason="raised")
            except Exception as e:  # the user's check raised: this item fails, the batch goes on
                return RewardResult.failed(f"criterion {c.name}: {type(e).__name__}: {e}", score=None, reason="raised")
            if value is None:
                return unscored("criterion_none", f"criterion {c.name}: the check could not score this sample", criterion=c.name)
            if isinstance(value, bool):
                value = float(value)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                return RewardResult.failed(f"criterion {c.name}: the check returned {value!r}, not a bool or a number in [0, 1]",
                                           score=None, reason="raised")
            s = float(value)
        return 1.0 - s if c.negate else s

    def _function(self, c: Criterion) -> Any:
        fn = self._checks.get(c.name)
        if fn is None:
            fn = self._checks[c.name] = load_path(c.check, "rubric check")
            if not callable(fn):
                raise AssayError(f"rubric check {c.check!r} is not callable")
        return fn
