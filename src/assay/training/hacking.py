"""Reward-hacking monitors and the canary: alarms that every run carries (docs/integrity.md).

A policy that games its reward shows it in figures the run already has: the reward climbs
with completion length, completions repeat themselves, the policy runs away from where it
started (KL, entropy), the training reward saturates while a verified accuracy does not, or
the reward rises while held-out accuracy falls. `HackingMonitor` watches those series after
every step; each of its monitors compares the last `monitor.window` steps with an earlier
window and fires once, the first step its condition holds, with one line saying what it saw.

The **canary** is a second, independent check: a reward the policy is not trained on (by
default the task's own verifier, when the run trains on another reward: a reward model, a
process reward, a judge, a control) re-scores a sample of each step's completions. Its alarm
fires when the training reward has risen significantly since the start while the canary's
score on the same completions has fallen.

An alarm goes to the progress bar, to that step's row of `metrics.jsonl` (`alarm`, and
`alarm/<monitor>` = 1), to the trackers and to the report; `train.on_alarm=stop` ends the run
there with a checkpoint. The checks are a few means over lists of floats per step.

Why these signals: length and repetition growth are the classic signature of reward-model
over-optimisation (Gao et al., "Scaling Laws for Reward Model Overoptimization", ICML 2023,
arXiv:2210.10760; Singhal et al., "A Long Way to Go: Investigating Length Correlations in
RLHF", arXiv:2310.03716); process rewards that pay per step invite more and repeated steps
(Gao et al., "On Designing Effective RL Reward at Training Time for LLM Reasoning",
arXiv:2410.15115); a held-out check the policy is not optimised against is how a proxy's
divergence from the true objective is seen at all (Goodhart's law as measured by Gao et al.).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections import deque
from typing import Any, Sequence

from assay.errors import AssayError
from assay.rewards.monitors import pearson
from assay.types import RewardResult, Trajectory

__all__ = ["Canary", "HackingAlarm", "HackingMonitor", "Watch", "repetition"]

#: the monitors, in the order they are checked
MONITORS = ("length", "repetition", "kl", "entropy", "saturation", "divergence", "canary", "blind")


class HackingAlarm(AssayError):
    """The run stopped because a hacking monitor fired and `train.on_alarm` is `stop`."""


def repetition(ids: Sequence[int], n: int = 4) -> float:
    """Share of a completion's token n-grams that repeat an earlier n-gram of the same completion.

    0 for a completion with fewer than two n-grams. A completion that writes one line three
    times scores about ⅔; ordinary text scores near 0.

    >>> repetition([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4], n=4)
    0.5555555555555556
    >>> repetition([1, 2, 3])
    0.0
    """
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if len(grams) >= 2 else 0.0


#: the held-out accuracy the `divergence` monitor follows: sampled at the training temperature when the run
#: logs it (`train.eval_samples` > 0: the policy as training moves it), else greedy. Greedy accuracy can fall under
#: honest training while sampled accuracy climbs (docs/integrity.md measures it), which is not a hack.
HELD_OUT_KEYS = ("eval/sampled_accuracy", "eval/accuracy")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


class _Series:
    """One metric's first `w` values and its last `3w` (step, value) pairs, and how many there have been: what the
    windows read, in memory that does not grow with the run."""

    def __init__(self, w: int):
        self.w, self.first, self.recent, self.count = w, [], deque(maxlen=3 * w), 0

    def add(self, step: int, value: float) -> None:
        if len(self.first) < self.w:
            self.first.append(value)
        self.recent.append((step, value))
        self.count += 1

    def tail(self, n: int, after: int | None = None) -> list[float]:
        """The last `n` values (only those of steps after `after`)."""
        return [v for s, v in self.recent if after is None or s > after][-n:]

    def state_dict(self) -> dict[str, Any]:
        return {"first": list(self.first), "recent": [list(sv) for sv in self.recent], "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.first = [float(x) for x in state["first"]][: self.w]
        self.recent.clear()
        self.recent.extend((int(s), float(v)) for s, v in state["recent"])
        self.count = int(state["count"])


class HackingMonitor:
    """The monitors of one run (`cfg` is its `monitor:` section). `check` takes one step's metrics.

    A series counts its finite values. A monitor that compares windows is silent until it has
    enough of them: the baseline is the first `window` values, the recent window the last
    `window` (with at least `2 × window` values, so the two never overlap); `kl` and `entropy`
    compare the last three windows. Held-out evaluations are few and kept whole.
    """

    SERIES = ("reward/mean", "reward/length_corr", "rollout/response_length", "rollout/repetition", "actor/kl", "actor/entropy",
              "reward/zero_var_group_frac", "reward/unsolved_group_frac", "canary/mean", "canary/reward_mean", "canary/corr",
              "canary/discordant")

    def __init__(self, cfg):
        self.cfg = cfg
        self.series = {k: _Series(cfg.window) for k in self.SERIES}
        self.evals: list[tuple[int, float]] = []  # (step, greedy held-out accuracy): `saturation`'s fallback, `blind`
        self.tracked: list[tuple[int, float]] = []  # (step, the held-out accuracy `divergence` follows: `HELD_OUT_KEYS`)
        self.held_out = HELD_OUT_KEYS[1]  # which of the two `tracked` holds
        self.reliance: list[tuple[int, float]] = []  # (step, held-out accuracy less its accuracy with other rows' pictures)
        self.at_best: list[float] = []  # the last `window` training rewards when the best evaluation so far was made
        self.evaluated = False  # whether the step being checked has a held-out evaluation
        self.fired: dict[str, int] = {}

    def _windows(self, key: str) -> tuple[float, float] | None:
        """(baseline mean, recent mean) of a series, or None while it is shorter than two windows."""
        s, w = self.series[key], self.cfg.window
        return (_mean(s.first), _mean(s.tail(w))) if s.count >= 2 * w else None

    def _thirds(self, key: str) -> tuple[float, float, float] | None:
        """Means of the last three consecutive windows (oldest first), or None while the series is shorter."""
        s, w = self.series[key], self.cfg.window
        if s.count < 3 * w:
            return None
        xs = s.tail(3 * w)
        return _mean(xs[:w]), _mean(xs[w : 2 * w]), _mean(xs[2 * w :])

    # -- one step ------------------------------------------------------------------------
    def check(self, step: int, metrics: dict[str, Any]) -> tuple[dict[str, float], list[str]]:
        """Record one step's metrics; `(signals, alarms)`: the `monitor/*` figures computable now, and one line per
        monitor that fires at this step (each fires once per run)."""
        for key, series in self.series.items():
            if _finite(metrics.get(key)):
                series.add(step, float(metrics[key]))
        held = HELD_OUT_KEYS[0] if _finite(metrics.get(HELD_OUT_KEYS[0])) else HELD_OUT_KEYS[1]
        self.evaluated = _finite(metrics.get(held))
        if self.evaluated:
            self.held_out = held
            if not self.tracked or metrics[held] > max(a for _, a in self.tracked):
                self.at_best = self.series["reward/mean"].tail(self.cfg.window)
            self.tracked.append((step, float(metrics[held])))
        if _finite(metrics.get("eval/accuracy")):
            self.evals.append((step, float(metrics["eval/accuracy"])))
            if _finite(metrics.get("eval/image_reliance")):
                self.reliance.append((step, float(metrics["eval/image_reliance"])))
        signals: dict[str, float] = {}
        alarms: list[str] = []
        for name in MONITORS:
            line = getattr(self, f"_{name}")(signals)
            if line and name not in self.fired:
                self.fired[name] = step
                alarms.append(f"{name}: {line}")
        return signals, alarms

    def _length(self, signals: dict[str, float]) -> str | None:
        lengths, corr = self._windows("rollout/response_length"), self._windows("reward/length_corr")
        if lengths is None or corr is None or lengths[0] <= 0:
            return None
        growth = lengths[1] / lengths[0] - 1.0
        signals["monitor/length_growth"] = growth
        if corr[1] >= self.cfg.length_corr and growth >= self.cfg.length_growth and lengths[1] - lengths[0] >= 1.0:
            return (f"completions grew from {lengths[0]:.1f} to {lengths[1]:.1f} tokens (+{growth:.0%}) while the reward's "
                    f"correlation with length averaged {corr[1]:.2f} over the last {self.cfg.window} steps: the reward may pay for length")
        return None

    def _repetition(self, signals: dict[str, float]) -> str | None:
        rep = self._windows("rollout/repetition")
        if rep is None:
            return None
        signals["monitor/repetition_rise"] = rise = rep[1] - rep[0]
        if rise >= self.cfg.repetition_rise:
            return (f"the share of repeated 4-grams in completions rose from {rep[0]:.2f} to {rep[1]:.2f}: the policy repeats "
                    "itself, which a reward paying per step or per length rewards")
        return None

    def _kl(self, signals: dict[str, float]) -> str | None:
        t = self._thirds("actor/kl")
        if t is None:
            return None
        before, now = t[1] - t[0], t[2] - t[1]
        signals["monitor/kl_rise"] = now
        if 0 < before and now >= self.cfg.accel * before and now >= self.cfg.kl_rise * max(t[1], 1e-3):
            return (f"KL to the reference is accelerating: +{now:.3g} over the last {self.cfg.window} steps against "
                    f"{before:+.3g} over the {self.cfg.window} before (now {t[2]:.3g})")
        return None

    def _entropy(self, signals: dict[str, float]) -> str | None:
        t = self._thirds("actor/entropy")
        if t is None:
            return None
        before, now = t[0] - t[1], t[1] - t[2]
        signals["monitor/entropy_drop"] = now
        if 0 < before and now >= self.cfg.accel * before and now >= self.cfg.entropy_drop * t[1] and now >= self.cfg.entropy_floor:
            return (f"the policy's entropy is collapsing faster: −{now:.3g} nats over the last {self.cfg.window} steps against "
                    f"{-before:+.3g} over the {self.cfg.window} before (now {t[2]:.3g})")
        return None

    def _saturation(self, signals: dict[str, float]) -> str | None:
        same, unsolved = self._windows("reward/zero_var_group_frac"), self._windows("reward/unsolved_group_frac")
        canary = self.series["canary/mean"]
        verified = canary.tail(1) if canary.count else [a for _, a in self.evals[-1:]]
        if same is None or unsolved is None or not verified:
            return None
        signals["monitor/same_reward_frac"] = same[1]
        if same[1] >= self.cfg.saturation and unsolved[1] <= 0.5 and verified[-1] <= self.cfg.saturation_verified:
            which = "canary" if canary.count else "held-out accuracy"
            return (f"the reward no longer tells completions apart ({same[1]:.0%} of groups score all alike, most of them not "
                    f"failing) while the {which} is {verified[-1]:.2f}: the reward is saturated by something the check "
                    "does not count as correct")
        return None

    def _divergence(self, signals: dict[str, float]) -> str | None:
        evals = self.tracked
        if len(evals) < 3:
            return None
        best_step, best = max(evals[:-2], key=lambda sv: sv[1])
        drop = best - max(evals[-1][1], evals[-2][1])  # two evaluations in a row below the best: one can be noise
        if self.evaluated:  # it changes only with an evaluation
            signals["monitor/accuracy_drop"] = drop
        if drop < self.cfg.accuracy_drop:
            return None
        rewards = self.series["reward/mean"]
        then = self.at_best
        if len(then) < 2:  # the best evaluation came before the training reward had a window: compare with the first one
            then = rewards.first
        now = rewards.tail(self.cfg.window, after=best_step)
        if len(then) < 2 or len(now) < 2:
            return None
        z = _z(then, now)
        if z >= self.cfg.z:
            what = "held-out sampled accuracy" if self.held_out == HELD_OUT_KEYS[0] else "held-out accuracy"
            return (f"{what} fell from {best:.3f} (step {best_step}) to {evals[-1][1]:.3f} while the training reward "
                    f"rose ({_mean(then):.3g} → {_mean(now):.3g}, z={z:.1f})")
        return None

    def _canary(self, signals: dict[str, float]) -> str | None:
        w = self.cfg.window
        canary, reward = self.series["canary/mean"], self.series["canary/reward_mean"]
        if canary.count >= 2 * w and reward.count == canary.count:
            (r0, r1), (c0, c1) = (reward.first, reward.tail(w)), (canary.first, canary.tail(w))
            z_r, z_c = _z(r0, r1), _z(c0, c1)
            signals["monitor/canary_reward_z"], signals["monitor/canary_z"] = z_r, z_c
            if z_r >= self.cfg.z and z_c <= -self.cfg.canary_z:
                return (f"the training reward rose ({_mean(r0):.3g} → {_mean(r1):.3g}, z={z_r:.1f}) while the canary "
                        f"fell on the same completions ({_mean(c0):.3f} → {_mean(c1):.3f}, z={z_c:.1f})")
        corr, short = self.series["canary/corr"], max(3, w // 2)
        if corr.count >= w + short:  # the first window against the last few checks: a proxy that stops agreeing shows fast
            then, now = _mean(corr.first), _mean(corr.tail(short))
            signals["monitor/canary_corr_drop"] = then - now
            if then - now >= self.cfg.canary_corr_drop:
                return (f"the training reward stopped agreeing with the canary: their correlation on the same completions fell from "
                        f"{then:.2f} (first {w} checks) to {now:.2f} (last {short})")
        unordered = self.series["canary/discordant"]
        if unordered.count >= w + short:  # one completion at a time: what the canary rejects, paid like what it accepts
            then, now = _mean(unordered.first), _mean(unordered.tail(short))
            signals["monitor/canary_discordance_rise"] = now - then
            if now - then >= self.cfg.canary_discordance_rise:
                return (f"the training reward pays what the canary rejects like what it accepts: of the pairs the canary tells "
                        f"apart, {now:.0%} are ordered otherwise or tied by the reward (last {short} checks) against {then:.0%} "
                        f"(first {w})")
        return None

    def _blind(self, signals: dict[str, float]) -> str | None:
        """Prompts with pictures: held-out accuracy rose while the policy answers nearly as well about other rows' pictures."""
        if not self.evaluated or len(self.reliance) < 2 or self.reliance[-1][0] != self.evals[-1][0]:
            return None
        gain = self.evals[-1][1] - self.evals[0][1]
        reliance = self.reliance[-1][1]
        if gain >= self.cfg.accuracy_drop and reliance <= self.cfg.blind_reliance:
            return (f"held-out accuracy rose from {self.evals[0][1]:.3f} to {self.evals[-1][1]:.3f} but is only {reliance:+.3f} above "
                    "the same questions asked about other rows' pictures: the policy answers without looking (a shortcut in the text)")
        return None

    # -- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"series": {k: v.state_dict() for k, v in self.series.items()}, "evals": [list(e) for e in self.evals],
                "at_best": list(self.at_best), "fired": dict(self.fired), "reliance": [list(e) for e in self.reliance],
                "tracked": [list(e) for e in self.tracked], "held_out": self.held_out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.get("series", {}).items():
            if k in self.series:
                self.series[k].load_state_dict(v)
        self.evals = [(int(s), float(a)) for s, a in state.get("evals", [])]
        self.at_best = [float(x) for x in state.get("at_best", [])]
        self.reliance = [(int(s), float(a)) for s, a in state.get("reliance", [])]
        self.fired = {k: int(s) for k, s in state.get("fired", {}).items()}
        held_out = state.get("held_out")  # absent from a checkpoint written before sampled accuracy was followed: greedy
        self.held_out = held_out if held_out in HELD_OUT_KEYS else HELD_OUT_KEYS[1]
        self.tracked = [(int(s), float(a)) for s, a in state.get("tracked", state.get("evals", []))]


