"""Group selection in the loop: which prompts a step rolls out, and which groups it trains on.

The pieces themselves are in `assay.data.selection` (pure, no model, no reward); this file
connects them to the prompt source, the policy and the reward executor:

- `PromptPicker` chooses a step's prompts. Up to `selection.retry_frac` of them come from
  the retry buffer; the rest come from the source in its seeded order (`stream`), or the
  variance-prioritised sampler draws them from a pool of recent prompts (`variance`).
  After scoring, `observe` tells both what each prompt's group scored.
- `GoldInjector` puts the verified reference solution into groups whose every completion failed.
- `split_groups` and `join_groups` convert between the sampler's flat list and groups.

DAPO's dynamic sampling, which needs a generation loop, is driven by `Trainer._rollout`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Callable

from assay.config import SelectionConfig
from assay.data.datasets import PromptSource
from assay.data.selection import RetryBuffer, VariancePriority, inject_ground_truth, scored_rewards
from assay.types import RewardResult, Sample, Trajectory

Item = tuple[Trajectory, RewardResult]


def split_groups(trajs: list[Trajectory], results: list[RewardResult]) -> list[list[Item]]:
    """The flat rollout as groups `(trajectory, result)`, in order of `Trajectory.group`."""
    by: dict[int, list[Item]] = {}
    for t, r in zip(trajs, results):
        by.setdefault(t.group, []).append((t, r))
    return [by[g] for g in sorted(by)]


def join_groups(groups: list[list[Item]]) -> tuple[list[Trajectory], list[RewardResult]]:
    """Flatten groups back into one batch, renumbering `Trajectory.group` as 0, 1, …"""
    trajs, results = [], []
    for g, items in enumerate(groups):
        for t, r in items:
            t.group = g
            trajs.append(t)
            results.append(r)
    return trajs, results


def scores(items: list[Item]) -> list[float | None]:
    return [r.score for _, r in items]


def _solved(rewards: list[float | None], success: float) -> bool:
    return any(r >= success for r in scored_rewards(rewards))


class PromptPicker:
    """A step's prompts from the retry buffer, the variance-prioritised pool or the plain source.

    Args:
        source: the run's `PromptSource` (fresh prompts, in its seeded order).
        cfg: the `selection` section.
        batch: `rollout.prompts_per_step` (sets the default pool size, 4 × batch).
        seed: seeds the picker's own `random.Random` (saved in checkpoints).
    """

    def __init__(self, source: PromptSource, cfg: SelectionConfig, batch: int, seed: int):
        self.source, self.cfg = source, cfg
        self.rng = random.Random(f"sampling:{seed}")  # the seed string of older releases: same draws
        self.retry = RetryBuffer(cfg.retry_capacity, cfg.retry_max, cfg.success) if cfg.retry else None
        self.variance = None
        if cfg.prompts == "variance":
            self.variance = VariancePriority(cfg.var_prior, cfg.var_decay, cfg.var_floor, cfg.var_temperature)
        self.pool_size = cfg.pool_size or 4 * batch
        self._pool: OrderedDict[str, Sample] = OrderedDict()  # recent prompts, oldest first (`variance`)
        self._waiting: dict[str, Sample] = {}  # the prompts the retry buffer holds
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._n = self._retried = self._retry_solved = 0
        self._handed: set[str] = set()
        self._picked_var: list[float] = []

    def next(self, n: int) -> list[Sample]:
        """Up to n prompts: retries first, then fresh or variance-prioritised ones."""
        retried: list[Sample] = []
        if self.retry is not None and len(self.retry) and self.cfg.retry_frac > 0:
            ids = self.retry.sample(round(self.cfg.retry_frac * n), self.rng)
            retried = [self._waiting[i] for i in ids]
            self._handed.update(ids)
        out = retried + self._fresh(n - len(retried), {s.id for s in retried})
        self._n += len(out)
        self._retried += len(retried)
        return out

    def _fresh(self, k: int, exclude: set[str]) -> list[Sample]:
        if self.variance is None:
            return self.source.next_batch(k)
        for s in self.source.next_batch(k):  # k new candidates a call; the oldest leave the pool
            self._pool.pop(s.id, None)
            self._pool[s.id] = s
        while len(self._pool) > self.pool_size:
            self._pool.popitem(last=False)
        ids = self.variance.sample([i for i in self._pool if i not in exclude], k, self.rng)
        self._picked_var += [self.variance.variance(i) for i in ids]
        return [self._pool[i] for i in ids]

    def observe(self, groups: list[list[Item]]) -> None:
        """Record what each rolled-out prompt scored (before any gold is injected)."""
        for items in groups:
            sample, rewards = items[0][0].sample, scores(items)
            if self.variance is not None:
                self.variance.update(sample.id, rewards)
            if self.retry is not None:
                if sample.id in self._handed:
                    self._retry_solved += _solved(rewards, self.cfg.success)
                    self._handed.discard(sample.id)
                self.retry.update(sample.id, rewards)
                self._waiting[sample.id] = sample
        if self.retry is not None:  # forget what the buffer let go (solved, given up, evicted)
            self._waiting = {i: s for i, s in self._waiting.items() if i in self.retry}

    def metrics(self) -> dict[str, float]:
        """This step's `selection/` figures; resets the step's counters."""
        out: dict[str, float] = {}
        if self.retry is not None:
            out["selection/retry_size"] = float(len(self.retry))
            out["selection/retried_frac"] = self._retried / self._n if self._n else 0.0
            out["selection/retry_solved_frac"] = self._retry_solved / self._retried if self._retried else math.nan
        if self.variance is not None:
            out.update(self.variance.metrics())
            out["selection/picked_var"] = sum(self._picked_var) / len(self._picked_var) if self._picked_var else math.nan
        self._reset_counts()
        return out

    def state_dict(self) -> dict:
        return {
            "rng": self.rng.getstate(),
            "retry": self.retry.state_dict() if self.retry is not None else None,
            "waiting": list(self._waiting.values()),
            "variance": self.variance.state_dict() if self.variance is not None else None,
            "pool": list(self._pool.values()),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        if self.retry is not None and state["retry"] is not None:
            self.retry.load_state_dict(state["retry"])
            self._waiting = {s.id: s for s in state["waiting"]}
        if self.variance is not None and state["variance"] is not None:
            self.variance.load_state_dict(state["variance"])
            self._pool = OrderedDict((s.id, s) for s in state["pool"])


class GoldInjector:
    """S-GRPO's conditional ground-truth injection, with the reference checked by the reward first.

    For every group whose scored completions all failed, the reference (`Sample.answer`,
    or the data field `field`) becomes a completion: its tokens plus EOS. The run's
    reward scores it, outside the step's reward-health counts; only a reference scored at
    least `success` replaces the group's worst completion, with the score it got. The
    trainer supplies its logprobs (`logprobs(trajs, results) -> [[float]]`), since no
    sampler drew it.
    """

    def __init__(self, tokenizer, field: str = "answer", success: float = 1.0):
        self.tokenizer, self.field, self.success = tokenizer, field, success

    def reference(self, like: Trajectory) -> Trajectory | None:
        """The reference solution of `like`'s prompt as a trajectory of the same group (None: none given)."""
        s = like.sample
        value = s.answer if self.field == "answer" else s.fields.get(self.field)
        if value is None:
            return None
        ids = self.tokenizer(str(value), add_special_tokens=False)["input_ids"]
        if self.tokenizer.eos_token_id is not None:
            ids = ids + [self.tokenizer.eos_token_id]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Trajectory(s, text, like.prompt_ids, ids, [0.0] * len(ids), True, group=like.group, version=like.version)

    def __call__(
        self, groups: list[list[Item]], score: Callable[[list[Trajectory]], list[RewardResult]],
        logprobs: Callable[[list[Trajectory], list[RewardResult]], list[list[float]]],
    ) -> tuple[list[list[Item]], dict[str, float]]:
        """Groups with the verified references injected, and how many were injected or rejected."""
        todo = {}
        for i, items in enumerate(groups):
            rs = scored_rewards(scores(items))
            if rs and max(rs) < self.success and (ref := self.reference(items[0][0])) is not None:
                todo[i] = ref
        injected = rejected = 0
        if todo:
            refs = list(todo.values())
            results = score(refs)
            for (i, ref), res, lp in zip(todo.items(), results, logprobs(refs, results)):
                if res.score is None or res.score < self.success:
                    rejected += 1
                    continue
                ref.logprobs = lp
                groups[i], _, ok = inject_ground_truth(groups[i], scores(groups[i]), (ref, res), gold_reward=res.score, success=self.success)
                injected += ok
        return groups, {"selection/gold_injected": float(injected), "selection/gold_rejected": float(rejected)}
