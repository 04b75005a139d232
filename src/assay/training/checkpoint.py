"""Checkpoints in Hugging Face format, with optimizer, scheduler, data and RNG state.

A checkpoint is written to a temporary folder, synced to the disk and renamed into place, and an
old one is renamed out of the way before it is deleted, so an interruption at any moment (SIGKILL,
or the host losing power) never leaves a half-written or half-deleted folder under a checkpoint's
name. Leftovers of an interrupted write or delete start with a dot and are removed by
`clean_leftovers`. A resume takes the newest checkpoint whose files read back whole
(`resumable_checkpoint`), passing over one damaged after it was written.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import struct
import zipfile
import zlib
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
            if os.path.isfile(path := os.path.join(root, name)) and not os.path.islink(path):  # not a link, a pipe, a socket
                _fsync(Path(path))
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
    stopped half-way, a byte changed) is passed over with one warning naming it and what is wrong; the resumed run's
    next checkpoint sets it aside (`prune_checkpoints`). With none whole, one line naming the newest one's damage.
    A file that cannot be read at all (no permission, an I/O error) is one line too, never a reason to go back."""
    found, damaged = finished_checkpoints(ckpt_dir), []
    for ckpt in found:
        try:
            what = damage(ckpt)
        except FileNotFoundError:  # pruned or replaced while it was read: a run is writing here
            continue
        if what is None:
            for bad, why in damaged:
                # the command reads the config from it, then the trainer resumes: one warning, and under torchrun rank 0's
                if str(bad) not in _WARNED and os.environ.get("RANK", "0") == "0":
                    _WARNED.add(str(bad))
                    log.warning(f"checkpoint {bad} is damaged ({why}); taking {ckpt.name}, the newest one that is whole")
            return ckpt
        damaged.append((ckpt, what))
    if damaged:
        raise AssayError(f"no checkpoint under {ckpt_dir} reads back whole (the newest, {damaged[0][0].name}: {damaged[0][1]}); "
                         f"`assay train --restart {Path(ckpt_dir).parent}` starts the run again from the beginning")
    return None


_WARNED: set[str] = set()
_SOUND: set[tuple[str, int, int]] = set()  # (path, size, mtime_ns) of the files `damage` has read whole in this process

#: a record of a `.pt` archive up to this size has its CRC-32 checked; a larger one (the optimizer's moments of a large
#: embedding) only its place in the file, so choosing a checkpoint costs far less than a second read of the state
CRC_LIMIT = 256 << 20


def damage(folder: Path) -> str | None:
    """What in a finished checkpoint folder does not read back whole, or None.

    Checked: there are weights (`*.safetensors` or a torchrun job's `dcp/`); every JSON file parses; every
    `.safetensors` file is as long as its header says; a `.pt` archive's records lie within the file and those up to
    `CRC_LIMIT` match their CRC-32s; a sharded index names files that are there; `dcp/` (and `dcp-critic/`) has its
    `.metadata` and every shard it lists is as long as it says. Each file is read once per process. A file that cannot
    be read (no permission, an I/O error) is an `AssayError`; one that vanished meanwhile, `FileNotFoundError`."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
    if not any(p.suffix == ".safetensors" for p in files) and not (folder / "dcp").is_dir():
        return "no weights in it (no .safetensors file, no dcp/)"
    for path in files:
        what = _file_damage(path)
        if what is not None:
            return f"{path.relative_to(folder)}: {what}"
    for index in folder.glob("*.safetensors.index.json"):
        missing = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()) - {p.name for p in files})
        if missing:
            return f"{index.name} names {missing[0]}, which is not there"
    for sub in ("dcp", "dcp-critic"):
        if (folder / sub).is_dir() and (what := _dcp_damage(folder / sub)) is not None:
            return f"{sub}/{what}"
    return None


@contextlib.contextmanager
def _readable(path: Path):
    """A file that vanished goes on as `FileNotFoundError` (a run is writing here); one that cannot be read (no
    permission, an I/O error) is one line, never taken for damage."""
    try:
        yield
    except FileNotFoundError:
        raise
    except OSError as e:
        raise AssayError(f"cannot read {path}: {e.strerror or e}") from None


def _file_damage(path: Path) -> str | None:
    from safetensors import SafetensorError

    if path.suffix not in (".json", ".safetensors", ".pt"):
        return None
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key in _SOUND:
        return None
    try:
        with _readable(path):
            if path.suffix == ".json":
                json.loads(path.read_bytes())
            elif path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="pt") as f:  # opening reads the header and checks the file's length
                    f.metadata()
            else:
                what = _archive_damage(path, stat.st_size)
                if what is not None:
                    return what
    except (ValueError, EOFError, zipfile.BadZipFile, zlib.error, struct.error, SafetensorError) as e:  # what a cut or changed file raises
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    _SOUND.add(key)
    return None


def _archive_damage(path: Path, size: int) -> str | None:
    """What is wrong with the zip archive `torch.save` writes (one stored record per tensor), or None."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.header_offset + info.compress_size > size:
                return f"its record {info.filename!r} runs past the end of the file"
            if info.file_size <= CRC_LIMIT:
                try:
                    with archive.open(info) as f:
                        while f.read(1 << 24):  # read to its end, where zipfile compares the record's CRC-32
                            pass
                except zipfile.BadZipFile:
                    return f"the checksum of its record {info.filename!r} does not match"
    return None


def _dcp_damage(folder: Path) -> str | None:
    """What is wrong with a `torch.distributed.checkpoint` folder: its `.metadata`, or a shard it lists missing or cut short."""
    if not (folder / ".metadata").is_file():
        return ".metadata is missing"
    from torch.distributed.checkpoint import FileSystemReader

    with _readable(folder / ".metadata"):
        try:
            metadata = FileSystemReader(str(folder)).read_metadata()
        except OSError:
            raise
        except Exception as e:  # an unpickling error of any type: the file is cut or changed
            return f".metadata: {type(e).__name__}"
    for info in (metadata.storage_data or {}).values():
        shard = folder / info.relative_path
        if not shard.is_file():
            return f"{info.relative_path} is missing"
        if info.offset + info.length > shard.stat().st_size:
            return f"{info.relative_path} is shorter than .metadata says"
    return None


def prune_checkpoints(ckpt_dir: Path, keep: int, saved: int | None = None) -> None:
    """Delete all but the newest `keep` finished checkpoints. With `saved` (the step just written), a checkpoint of a
    later step is one a resume passed over as damaged (`resumable_checkpoint`): it is set aside as `damaged-step_N`,
    out of what resumes and pruning see, for a person to look at."""
    done = sorted((p for p in ckpt_dir.glob("step_*") if (p / STATE_FILE).is_file()), key=lambda p: int(p.name.split("_")[1]))
    if saved is not None:
        for p in [p for p in done if int(p.name.split("_")[1]) > saved]:
            aside = p.with_name(f"damaged-{p.name}")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(p, aside)
            done.remove(p)
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