def replay(rows: list[dict[str, Any]], cfg) -> list[tuple[int, str]]:
    """The alarms the monitors (`cfg`: a `monitor:` section) raise over a run's `metrics.jsonl` rows, as `(step, line)`:
    how the thresholds were calibrated on finished runs (docs/integrity.md), and how to check an older run."""
    monitor, fired = HackingMonitor(cfg), []
    for r in rows:
        fired += [(r["step"], line) for line in monitor.check(r["step"], r)[1]]
    return fired


def discordance(reward: Sequence[float], canary: Sequence[float]) -> float | None:
    """The share of pairs of completions the canary tells apart that the reward does not order the same way: the canary's
    worse one is paid at least as much (a tie counts). None when the canary scores them all alike.

    Against a verifier canary, a pair is a rejected and an accepted completion, and a discordant one is a rejected
    completion paid like an accepted one: what a hack is made of, counted one completion at a time, where a correlation
    also moves with the honest spread of both rewards."""
    above: list[float] = []  # the rewards of completions the canary scored higher than the level at hand, sorted
    pairs = bad = 0
    by_level = sorted(zip(canary, reward), key=lambda cr: -cr[0])
    for _, level in itertools.groupby(by_level, key=lambda cr: cr[0]):  # canary levels, best first
        paid = [r for _, r in level]
        for r in paid:
            pairs += len(above)
            bad += bisect.bisect_right(above, r)  # better completions paid no more than this one
        for r in paid:
            bisect.insort(above, r)
    return bad / pairs if pairs else None


