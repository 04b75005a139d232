"""Self-rewarding: the policy judges its own samples through the judge/rubric interface, with a verified canary.

After Yuan et al., "Self-Rewarding Language Models" (2024), arXiv:2401.10020: the model being
trained is also the judge of its own completions (LLM-as-a-judge prompting), and each round's
preference pairs come from its own judgement. In assay the judge is the ordinary `judge`
reward, or a `rubric` with judge criteria (docs/reward-models.md), pointed at the policy itself:

    reward: {name: judge, args: {url: "local://policy", api: completions, template: "...", low: 0, high: 10}}

`assay train` serves its live policy in the process as `local://policy` (`serving_policy`): every
judge request is answered by the weights being trained at that moment, through the same code
as `assay serve model` (`assay.rollout.serve_model.ModelService`), with no HTTP and no cache.
An `assay serve model` process serving a checkpoint is the other way, for a frozen judge.

A self-judge can drift: nothing anchors what the policy prefers to what is right. The canary
is the task's verifier, which scores the same completions beside the judge without training
on them (`canary/*` metrics, and a warning when the verifier disagrees with the judge's choice
of most pairs; `CanaryGates`).
"""

from __future__ import annotations

import contextlib
import io
import threading
import urllib.error
from typing import Any, Iterator

from assay.jsonhttp import BadRequest
from assay.models import context_length
from assay.rewards.judge_client import LOCAL
from assay.rollout.serve_model import ModelService
from assay.training.health import HealthGates

#: pairs the verifier must be able to compare before a disagreement warns
CANARY_MIN_PAIRS = 4


class LivePolicy(ModelService):
    """`ModelService` over a model object held elsewhere (the trainer's policy), called in-process.

    Args:
        model, tokenizer: the live policy; its weights are read at each request.
        name: the model id requests may name. max_new_tokens: the most tokens one reply may have.
    """

    def __init__(self, model, tokenizer, name: str = "policy", max_new_tokens: int = 256):  # noqa: D107 (no loading: the model is given)
        self.model, self.tokenizer, self.name, self.max_new_tokens = model, tokenizer, name, max_new_tokens
        self.device = next(model.parameters()).device
        self.context = context_length(model) or 0
        self.requests = 0
        self._lock = threading.Lock()

    def __call__(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        """The reply body to `body` at `route`, as the server would send it (a bad request: HTTP 400, as the server)."""
        try:
            return self.post(route, body)
        except BadRequest as e:
            raise urllib.error.HTTPError(route, e.status, str(e), None, io.BytesIO(str(e).encode())) from None  # type: ignore[arg-type]


@contextlib.contextmanager
def serving_policy(model, tokenizer, name: str = "policy") -> Iterator[LivePolicy]:
    """Serve `model` in this process as `local://NAME` while the block runs."""
    live = LivePolicy(model, tokenizer, name)
    previous = LOCAL.get(name)
    LOCAL[name] = live
    try:
        yield live
    finally:
        if previous is None:
            LOCAL.pop(name, None)
        else:
            LOCAL[name] = previous


def canary_metrics(verified: dict[int, float | None], trajs, pairs: list[tuple[Any, Any]] | None = None,
                   kept: list[Any] | None = None) -> dict[str, float]:
    """`canary/*` from the verifier's scores (`verified`: id(trajectory) → score) of the step's completions.

    `canary/accuracy`: share of scored completions the verifier accepts (score ≥ 1). With `pairs`
    (chosen, rejected trajectories): `canary/chosen_accuracy`, the share of chosen responses it
    accepts, and `canary/pair_agreement`, over the pairs it scores differently, the share where it
    scores the chosen one higher (`canary/pairs_compared` of them). With `kept` (RAFT's completions):
    `canary/kept_accuracy`.
    """
    ok = [s >= 1.0 for t in trajs if (s := verified.get(id(t))) is not None]
    out = {"canary/accuracy": sum(ok) / len(ok)} if ok else {}
    if pairs:
        chosen = [s >= 1.0 for c, _ in pairs if (s := verified.get(id(c))) is not None]
        if chosen:
            out["canary/chosen_accuracy"] = sum(chosen) / len(chosen)
        cmp = [(a, b) for c, r in pairs if (a := verified.get(id(c))) is not None and (b := verified.get(id(r))) is not None and a != b]
        out["canary/pairs_compared"] = float(len(cmp))
        if cmp:
            out["canary/pair_agreement"] = sum(a > b for a, b in cmp) / len(cmp)
    if kept:
        k = [s >= 1.0 for t in kept if (s := verified.get(id(t))) is not None]
        if k:
            out["canary/kept_accuracy"] = sum(k) / len(k)
    return out


class CanaryGates(HealthGates):
    """The run's health gates, plus a warning when the reward drifts from the verifier (the canary).

    The step drifts when the verifier agrees with the reward's choice on fewer than `floor` of the
    pairs it can compare (at least `CANARY_MIN_PAIRS` of them), or when the share of the step's
    completions it accepts has fallen below half the best share seen so far (a policy that learned
    what the reward pays for and forgot the answers: then few pairs are left to compare). The
    warning comes on the first drifting step and every tenth of an unbroken run of them.
    """

    floor: float = 0.5
    best_accuracy: float = 0.0
    drift_streak: int = 0

    @classmethod
    def around(cls, gates: HealthGates, floor: float) -> "CanaryGates":
        """These gates, with their state (a resumed run's streaks), as `CanaryGates`."""
        out = cls.__new__(cls)
        out.__dict__.update(gates.__dict__)
        out.floor, out.best_accuracy, out.drift_streak = floor, 0.0, 0
        return out

    def _drift(self, metrics: dict[str, float]) -> str | None:
        agree, n = metrics.get("canary/pair_agreement"), metrics.get("canary/pairs_compared", 0.0)
        acc = metrics.get("canary/accuracy")
        if acc is not None:
            self.best_accuracy = max(self.best_accuracy, acc)
        if agree is not None and n >= CANARY_MIN_PAIRS and agree < self.floor:
            return f"the verifier (canary) agrees with the reward's choice on only {agree:.0%} of the {int(n)} pairs it could compare"
        if acc is not None and self.best_accuracy >= 0.2 and acc < self.best_accuracy / 2:
            return f"the verifier (canary) accepts {acc:.0%} of this step's completions, down from {self.best_accuracy:.0%}"
        return None

    def check(self, step: int, metrics: dict[str, float], trajs, results) -> str | None:
        warning = super().check(step, metrics, trajs, results)
        drift = self._drift(metrics)
        self.drift_streak = self.drift_streak + 1 if drift else 0
        if drift is None or (self.drift_streak > 1 and self.drift_streak % 10):
            return warning
        drift += ": the reward is drifting from verified answers"
        self.warnings.append((step, drift))
        return f"{warning}; {drift}" if warning else drift

    def state_dict(self) -> dict:
        return {**super().state_dict(), "canary_best_accuracy": self.best_accuracy, "canary_drift_streak": self.drift_streak}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.best_accuracy = state.get("canary_best_accuracy", 0.0)
        self.drift_streak = state.get("canary_drift_streak", 0)
