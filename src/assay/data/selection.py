"""Group selection: which prompts to roll out, and which sampled groups to train on.

Nothing here generates or scores; the trainer does both and calls these pieces. Rewards
are per-sample floats with `None` or NaN for "could not be scored", which never counts
as a success, a failure or a variance sample. Prompt ids are `Sample.id`.

Interface:

- `informative(rewards) -> bool`: DAPO's test; a group is kept when its scored rewards
  are not all equal (it has a learning signal).
- `DynamicFilter(target_groups, max_rounds)`: DAPO dynamic sampling. Per generation
  round call `add(groups, rewards)` (lists per group); loop `while not sampler.done`;
  then `take() -> (groups, rewards)`, at most `target_groups` informative groups. At
  most `max_rounds` rounds are generated per batch (the bound on extra generation); if
  they do not fill the batch, `take()` returns fewer groups. `metrics()` for logging.
- `inject_ground_truth(group, rewards, gold, ...) -> (group, rewards, injected)`: when
  every scored sample of one group failed, swap in (or append) the reference solution
  with the maximal reward (S-GRPO's conditional ground-truth injection). The gold
  sample has no sampler logprobs: the trainer computes its old logprobs itself.
- `RetryBuffer`: `update(prompt_id, rewards)` after scoring a group; `sample(n, rng)`
  returns up to n unsolved prompts to roll out again (mix them into the next batch).
- `VariancePriority`: `update(prompt_id, rewards)` after scoring;
  `sample(candidates, n, rng)` picks n of the candidate prompt ids, weighted by their
  learned within-prompt reward variance.

`RetryBuffer` and `VariancePriority` have `state_dict()` / `load_state_dict()`
(plain, JSON-able dicts) so a resumed run samples as the uninterrupted one would.
`rng` is a `random.Random`.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Generic, Hashable, Sequence, TypeVar


T = TypeVar("T")
Reward = float | None


def scored_rewards(rewards: Sequence[Reward]) -> list[float]:
    """The rewards that were scored: `None` (cannot be scored) and NaN left out."""
    return [float(r) for r in rewards if r is not None and not math.isnan(float(r))]


def informative(rewards: Sequence[Reward], tol: float = 1e-6) -> bool:
    """Whether a group has a learning signal: at least 2 scored rewards, not all equal.

    DAPO's dynamic sampling drops the other groups (all solved or all failed), whose
    group-relative advantages are all 0. Yu et al., "DAPO: An Open-Source LLM
    Reinforcement Learning System at Scale" (2025), arXiv:2503.14476.

    >>> informative([1.0, 0.0]), informative([1.0, 1.0]), informative([1.0, None])
    (True, False, False)
    """
    scored = scored_rewards(rewards)
    return len(scored) >= 2 and max(scored) - min(scored) > tol


class DynamicFilter(Generic[T]):
    """DAPO dynamic sampling: keep informative groups over rounds until the batch is full.

    >>> s = DynamicFilter(target_groups=1, max_rounds=2)
    >>> s.add([["a", "b"], ["c", "d"]], [[1, 1], [1, 0]])
    1
    >>> s.done, s.take()
    (True, ([['c', 'd']], [[1, 0]]))
    """

    def __init__(self, target_groups: int, max_rounds: int = 3, tol: float = 1e-6) -> None:
        if target_groups < 1 or max_rounds < 1:
            raise ValueError("target_groups and max_rounds must be at least 1")
        self.target_groups, self.max_rounds, self.tol = target_groups, max_rounds, tol
        self._reset()

    def _reset(self) -> None:
        self._groups: list[list[T]] = []
        self._rewards: list[list[Reward]] = []
        self.rounds = 0
        self.seen = 0

    def add(self, groups: Sequence[Sequence[T]], rewards: Sequence[Sequence[Reward]]) -> int:
        """Record one generation round; keep its informative groups. Returns how many were kept."""
        if len(groups) != len(rewards):
            raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
        self.rounds += 1
        self.seen += len(groups)
        kept = 0
        for items, rs in zip(groups, rewards):
            if informative(rs, self.tol):
                self._groups.append(list(items))
                self._rewards.append(list(rs))
                kept += 1
        return kept

    @property
    def ready(self) -> bool:
        """The batch is full."""
        return len(self._groups) >= self.target_groups

    @property
    def exhausted(self) -> bool:
        """No more rounds may be generated for this batch."""
        return self.rounds >= self.max_rounds

    @property
    def done(self) -> bool:
        return self.ready or self.exhausted

    def metrics(self) -> dict[str, float]:
        """`selection/rounds`, `selection/kept_frac` (informative share of generated groups), `selection/filled` (batch fill, ≤ 1)."""
        return {
            "selection/rounds": float(self.rounds),
            "selection/kept_frac": len(self._groups) / self.seen if self.seen else 0.0,
            "selection/filled": min(1.0, len(self._groups) / self.target_groups),
        }

    def take(self) -> tuple[list[list[T]], list[list[Reward]]]:
        """The first `target_groups` kept groups and their rewards; resets for the next batch.

        Surplus informative groups from the last round are dropped (as in DAPO).
        """
        out = self._groups[: self.target_groups], self._rewards[: self.target_groups]
        self._reset()
        return out


def inject_ground_truth(
    group: Sequence[T], rewards: Sequence[Reward], gold: T | None, gold_reward: float = 1.0,
    success: float = 1.0, replace: bool = True,
) -> tuple[list[T], list[Reward], bool]:
    """If every scored sample of a group failed, put the reference solution into the group.

    Conditional ground-truth injection (CGI) from S-GRPO (Supervised GRPO): with all G
    rollouts failing, the group-relative advantage is 0 everywhere; with the verified
    reference solution in the group at the maximal reward, its advantage is positive and
    the update contains an advantage-weighted SFT term on it.

    Args:
        group: one group's samples; rewards: their rewards (None/NaN: unscored).
        gold: the reference solution as a sample of the same type (None: nothing to inject).
        gold_reward: the reward given to it (the task's maximum).
        success: a reward ≥ this is a success.
        replace: swap the gold in for the lowest-reward sample (group size unchanged),
            else append it.
    Returns:
        `(group, rewards, injected)`; unchanged copies when some sample succeeded, none
        was scored, or `gold` is None.

    >>> inject_ground_truth(["x", "y"], [0.0, 0.2], "gold")
    (['gold', 'y'], [1.0, 0.2], True)
    """
    group, rewards = list(group), list(rewards)
    scored = scored_rewards(rewards)
    if gold is None or not scored or max(scored) >= success:
        return group, rewards, False
    if not replace:
        return group + [gold], rewards + [gold_reward], True
    key = [math.inf if r is None or math.isnan(float(r)) else float(r) for r in rewards]
    worst = min(range(len(key)), key=key.__getitem__)
    group[worst], rewards[worst] = gold, gold_reward
    return group, rewards, True


class RetryBuffer:
    """Prompts the policy could not solve, handed back for another attempt later.

    Lifecycle of a prompt: a group with no success (pass rate ≤ `max_pass_rate`) enters
    the buffer; `sample` hands it out (and removes it); the next `update` for it either
    drops it (solved) or puts it back with one more retry, until `max_retries` retries
    have failed. When full, the oldest entry is evicted.

    >>> buf = RetryBuffer(max_retries=1)
    >>> buf.update("p1", [0, 0]); buf.update("p2", [1, 0])
    >>> buf.sample(5, random.Random(0))
    ['p1']
    >>> buf.update("p1", [0, 0]); len(buf)   # its one retry failed: given up
    0
    """

    def __init__(self, capacity: int = 1024, max_retries: int = 3, success: float = 1.0, max_pass_rate: float = 0.0) -> None:
        self.capacity, self.max_retries = capacity, max_retries
        self.success, self.max_pass_rate = success, max_pass_rate
        self._waiting: OrderedDict[Hashable, int] = OrderedDict()  # prompt id -> retries so far
        self._out: dict[Hashable, int] = {}  # handed out, awaiting their next update

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._waiting

    def update(self, prompt_id: Hashable, rewards: Sequence[Reward]) -> None:
        """Record the rewards of one rollout group of `prompt_id`."""
        scored = scored_rewards(rewards)
        retries = self._out.pop(prompt_id, None)
        if retries is None:
            retries = self._waiting.pop(prompt_id, -1)
        else:
            self._waiting.pop(prompt_id, None)
        if not scored:  # nothing learned: keep its state
            if retries >= 0:
                self._waiting[prompt_id] = retries
            return
        pass_rate = sum(r >= self.success for r in scored) / len(scored)
        if pass_rate > self.max_pass_rate:
            return  # solved: forget it
        retries += 1  # a first failure counts as retry 0
        if retries >= self.max_retries:
            return  # given up
        self._waiting[prompt_id] = retries
        while len(self._waiting) > self.capacity:
            self._waiting.popitem(last=False)

    def sample(self, n: int, rng: random.Random) -> list[Hashable]:
        """Up to n waiting prompt ids, chosen uniformly; they leave the buffer until updated."""
        ids = list(self._waiting)
        picked = rng.sample(ids, min(n, len(ids)))
        for p in picked:
            self._out[p] = self._waiting.pop(p)
        return picked

    def state_dict(self) -> dict:
        return {"waiting": list(self._waiting.items()), "out": list(self._out.items())}

    def load_state_dict(self, state: dict) -> None:
        self._waiting = OrderedDict((k, int(v)) for k, v in state["waiting"])
        self._out = {k: int(v) for k, v in state["out"]}


class VariancePriority:
    """Prefer prompts whose rewards vary within a group, learned from each prompt's history.

    A group whose rewards are all equal gives no group-relative gradient; within-prompt
    reward variance measures how informative a prompt is (METIS, METAcognitive Internalized Self-judgment, which
    has the policy predict it; here it is an exponential moving average of the observed
    population variance, so no model call is needed). Priority = (v̂ + floor)^temperature,
    with v̂ = `prior` for prompts never seen (0.25, the largest variance of a 0/1 reward,
    so new prompts are tried first). Sampling is weighted and without replacement.

    >>> s = VariancePriority()
    >>> s.update("easy", [1, 1, 1, 1]); s.update("edge", [1, 0, 1, 0])
    >>> round(s.variance("easy"), 3), round(s.variance("edge"), 3), s.variance("new")
    (0.0, 0.25, 0.25)
    """

    def __init__(self, prior: float = 0.25, decay: float = 0.5, floor: float = 0.01, temperature: float = 1.0) -> None:
        if not 0 <= decay < 1:
            raise ValueError("decay must be in [0, 1)")
        self.prior, self.decay, self.floor, self.temperature = prior, decay, floor, temperature
        self._var: dict[Hashable, float] = {}
        self._count: dict[Hashable, int] = {}

    def update(self, prompt_id: Hashable, rewards: Sequence[Reward]) -> None:
        """Fold one group's observed reward variance into the prompt's estimate."""
        scored = scored_rewards(rewards)
        if len(scored) < 2:
            return
        mean = sum(scored) / len(scored)
        var = sum((r - mean) ** 2 for r in scored) / len(scored)
        old = self._var.get(prompt_id)
        self._var[prompt_id] = var if old is None else self.decay * old + (1 - self.decay) * var
        self._count[prompt_id] = self._count.get(prompt_id, 0) + 1

    def variance(self, prompt_id: Hashable) -> float:
        """The estimated within-prompt reward variance (`prior` if never seen)."""
        return self._var.get(prompt_id, self.prior)

    def priority(self, prompt_id: Hashable) -> float:
        return (self.variance(prompt_id) + self.floor) ** self.temperature

    def sample(self, candidates: Sequence[Hashable], n: int, rng: random.Random) -> list[Hashable]:
        """n distinct candidates, drawn with probability ∝ priority (Efraimidis–Spirakis keys u^(1/w))."""
        keyed = []
        for c in candidates:
            w = self.priority(c)
            u = rng.random()
            keyed.append((math.log(u) / w if w > 0 else -math.inf, c) if u > 0 else (-math.inf, c))
        keyed.sort(key=lambda kc: kc[0], reverse=True)
        return [c for _, c in keyed[:n]]

    def metrics(self) -> dict[str, float]:
        """`selection/var_mean` over seen prompts and `selection/prompts_seen`."""
        v = list(self._var.values())
        return {"selection/var_mean": sum(v) / len(v) if v else 0.0, "selection/prompts_seen": float(len(v))}

    def state_dict(self) -> dict:
        return {"var": list(self._var.items()), "count": list(self._count.items())}

    def load_state_dict(self, state: dict) -> None:
        self._var = {k: float(v) for k, v in state["var"]}
        self._count = {k: int(v) for k, v in state["count"]}