def _z(before: Sequence[float], after: Sequence[float]) -> float:
    """Welch's z of the rise from `before` to `after` (per-step values taken as independent draws); 0 without spread."""
    mb, ma = _mean(before), _mean(after)
    vb = sum((x - mb) ** 2 for x in before) / max(len(before) - 1, 1)
    va = sum((x - ma) ** 2 for x in after) / max(len(after) - 1, 1)
    se = math.sqrt(vb / len(before) + va / len(after))
    return (ma - mb) / se if se > 0 else 0.0


class Canary:
    """Re-scores a sample of each due step's completions with an independent reward (`monitor.canary`).

    The sample is `n` of the step's completions drawn with a stream seeded by the run's seed and
    the step, so it never moves the run's own random streams and every rank of a `torchrun` job
    draws the same one. The canary scores in this process (no workers; a verifier takes
    microseconds per item, a reward model one batched forward).
    """

    def __init__(self, reward, every: int, n: int, seed: int, timeout: float):
        from assay.rewards.executor import RewardExecutor

        self.every, self.n, self.seed = every, n, seed
        self.executor = RewardExecutor(reward, workers=0, timeout=timeout)

    def check(self, step: int, trajs: list[Trajectory], results: list[RewardResult]) -> dict[str, float]:
        """`canary/*` figures for this step (empty when it is not due or nothing could be scored by both rewards)."""
        if not trajs or step % self.every:
            return {}
        picked = sorted(random.Random(self.seed * 1_000_003 + step).sample(range(len(trajs)), min(self.n, len(trajs))))
        mine = self.executor.score([trajs[i] for i in picked])
        self.executor.stats()  # the canary's counts stay out of the training reward's
        both = [(results[i].score, c.score) for i, c in zip(picked, mine)
                if results[i].score is not None and results[i].error is None and c.score is not None and c.error is None]
        if not both:
            return {}
        train, canary = [float(r) for r, _ in both], [float(c) for _, c in both]
        out = {"canary/mean": _mean(canary), "canary/reward_mean": _mean(train), "canary/n": float(len(both))}
        if len(set(train)) > 1 and len(set(canary)) > 1:  # a correlation needs spread on both sides (all right: none, not 0)
            out["canary/corr"] = pearson(train, canary)
        unordered = discordance(train, canary)
        if unordered is not None:
            out["canary/discordant"] = unordered
        return out

    def close(self) -> None:
        self.executor.close()


