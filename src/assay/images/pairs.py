"""Preference pairs of pictures for an image reward model: `assay rm pairs --task shapes --out pairs.jsonl`.

For each prompt of a picture task's split, an image policy (the bundled `tiny-shapes` by
default) draws a group of pictures with its SDE sampler, each from its own starting noise;
the task's checker scores them (`credit: error`, so a picture one block off beats one three
off), and the group gives up to `per_group` pairs: its best picture against its worst, then
its second best against its second worst, and so on, each pair only where the checker's
scores differ. Pairs are the policy's own pictures, so a scorer trained on them scores the
pictures reinforcement learning will show it, rather than the task's clean drawings.

A row is `{id, prompt, chosen, rejected, subset, chosen_score, rejected_score}`, the pictures
as `data:image/png;base64,…` URIs (lossless; one self-contained file). `subset` is `right`
when the chosen picture is right, else `closer`. The same `(model, task, split, n, seed)`
gives the same file.
"""

from __future__ import annotations

from typing import Any

import torch

from assay.data.tasks import make_task
from assay.errors import AssayError
from assay.rewards.base import REWARDS
from assay.rollout.base import SamplingParams
from assay.types import Trajectory


def build_image_pairs(model: str = "tiny-shapes", task: str = "shapes", task_args: dict[str, Any] | None = None, split: str = "train",
                      n: int = 2000, seed: int = 0, group: int = 8, per_group: int = 2, batch_prompts: int = 16,
                      progress: bool = False) -> list[dict[str, Any]]:
    """`n` pair rows (module doc) drawn by the image policy `model` for prompts of `split` of `task`; `progress`: a bar on
    stderr (pairs made, pictures drawn)."""
    import sys

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from assay.images.flow import load_image_policy
    from assay.images.sampler import ImageSampler
    from assay.images.scorer import to_data_uri
    from assay.models import quiet_hf, resolve_model_path

    if group < 2 or per_group < 1 or 2 * per_group > group:
        raise AssayError(f"group={group}, per_group={per_group}: a group of at least 2 pictures gives at most group/2 pairs")
    t = make_task(task, **(task_args or {}))
    quiet_hf()
    policy, tok = load_image_policy(resolve_model_path(model))
    policy.sampling.shared_noise = False  # each picture its own starting noise: more kinds of mistakes to learn from
    sampler = ImageSampler(policy, tok)
    checker = REWARDS.get(t.reward)(credit="error")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rows: list[dict[str, Any]] = []
    stream = t.stream(split, seed)
    bar = Progress(TextColumn("[bold]rm pairs"), BarColumn(), MofNCompleteColumn(), TextColumn("pairs  {task.fields[info]}"),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=Console(file=sys.stderr), disable=not progress)
    with bar:
        task_id = bar.add_task("pairs", total=n, info="")
        drawn = 0
        while len(rows) < n:
            samples = [s for _, s in zip(range(batch_prompts), stream)]
            if not samples:
                raise AssayError(f"task {task!r} split {split!r} ran out of prompts after {len(rows)} pairs; ask for fewer (--n {len(rows)})")
            trajs = sampler.generate(samples, group, SamplingParams(temperature=1.0, max_new_tokens=1), gen)
            scores = [checker.score(tr).score for tr in trajs]
            for g, sample in enumerate(samples):
                members: list[tuple[float, Trajectory]] = sorted(zip(scores[g * group : (g + 1) * group], trajs[g * group : (g + 1) * group]),
                                                                 key=lambda x: -x[0])
                for k in range(per_group):
                    (hi, good), (lo, bad) = members[k], members[-1 - k]
                    if hi <= lo or len(rows) == n:
                        break
                    rows.append({"id": f"{sample.id}-{len(rows)}", "prompt": sample.prompt, "chosen": to_data_uri(good.info["image"]),
                                 "rejected": to_data_uri(bad.info["image"]), "subset": "right" if hi == 1.0 else "closer",
                                 "chosen_score": round(hi, 6), "rejected_score": round(lo, 6)})
            drawn += len(trajs)
            bar.update(task_id, completed=len(rows), info=f"{drawn} pictures drawn")
    return rows
