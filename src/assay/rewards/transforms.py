"""Composition and transforms: named methods are chains of small pieces (optax-style).

Compositions are `Reward`s built from other rewards, each child's score kept under its
name in `components`: `weighted`, `gate`, `tiers`, `minimum`, `pessimistic`, `par`.
Transforms map one `RewardResult` to another (`clip`, `scale`, `overlong_penalty`,
`length_norm`, `step_clip`, `step_delta`, `step_cap`); `Chain(reward, [t1, t2])` applies
them in order, like `optax.chain`. Every piece reports its hyperparameters via
`hparams()` for logging.

Failure rule: a child that fails (its `error` is set) fails the composition with the
child's name in the error; a child that returns None makes the composition None.

    >>> from assay.rewards.text import RegexMatch
    >>> from assay.types import Sample, Trajectory
    >>> r = Chain(Weighted({"a": RegexMatch("a"), "b": RegexMatch("b")}, {"a": 1.0, "b": 0.5}), [Clip(high=1.2)])
    >>> res = r.score(Trajectory(Sample("0", ""), "ab", [], [], [], True))
    >>> res.score, res.components
    (1.2, {'a': 1.0, 'b': 1.0})
"""

from __future__ import annotations

import math
from typing import Any

from assay.registry import Registry
from assay.rewards.base import REWARDS, Reward, score_safely
from assay.rewards.text import completion_length
from assay.types import RewardResult, Trajectory

# ------------------------------------------------------------------------------ transforms


class Transform:
    """A named, picklable map `(RewardResult, Trajectory) -> RewardResult`."""

    name = "transform"

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        raise NotImplementedError

    def hparams(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}


TRANSFORMS: Registry[type[Transform]] = Registry("reward transform")


def _register(name: str):
    def deco(cls):
        cls.name = name
        return TRANSFORMS.register(name)(cls)

    return deco


@_register("clip")
class Clip(Transform):
    """r' = min(max(r, low), high); either bound may be None."""

    def __init__(self, low: float | None = None, high: float | None = None):
        if low is not None and high is not None and low > high:
            raise ValueError(f"clip: low {low} > high {high}")
        self.low, self.high = low, high

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        s = r.score
        if self.low is not None:
            s = max(s, self.low)
        if self.high is not None:
            s = min(s, self.high)
        r.score = s
        return r


@_register("scale")
class Scale(Transform):
    """r' = factor · r + shift."""

    def __init__(self, factor: float = 1.0, shift: float = 0.0):
        self.factor, self.shift = factor, shift

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        r.score = self.factor * r.score + self.shift
        return r


def overlong_penalty(length: int, max_len: int, cache: int) -> float:
    """DAPO's soft overlong penalty for a response of `length` (Yu et al. 2025, eq. 13).

    R = 0 if L ≤ L_max − L_cache; ((L_max − L_cache) − L) / L_cache if L_max − L_cache < L ≤ L_max; −1 beyond.
    """
    edge = max_len - cache
    if length <= edge:
        return 0.0
    if length <= max_len:
        return (edge - length) / cache
    return -1.0


@_register("overlong_penalty")
class OverlongPenalty(Transform):
    """r' = r + weight · R_overlong(|y|): DAPO's soft overlong punishment.

    DAPO: An Open-Source LLM Reinforcement Learning System at Scale (Yu et al., 2025,
    arXiv:2503.14476), "Overlong Reward Shaping". `unit` is tokens (falling back to
    characters when the trajectory carries no token ids), words or chars. The penalty is
    kept as component `overlong`.
    """

    def __init__(self, max_len: int, cache: int, weight: float = 1.0, unit: str = "tokens"):
        if not 0 < cache <= max_len:
            raise ValueError(f"overlong_penalty: need 0 < cache <= max_len, got cache={cache}, max_len={max_len}")
        self.max_len, self.cache, self.weight, self.unit = max_len, cache, weight, unit

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        p = overlong_penalty(completion_length(traj, self.unit), self.max_len, self.cache)
        r.components["overlong"] = p
        r.score = r.score + self.weight * p
        return r