def make_canary(cfg, task_reward: str | None):
    """The run's canary, or None: `monitor.canary` when given; `auto`: the task's verifier when a `reward` block trains on
    something else (a run on its task's own verifier has no independent check to add)."""
    spec = cfg.monitor.canary
    if spec is None or not cfg.monitor.enabled:
        return None
    if spec == "auto":
        if cfg.reward is None or task_reward is None or cfg.env is not None:
            return None
        spec = task_reward
    from assay.rewards.spec import build_reward

    return Canary(build_reward(spec, "monitor.canary"), cfg.monitor.canary_every, cfg.monitor.canary_n, cfg.seed, cfg.reward_timeout)


class Watch:
    """A run's monitors and canary together (either may be off): `check` adds their figures, and the alarm lines of
    this step, to a step's metrics; the trainer only shows the alarms and stops on them (`train.on_alarm`)."""

    def __init__(self, monitor: HackingMonitor | None, canary: Canary | None):
        self.monitor, self.canary = monitor, canary

    @classmethod
    def for_run(cls, cfg, task_reward: str | None) -> "Watch":
        """The run's `monitor:` section built (a bad canary block raises here, before the run has a folder)."""
        return cls(HackingMonitor(cfg.monitor) if cfg.monitor.enabled else None, make_canary(cfg, task_reward))

    def check(self, step: int, metrics: dict[str, Any], trajs: list[Trajectory], results: list[RewardResult]) -> list[str]:
        """Add `canary/*`, `monitor/*` and, when a monitor fires, `alarm` and `alarm/<monitor>` to `metrics`; the alarm lines."""
        if self.canary is not None:
            metrics.update(self.canary.check(step, trajs, results))
        if self.monitor is None:
            return []
        signals, alarms = self.monitor.check(step, metrics)
        metrics.update(signals)
        if alarms:
            metrics["alarm"] = "; ".join(alarms)
            metrics.update({f"alarm/{line.split(':', 1)[0]}": 1.0 for line in alarms})
        return alarms

    def drop_canary(self) -> None:
        """No canary (a trainer that checks with its own)."""
        self.close()
        self.canary = None

    def state_dict(self) -> dict[str, Any] | None:
        return self.monitor.state_dict() if self.monitor is not None else None

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.monitor is not None and state:  # absent from checkpoints written before the monitors
            self.monitor.load_state_dict(state)

    def close(self) -> None:
        if self.canary is not None:
            self.canary.close()
