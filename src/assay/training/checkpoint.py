"""Checkpoints in Hugging Face format, with optimizer, scheduler, data and RNG state.

A checkpoint is written to a temporary folder, synced to the disk and renamed into place, and an
old one is renamed out of the way before it is deleted, so an interruption at any moment (SIGKILL,
or the host losing power) never leaves a half-written or half-deleted folder under a checkpoint's
name. Leftovers of an interrupted write or delete start with a dot and are removed by
`clean_leftovers`. A resume takes the newest checkpoint whose files read back whole
(`resumable_checkpoint`), passing over one damaged after it was written.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from assay.devices import to_cpu
from assay.errors import AssayError
from assay.log import log

STATE_FILE = "trainer_state.pt"


def rng_state(generator: torch.Generator | None = None) -> dict[str, Any]:
    """Python's, torch's CPU and (once CUDA is in use) every CUDA device's global streams, and the run's own `generator`."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["sampler"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, Any], generator: torch.Generator | None = None) -> None:
    """Put back what `rng_state` saved; CUDA states only where this machine has as many devices (a CPU resume skips them)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
        torch.cuda.set_rng_state_all(cuda)
    if generator is not None:
        generator.set_state(state["sampler"])


def save_checkpoint(folder: Path, model, tokenizer, state: dict[str, Any], tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                    files: dict[str, str | bytes] | None = None) -> Path:
    """Write model + tokenizer (HF format) and `trainer_state.pt` to `folder`, atomically.

    `tensors` maps a file stem to more weights written beside them (`critic` →
    `critic.safetensors`); read one back with `load_tensors(folder, stem)`. `files` maps
    file names to text or bytes written beside them (`run.json`, a model card and its plots).
    """
    from safetensors.torch import save_file

    from assay.models import quiet_hf, save_tokenizer

    quiet_hf()
    folder = Path(folder)
    tmp = folder.with_name(f".tmp-{folder.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    save_tokenizer(tokenizer, tmp)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if (tmp / "adapter_config.json").is_file() and hasattr(base, "adapter_files"):  # an adapter: what the base's config lacks
        files = {**base.adapter_files(), **(files or {})}
    for name, content in (files or {}).items():
        (tmp / name).write_bytes(content) if isinstance(content, bytes) else (tmp / name).write_text(content)
    for stem, weights in (tensors or {}).items():
        save_file(to_cpu(weights), tmp / f"{stem}.safetensors")
    torch.save(to_cpu(state), tmp / STATE_FILE)  # device-free; last: a folder with this file is complete
    mode = 0o666 & ~_umask()
    for p in tmp.iterdir():
        p.chmod(mode)  # as the user's umask says (safetensors' own writer makes 0600 files)
    publish(tmp, folder)
    return folder


def publish(tmp: Path, folder: Path) -> None:
    """Put the finished folder `tmp` in place as `folder`, durably: its files reach the disk before the rename, and
    the rename before the caller goes on (to prune older checkpoints), so a host that loses power keeps either the
    old checkpoint or the new one whole, never a renamed folder of files the disk never got."""
    sync_tree(tmp)
    if folder.exists():
        _remove(folder)
    os.replace(tmp, folder)
    _fsync(folder.parent)


def sync_tree(folder: Path) -> None:
    """`fsync` every file and folder under `folder` (a filesystem that cannot sync a folder is let be)."""
    for root, _, files in os.walk(folder):
        for name in files:
            _fsync(Path(root) / name)
        _fsync(Path(root))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on a folder (EINVAL); the files themselves were synced
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _remove(folder: Path) -> None:
    """Delete a folder so that no half-deleted copy is ever left under its name."""
    aside = folder.with_name(f".del-{folder.name}")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)


def clean_leftovers(ckpt_dir: Path) -> None:
    """Remove what an interrupted write or delete left behind (`.tmp-*`, `.del-*`)."""
    if ckpt_dir.is_dir():
        for p in [*ckpt_dir.glob(".tmp-*"), *ckpt_dir.glob(".del-*")]:
            shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest finished checkpoint folder (`step_NNNNNN`) under `ckpt_dir`, if any."""
    return next(iter(finished_checkpoints(ckpt_dir)), None)