@_register("length_norm")
class LengthNorm(Transform):
    """r' = r · (ref_len / max(|y|, 1))^alpha: divide the reward by (relative) length.

    The per-length normalisation SimPO applies to its implicit reward (Meng et al., 2024,
    "SimPO: Simple Preference Optimization with a Reference-Free Reward", arXiv:2405.14734),
    applied here to any reward score; alpha interpolates between none (0) and full (1).
    """

    def __init__(self, alpha: float = 1.0, ref_len: float = 1.0, unit: str = "tokens"):
        self.alpha, self.ref_len, self.unit = alpha, ref_len, unit

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        n = max(completion_length(traj, self.unit), 1)
        r.score = r.score * (self.ref_len / n) ** self.alpha
        return r


class _StepTransform(Transform):
    """Rewrites `steps`; the score becomes the cumulative step return Σ_t r'_t."""

    def rewrite(self, steps: list[float]) -> list[float]:
        raise NotImplementedError

    def __call__(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        if not r.steps:
            r.info.setdefault("notes", []).append(f"{self.name}: no steps")
            return r
        r.steps = self.rewrite(list(r.steps))
        r.score = float(sum(r.steps))
        return r


@_register("step_clip")
class StepClip(_StepTransform):
    """r'_t = min(r_t − eta, 0): the Clipping refinement, so Σ_t r'_t ≤ 0 and repeating steps never pays.

    Gao et al., 2024, "On Designing Effective RL Reward at Training Time for LLM
    Reasoning" (arXiv:2410.15115), its Clipping and Delta refinements.
    """

    def __init__(self, eta: float = 0.0):
        self.eta = eta

    def rewrite(self, steps: list[float]) -> list[float]:
        return [min(s - self.eta, 0.0) for s in steps]


@_register("step_delta")
class StepDelta(_StepTransform):
    """r'_t = r_t − r_{t+1} (t < T), r'_T = r_T: the Delta refinement; every return-to-go Σ_{k≥t} r'_k = r_t is bounded.

    Gao et al., 2024, "On Designing Effective RL Reward at Training Time for LLM
    Reasoning" (arXiv:2410.15115), its Clipping and Delta refinements.
    """

    def rewrite(self, steps: list[float]) -> list[float]:
        return [a - b for a, b in zip(steps, steps[1:])] + steps[-1:]


@_register("step_cap")
class StepCap(_StepTransform):
    """r'_t = min(r_t, cap − Σ_{k<t} r'_k): the cumulative step reward never exceeds `cap`.

    The bound that Clipping / Delta (Gao et al., 2024, arXiv:2410.15115) enforce, stated
    directly.
    """

    def __init__(self, cap: float = 1.0):
        self.cap = cap

    def rewrite(self, steps: list[float]) -> list[float]:
        out, total = [], 0.0
        for s in steps:
            v = min(s, self.cap - total)
            out.append(v)
            total += v
        return out


@REWARDS.register("chain")
class Chain(Reward):
    """`reward`, then each transform in order (skipped for a failed or None result)."""

    reward_args = ("reward",)
    transform_args = ("transforms",)

    def __init__(self, reward: Reward, transforms: list[Transform] | tuple[Transform, ...] = ()):
        self.reward, self.transforms = reward, list(transforms)
        self.kind = reward.kind

    def score(self, traj: Trajectory) -> RewardResult:
        return self._after(score_safely(self.reward, traj), traj)

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        if self.kind != "batch":  # a batch reward (a groupwise judge) must see the batch whole
            return super().__call__(batch)
        return [self._after(r, t) for r, t in zip(self.reward(batch), batch)]

    def _after(self, r: RewardResult, traj: Trajectory) -> RewardResult:
        if r.error is not None or r.score is None:
            return r
        try:
            for t in self.transforms:
                r = t(r, traj)
        except Exception as e:  # a transform's bug fails this item, as in `score_safely`
            return RewardResult.failed(f"{type(e).__name__}: {e}")
        return r

    def hparams(self) -> dict[str, Any]:
        return {"reward": _hp(self.reward), "transforms": [{t.name: t.hparams()} for t in self.transforms]}


# ---------------------------------------------------------------------------- composition


def _hp(r: Reward) -> dict[str, Any]:
    return {"name": type(r).__name__, **r.hparams()}


def _kind(children) -> str:
    """A composition's kind: `batch` when a child must see the batch whole, else `io` when a child waits on a server."""
    kinds = {c.kind for c in children}
    return "batch" if "batch" in kinds else "io" if "io" in kinds else "cpu"


def _score_whole(composite: Reward, batch: list[Trajectory]) -> list[RewardResult]:
    """`composite(batch)` with every child scoring the batch in one call first (a groupwise judge sees its groups)."""
    scored = {}
    for k, c in composite.components.items():  # type: ignore[attr-defined]
        try:
            out = c(batch)
            if len(out) != len(batch):
                raise ValueError(f"returned {len(out)} results for {len(batch)} items")
        except Exception as e:  # a child's batch call that raises fails its items, not the batch
            out = [RewardResult.failed(f"{type(e).__name__}: {e}") for _ in batch]
        scored[k] = out
    composite._batch = {id(t): {k: scored[k][i] for k in scored} for i, t in enumerate(batch)}  # type: ignore[attr-defined]
    try:
        return Reward.__call__(composite, batch)
    finally:
        composite._batch = None  # type: ignore[attr-defined]


class _Composite(Reward):
    """Scores named children; fails when one fails, None when one is None."""

    reward_args = ("components",)

    def __init__(self, components: dict[str, Reward] | list[Reward]):
        if isinstance(components, (list, tuple)):
            components = {f"c{i}": c for i, c in enumerate(components)}
        if not components:
            raise ValueError("needs at least one component")
        self.components = dict(components)
        self.kind = _kind(self.components.values())

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        return _score_whole(self, batch) if self.kind == "batch" else super().__call__(batch)

    def children(self, traj: Trajectory) -> tuple[dict[str, RewardResult], RewardResult | None]:
        """Every child's result, and a result to return instead when one failed or was None."""
        whole = getattr(self, "_batch", None)  # set while a batch is scored whole (`_score_whole`)
        res = whole[id(traj)] if whole and id(traj) in whole else {k: score_safely(c, traj) for k, c in self.components.items()}
        for k, r in res.items():
            if r.error is not None:
                failed = RewardResult.failed(f"component {k}: {r.error}", **r.info)
                failed.components = _scores({j: x for j, x in res.items() if x.error is None})
                return res, failed
        nones = [k for k, r in res.items() if r.score is None]
        if nones:
            return res, RewardResult(None, components=_scores(res), info={"reason": "component_none", "none": nones})
        return res, None

    def hparams(self) -> dict[str, Any]:
        hp = {k: v for k, v in vars(self).items() if not k.startswith("_") and k not in ("components", "kind")}
        return {**hp, "components": {k: _hp(c) for k, c in self.components.items()}}


def _scores(res: dict[str, RewardResult]) -> dict[str, float]:
    return {k: r.score for k, r in res.items() if r.score is not None}


@REWARDS.register("weighted")
class Weighted(_Composite):
    """r = Σ_k w_k · r_k over named components (w_k = 1 when not given)."""

    def __init__(self, components: dict[str, Reward] | list[Reward], weights: dict[str, float] | None = None):
        super().__init__(components)
        weights = dict(weights or {})
        unknown = set(weights) - set(self.components)
        if unknown:
            raise ValueError(f"weights for unknown components {sorted(unknown)}; components: {sorted(self.components)}")
        self.weights = {k: float(weights.get(k, 1.0)) for k in self.components}

    def score(self, traj: Trajectory) -> RewardResult:
        res, bad = self.children(traj)
        if bad:
            return bad
        total = sum(self.weights[k] * r.score for k, r in res.items())
        return RewardResult(total, components=_scores(res), info=_infos(res))


def _infos(res: dict[str, RewardResult]) -> dict[str, Any]:
    return {k: r.info for k, r in res.items() if r.info}


@REWARDS.register("minimum")
class Minimum(_Composite):
    """r = min_k r_k: the worst case over components or an ensemble.

    Worst-case optimisation over a reward-model ensemble (Coste et al., 2023, "Reward
    Model Ensembles Help Mitigate Overoptimization", arXiv:2310.02743).
    """

    def score(self, traj: Trajectory) -> RewardResult:
        res, bad = self.children(traj)
        if bad:
            return bad
        return RewardResult(min(r.score for r in res.values()), components=_scores(res), info=_infos(res))


def pessimistic_value(scores: list[float], beta: float) -> float:
    """−β · log( (1/K) Σ_k exp(−r_k / β) ), computed stably (a soft minimum)."""
    m = min(scores)
    return m - beta * math.log(sum(math.exp(-(s - m) / beta) for s in scores) / len(scores))


@REWARDS.register("pessimistic")
class Pessimistic(_Composite):
    """r̃ = −β · log mean_k exp(−r_k / β): the pessimistic effective reward of an ensemble.

    Between the mean (β → ∞) and the minimum (β → 0). From the closed-form effective
    reward r̃ = ±β·log E_p[exp(±r/β)] of KL-regularised RLHF under a reward
    distribution (the distributional reward-model / KL-DRO view of RLHF that unifies mean,
    worst-case and uncertainty-weighted ensemble rules).
    """

    def __init__(self, components: dict[str, Reward] | list[Reward], beta: float = 1.0):
        super().__init__(components)
        if beta <= 0:
            raise ValueError(f"pessimistic: beta must be > 0, got {beta}")
        self.beta = beta

    def score(self, traj: Trajectory) -> RewardResult:
        res, bad = self.children(traj)
        if bad:
            return bad
        return RewardResult(pessimistic_value([r.score for r in res.values()], self.beta), components=_scores(res), info=_infos(res))


@REWARDS.register("gate")
class Gate(Reward):
    """r = r_outcome + weight · r_process · 1[r_outcome ≥ threshold]: process/bonus only on success.

    Gating a learned process reward on the verified outcome keeps a policy from farming
    step rewards on wrong answers (Gao et al., 2024, "On Designing Effective RL Reward at
    Training Time for LLM Reasoning", arXiv:2410.15115). Steps of the process reward are kept when the gate is open, zeroed when shut.
    """

    reward_args = ("outcome", "process")

    def __init__(self, outcome: Reward, process: Reward, threshold: float = 1.0, weight: float = 1.0):
        self.outcome, self.process, self.threshold, self.weight = outcome, process, threshold, weight
        self.kind = _kind((outcome, process))

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        return _score_whole(self, batch) if self.kind == "batch" else super().__call__(batch)

    def score(self, traj: Trajectory) -> RewardResult:
        res, bad = _Composite.children(self, traj)  # type: ignore[arg-type]
        if bad:
            return bad
        o, p = res["outcome"], res["process"]
        open_ = o.score >= self.threshold
        steps = None if p.steps is None else [s if open_ else 0.0 for s in p.steps]
        comps = {"outcome": o.score, "process": p.score, "gate": float(open_)}
        return RewardResult(o.score + (self.weight * p.score if open_ else 0.0), components=comps, steps=steps, spans=p.spans, info=_infos(res))

    @property
    def components(self) -> dict[str, Reward]:
        return {"outcome": self.outcome, "process": self.process}

    def hparams(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "weight": self.weight, "outcome": _hp(self.outcome), "process": _hp(self.process)}


@REWARDS.register("tiers")
class Tiers(_Composite):
    """r = levels[k], k = how many components pass (score ≥ threshold) in order before the first failure.

    For example `{compiles: …, passes: …}` with levels `[-1, -0.5, 1]`: fails < compiles <
    passes. Tiered outcome rewards as in CodeRL (Le et al., 2022, "CodeRL: Mastering Code
    Generation through Pretrained Models and Deep Reinforcement Learning", arXiv:2207.01780:
    compile error < runtime error < failed test < pass). Default levels: k / K.
    """

    def __init__(self, components: dict[str, Reward] | list[Reward], levels: list[float] | None = None, threshold: float = 1.0):
        super().__init__(components)
        n = len(self.components)
        self.levels = [float(x) for x in levels] if levels is not None else [i / n for i in range(n + 1)]
        if len(self.levels) != n + 1:
            raise ValueError(f"tiers: need {n + 1} levels for {n} components, got {len(self.levels)}")
        self.threshold = threshold

    def score(self, traj: Trajectory) -> RewardResult:
        res, bad = self.children(traj)
        if bad:
            return bad
        k = 0
        for r in res.values():
            if r.score < self.threshold:
                break
            k += 1
        comps = {**_scores(res), "tier": float(k)}
        return RewardResult(self.levels[k], components=comps, info=_infos(res))


def par_value(score: float, ref_scores: list[float]) -> float:
    """(1/M) Σ_m σ(r − r_ref_m): PAR's bounded, centred reward."""
    return sum(1.0 / (1.0 + math.exp(-(score - r))) for r in ref_scores) / len(ref_scores)


@REWARDS.register("par")
class Par(Reward):
    """r_RL = (1/M) Σ_m σ(r(x, y) − r(x, y_ref_m)): Preference as Reward.

    Fu et al., 2025, "Reward Shaping to Mitigate Reward Hacking in RLHF"
    (arXiv:2502.18770), Preference As Reward (PAR): the RL reward should be bounded, rise fast
    then converge, and be a function of the reward centred on a reference. References are
    the dataset field `reference_field` (a string or a list of strings; `answer`: the row's
    reference answer), scored with the same reward (cached per prompt); or precomputed scores
    in `reference_score_field`.
    """

    reward_args = ("reward",)
    verdict = False  # σ of a score gap, in (0, 1): never a right/wrong

    def __init__(self, reward: Reward, reference_field: str = "reference", reference_score_field: str | None = None):
        self.reward, self.reference_field, self.reference_score_field = reward, reference_field, reference_score_field
        self.kind = reward.kind
        self._cache: dict[tuple[str, str], float | None] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def _ref_scores(self, traj: Trajectory) -> list[float] | None:
        f = traj.sample.fields
        if self.reference_score_field is not None:
            v = f.get(self.reference_score_field)
            vals = v if isinstance(v, (list, tuple)) else [v]
            return [float(x) for x in vals] if v is not None and all(x is not None for x in vals) else None
        refs = traj.sample.answer if self.reference_field == "answer" else f.get(self.reference_field)
        if refs is None:
            return None
        out = []
        for ref in refs if isinstance(refs, (list, tuple)) else [refs]:
            key = (traj.sample.id, str(ref))
            if key not in self._cache:
                t = Trajectory(traj.sample, str(ref), traj.prompt_ids, [], [], True, traj.group)
                self._cache[key] = score_safely(self.reward, t).score
            if self._cache[key] is None:
                return None
            out.append(self._cache[key])
        return out

    def score(self, traj: Trajectory) -> RewardResult:
        r = score_safely(self.reward, traj)
        if r.error is not None or r.score is None:
            return r
        refs = self._ref_scores(traj)
        if not refs:
            return RewardResult(None, components={"raw": r.score}, info={"reason": "no_reference"})
        return RewardResult(par_value(r.score, refs), components={"raw": r.score, "reference": sum(refs) / len(refs)}, info=r.info)

    def hparams(self) -> dict[str, Any]:
        return {"reference_field": self.reference_field, "reference_score_field": self.reference_score_field, "reward": _hp(self.reward)}
