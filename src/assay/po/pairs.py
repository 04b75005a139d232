"""Preference pairs from scored groups, and `assay po pairs`: pairs sampled from a model and scored by any reward.

A group is the G completions of one prompt with their rewards. Completions the reward could
not score (score None) or failed on (an error) take no part. Two ways to pair the rest:

| `pairs` | pairs of a group |
|---|---|
| `best_worst` | the highest-scored completion against the lowest (the first of each among equals): one pair |
| `all` | every two completions whose rewards differ by more than `margin`, the higher one chosen |

Two completions whose rewards differ by `margin` or less are a tie: never a pair, and counted
(`ties`); a group with fewer than two scored completions is counted in `unpaired`.

    >>> from assay.types import RewardResult, Sample, Trajectory
    >>> t = lambda s: (Trajectory(Sample("0", "1+1="), "", [], [], [], True), RewardResult(s))
    >>> got = group_pairs([t(1.0), t(0.0), t(0.0), t(1.0)], "all")
    >>> len(got.pairs), got.ties
    (4, 2)
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from assay.errors import AssayError
from assay.types import RewardResult, Trajectory

MODES = ("best_worst", "all")
Item = tuple[Trajectory, RewardResult]


@dataclass
class Paired:
    """Pairs `(chosen, rejected)` and what was left unpaired."""

    pairs: list[tuple[Item, Item]] = field(default_factory=list)
    ties: int = 0  # comparisons whose rewards differ by at most the margin
    unpaired: int = 0  # groups with fewer than two scored completions

    def add(self, other: "Paired") -> "Paired":
        self.pairs += other.pairs
        self.ties += other.ties
        self.unpaired += other.unpaired
        return self


def group_pairs(items: list[Item], mode: str = "best_worst", margin: float = 0.0) -> Paired:
    """The pairs of one group (see the module doc)."""
    if mode not in MODES:
        raise AssayError(f"pairs={mode!r}: allowed {', '.join(MODES)}")
    scored = [(t, r) for t, r in items if r.score is not None and r.error is None]
    if len(scored) < 2:
        return Paired(unpaired=1)
    if mode == "best_worst":
        best = max(scored, key=lambda x: x[1].score)  # type: ignore[arg-type, return-value]
        worst = min(scored, key=lambda x: x[1].score)  # type: ignore[arg-type, return-value]
        if best[1].score - worst[1].score > margin:  # type: ignore[operator]
            return Paired([(best, worst)])
        return Paired(ties=1)
    out = Paired()
    for i, a in enumerate(scored):
        for b in scored[i + 1 :]:
            d = a[1].score - b[1].score  # type: ignore[operator]
            if abs(d) <= margin:
                out.ties += 1
            else:
                out.pairs.append((a, b) if d > 0 else (b, a))
    return out


def pairs_of(groups: list[list[Item]], mode: str = "best_worst", margin: float = 0.0) -> Paired:
    """The pairs of every group, in group order."""
    out = Paired()
    for g in groups:
        out.add(group_pairs(g, mode, margin))
    return out


def pair_row(chosen: Item, rejected: Item) -> dict[str, Any]:
    """A pair as a row of a preference file (`prompt`, `chosen`, `rejected`, the rewards, the sample's answer and fields)."""
    s = chosen[0].sample
    return {"id": s.id, "prompt": s.prompt, "chosen": chosen[0].completion, "rejected": rejected[0].completion,
            "chosen_reward": chosen[1].score, "rejected_reward": rejected[1].score, "subset": "sampled",
            **({"answer": s.answer} if s.answer is not None else {})}


def sample_pairs(model: str, prompts: int, group_size: int, task: str | None = "arithmetic", task_args: dict | None = None,
                 data: str | None = None, fields: dict | None = None, reward: Any = None, mode: str = "best_worst", margin: float = 0.0,
                 max_new_tokens: int = 6, temperature: float = 1.0, seed: int = 0, backend: str = "torch", device: str = "cpu",
                 server_url: str | None = None, workers: int = 0, chunk: int = 64) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Sample `group_size` completions of each of the first `prompts` training prompts (the seeded order `assay train`
    draws them in), score them with `reward` (default: the task's or data's own), and pair them.

    Completions that stopped at the length limit (no EOS) are left out of pairs: a pair file holds text, and training
    on it appends EOS, which would teach the model to stop where the limit cut it. Returns the rows and counts (`seconds`:
    the time spent generating and scoring)."""
    import torch

    from assay.config import DataConfig, RolloutConfig
    from assay.data.datasets import build_source
    from assay.models import load_policy
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward
    from assay.rollout.base import SamplingParams, make_sampler
    from assay.threads import ThreadGovernor
    from assay.training.groups import split_groups

    if mode not in MODES:
        raise AssayError(f"--pairs {mode!r}: allowed {', '.join(MODES)}")
    if group_size < 2:
        raise AssayError(f"--group-size {group_size}: a pair needs two completions of a prompt")
    dcfg = DataConfig(path=data, fields=fields or {}) if data else DataConfig(task=task, task_args=task_args or {})
    source = build_source(dcfg, seed, 1)
    spec = reward or source.reward
    if spec is None:
        raise AssayError("this data has no built-in verifier; give --reward (a name, module:attr or a YAML block)")
    policy, tok = load_policy(model, device)
    rollout = RolloutConfig(backend=backend, server_url=server_url)
    sampler = make_sampler(backend, policy, tok, rollout, device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    governor = ThreadGovernor(0)  # torch threads follow the cores other processes leave free, as in training
    rows: list[dict[str, Any]] = []
    counts = {"completions": 0.0, "pairs": 0.0, "ties": 0.0, "unpaired_groups": 0.0, "truncated": 0.0, "correct": 0.0, "seconds": 0.0}
    with RewardExecutor(build_reward(spec), workers=workers) as scorer:
        for start in range(0, prompts, chunk):
            batch = source.next_batch(min(chunk, prompts - start))
            governor.update()
            t0 = time.perf_counter()
            trajs = sampler.generate(batch, group_size, SamplingParams(max_new_tokens, temperature=temperature), gen)
            results = scorer.score(trajs)
            counts["seconds"] += time.perf_counter() - t0
            counts["completions"] += len(trajs)
            counts["truncated"] += sum(not t.finished for t in trajs)
            counts["correct"] += sum(r.score is not None and r.score >= 1.0 for r in results)
            groups = [[(t, r) for t, r in g if t.finished] for g in split_groups(trajs, results)]
            got = pairs_of(groups, mode, margin)
            rows += [pair_row(c, r) for c, r in got.pairs]
            counts["ties"] += got.ties
            counts["unpaired_groups"] += got.unpaired
            done = min(start + chunk, prompts)
            if done == prompts or done * 10 // prompts != start * 10 // prompts:  # about every tenth
                print(f"assay: po pairs: {done}/{prompts} prompts, {len(rows)} pairs", file=sys.stderr, flush=True)
    sampler.close()
    counts["pairs"] = float(len(rows))
    return rows, counts


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