def finished_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The finished checkpoint folders under `ckpt_dir` (those with `trainer_state.pt`, written last), newest first."""
    if not ckpt_dir.is_dir():
        return []
    done = [p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]), reverse=True)


def resumable_checkpoint(ckpt_dir: Path) -> Path | None:
    """The newest finished checkpoint whose files read back whole (`damage`), for a run to continue from.

    A newer one that does not (a file cut short by a host that lost power before the disk had it, a copy that
    stopped half-way, a byte changed) is passed over with one warning naming it and what is wrong; it stays where
    it is, and the resumed run writes that step again when it gets there. With none whole, one line naming the
    newest one's damage."""
    found, damaged = finished_checkpoints(ckpt_dir), []
    for ckpt in found:
        what = damage(ckpt)
        if what is None:
            for bad, why in damaged:
                if str(bad) not in _WARNED:  # the command reads the config from it, then the trainer resumes: one warning
                    _WARNED.add(str(bad))
                    log.warning(f"checkpoint {bad} is damaged ({why}); taking {ckpt.name}, the newest one that is whole")
            return ckpt
        damaged.append((ckpt, what))
    if found:
        raise AssayError(f"no checkpoint under {ckpt_dir} reads back whole; the newest, {found[0].name}: {damaged[0][1]}")
    return None


_WARNED: set[str] = set()
_SOUND: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) of the files `damage` has read whole in this process


def damage(folder: Path) -> str | None:
    """What in a finished checkpoint folder does not read back whole, or None: `run.json` that is not JSON, a
    `.safetensors` file shorter than its header says, `trainer_state.pt` (a zip archive with a CRC-32 per record) cut
    short or with a record whose checksum does not match. Each file is read once per process."""
    import json
    import zipfile

    for path in sorted(Path(folder).iterdir()):
        if not path.is_file() or path.suffix not in (".json", ".safetensors", ".pt"):
            continue
        stat = path.stat()
        key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key in _SOUND:
            continue
        try:
            if path.suffix == ".json":
                json.loads(path.read_bytes())
            elif path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt"):
                    pass
            else:
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
                if bad is not None:
                    return f"{path.name}: the checksum of its record {bad!r} does not match"
        except Exception as e:  # json, safetensors and zipfile each raise their own types for a file cut short
            return f"{path.name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        _SOUND.add(key)
    return None


def prune_checkpoints(ckpt_dir: Path, keep: int) -> None:
    done = sorted((p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()), key=lambda p: int(p.name.split("_")[1]))
    for p in done[:-keep]:
        _remove(p)


def load_state(folder: Path) -> dict[str, Any]:
    """`trainer_state.pt`, its tensors on the CPU (an optimizer's `load_state_dict` moves them to its parameters' device)."""
    return torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=False)


def load_weights(model, folder: Path) -> None:
    """Put the weights a checkpoint folder's `model.safetensors` holds into `model`, in place.

    A model whose `save_pretrained` writes other names than its modules have (a LLaVA model writes the
    checkpoint layout `language_model.model.…` for its `model.language_model.…`) is read back through
    its own `from_pretrained`, which maps them; a name that still matches nothing is an error, never a
    silently skipped weight. Only a tied weight (the LM head of tied embeddings) may be absent.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    state = load_file(folder / "model.safetensors")
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        fresh = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype)
        result = model.load_state_dict(fresh.state_dict(), strict=False)
    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    missing = [k for k in result.missing_keys if k not in tied]
    if result.unexpected_keys or missing:
        raise AssayError(f"checkpoint {folder}: its weights do not fit the model ({len(missing)} missing, e.g. "
                         f"{(missing or ['-'])[0]!r}; {len(result.unexpected_keys)} unexpected, e.g. {(result.unexpected_keys or ['-'])[0]!r})")


def extra_stem(extra: str) -> str:
    """The checkpoint file stem of an extra's weights, beside the policy's (the critic keeps its old name)."""
    return "critic" if extra == "values" else f"extra-{extra}"


def load_tensors(folder: Path, stem: str) -> dict[str, torch.Tensor]:
    """Weights saved with `save_checkpoint(..., tensors={stem: ...})`."""
    from safetensors.torch import load_file

    return load_file(Path(folder) / f"{stem}.safetensors")
