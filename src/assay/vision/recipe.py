"""The bundled vision-language model's recipe (`assay pretrain tiny-count`): supervised counting on pictures of blocks.

`build_tiny_vlm` puts a new CLIP vision tower in front of the bundled `tiny-arith`; the whole
model is then trained on the `visual_count` task's pictures and questions, with the answer's
tokens (and EOS) as the only targets. A share of the demonstrations (`noise:`) count one block
too many, the systematic error that leaves a model which sees the blocks but answers greedily
with the wrong count — where RL against the verifier has room to help, as with `tiny-arith`'s
forgotten carries. One thread and pinned kernels (`assay.recipes.build.PINNED_KERNELS`), so a
rebuild gives the same bytes. `eval.json` holds the held-out greedy accuracy and pass@k, through
the torch sampler as a run measures them, and the same with the pictures blanked.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

from assay.data.tasks import make_task
from assay.recipes.loop import fit
from assay.types import Sample
from assay.vision.inputs import encode_sample
from assay.vision.model import build_tiny_vlm


def demonstrated(sample: Sample, noise: float, rng: random.Random) -> str:
    """The answer a demonstration gives: the count, or with probability `noise` one more."""
    n = int(sample.answer)
    return str(n + 1 if rng.random() < noise else n)


def sft_batch(tok, samples: list[Sample], answers: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded `input_ids`, `attention_mask`, `labels` (−100 but on each answer's tokens and EOS) and the pictures' inputs."""
    rows, targets, pictures = [], [], []
    for s, a in zip(samples, answers):
        ids, vision = encode_sample(tok, s)
        answer = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(ids + answer)
        targets.append([-100] * len(ids) + answer)
        pictures.append(vision)
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id
    out = {
        "input_ids": torch.tensor([r + [pad] * (width - len(r)) for r in rows], device="cpu"),
        "attention_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device="cpu"),
        "labels": torch.tensor([t + [-100] * (width - len(t)) for t in targets], device="cpu"),
    }
    for k in pictures[0]:
        out[k] = torch.cat([torch.as_tensor(p[k], device="cpu") for p in pictures])
    return out


def evaluate(model, tok, task_name: str, task_args: dict[str, Any], n: int, k: int, max_new_tokens: int, seed: int) -> dict[str, Any]:
    """Held-out greedy accuracy and pass@k through the torch sampler, with the pictures and with them blanked."""
    from assay.eval.policy import evaluate as evaluate_policy
    from assay.rewards.base import REWARDS
    from assay.rollout.torch_sampler import TorchSampler

    out: dict[str, Any] = {}
    for label, blank in (("", False), ("blank_", True)):
        task = make_task(task_name, **{**task_args, "blank": blank})
        res = evaluate_policy(TorchSampler(model, tok), REWARDS.get(task.reward)(), task.heldout(n), max_new_tokens, k=k, seed=seed).as_dict()
        out.update({f"{label}{key}": v for key, v in res.items() if not label or key in ("accuracy", f"pass@{k}")})
    return out


def build_vision_model(name: str, recipe: dict[str, Any], out_dir: Path, seed: int, log=print) -> Path:
    """Train the recipe's tiny VLM and save it with its processor and `eval.json` to `out_dir`."""
    torch.set_num_threads(recipe.get("threads", 1))
    model, tok = build_tiny_vlm(seed=seed, **recipe["model"])
    task = make_task(recipe["task"], **recipe.get("task_args", {}))
    train = recipe["train"]
    rng = random.Random(seed)
    stream = task.stream("train", seed)
    start = time.time()

    def loss_at(step: int) -> torch.Tensor:
        batch = list(itertools.islice(stream, train["batch_size"]))
        return model(**sft_batch(tok, batch, [demonstrated(s, recipe.get("noise", 0.0), rng) for s in batch])).loss

    fit(model, train, name, loss_at)
    ev = recipe.get("eval", {})
    result = evaluate(model, tok, recipe["task"], recipe.get("task_args", {}), ev.get("n", 200), ev.get("k", 8), ev.get("max_new_tokens", 3), seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.processor.save_pretrained(out_dir)
    figures = {"recipe": name, "seed": seed, "seconds": round(time.time() - start, 1), "params": sum(p.numel() for p in model.parameters()), **result}
    (out_dir / "eval.json").write_text(json.dumps(figures, indent=2) + "\n")
    log(f"saved {out_dir}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), file=sys.stderr) if log is print else log(figures)
    return out_dir
