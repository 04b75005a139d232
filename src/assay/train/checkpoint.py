"""Checkpoints in Hugging Face format, with optimizer, scheduler, data and RNG state.

A checkpoint is written to a temporary folder and renamed into place, so an
interruption never leaves a half-written checkpoint where a finished one was expected.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.pt"


def rng_state(generator: torch.Generator) -> dict[str, Any]:
    return {"python": random.getstate(), "torch": torch.get_rng_state(), "sampler": generator.get_state()}


def set_rng_state(state: dict[str, Any], generator: torch.Generator) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    generator.set_state(state["sampler"])


def save_checkpoint(folder: Path, model, tokenizer, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]] | None = None) -> Path:
    """Write model + tokenizer (HF format) and `trainer_state.pt` to `folder`, atomically.

    `tensors` maps a file stem to more weights written beside them (`critic` →
    `critic.safetensors`); read one back with `load_tensors(folder, stem)`.
    """
    from safetensors.torch import save_file

    from assay.models import quiet_hf

    quiet_hf()
    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    for stem, weights in (tensors or {}).items():
        save_file(weights, tmp / f"{stem}.safetensors")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest finished checkpoint folder (`step_NNNNNN`) under `ckpt_dir`, if any."""
    if not ckpt_dir.is_dir():
        return None
    done = [p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    done = sorted((p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()), key=lambda p: int(p.name.split("_")[1]))
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def load_state(folder: Path) -> dict[str, Any]:
    return torch.load(Path(folder) / STATE_FILE, weights_only=False)


def load_tensors(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    """Weights saved with `save_checkpoint(..., tensors={stem: ...})`."""
    from safetensors.torch import load_file

    return load_file(Path(folder) / f"{stem}.safetensors")
