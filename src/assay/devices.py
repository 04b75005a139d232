"""The device rule: where tensors are made, who moves them, and how random streams cross devices.

assay runs the same code on a CPU and on a CUDA device, but CI has only a CPU, where a
tensor made on the wrong device is never noticed. So the rule is kept by construction
and checked by a lint (`tests/test_device_rule.py`) over the whole package:

1. **Every tensor factory states its device.** `torch.tensor`, `arange`, `zeros`, `full`,
   `empty`, `rand*`, `Generator`, ... take `device=` (the device of the tensors the new one
   will meet, or `"cpu"` on purpose), or the code uses `new_*` / `*_like`, which inherit it.
2. **Every random draw names its generator through `generator_for(gen, device)`.** A run has
   one CPU stream (`torch.Generator(device="cpu")`, saved in checkpoints). A draw on another
   device gets a generator that lives there, seeded by one draw from the run's stream, so a
   seed means the same thing on every device and resuming needs only the CPU state.
3. **A tensor's owner moves it.** The learner's `Batch` lives wholly on the learner's device
   (every field, the per-row rewards and group ids included), samplers return plain Python
   lists, and rewards never see a tensor. Checkpoints are written device-free (`to_cpu`) and
   read with `map_location="cpu"`; the optimizer moves its state to its parameters' device.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


def generator_for(gen: torch.Generator | None, device: str | torch.device) -> torch.Generator | None:
    """A generator that draws on `device`: `gen` itself when it lives there, else a new one there seeded from `gen`.

    The new generator's seed is one draw from `gen`'s stream, so the sequence of draws stays a
    function of the run's seed; `None` stays `None` (the device's global stream).

    >>> g = torch.Generator(device="cpu").manual_seed(0)
    >>> generator_for(g, "cpu") is g
    True
    """
    if gen is None:
        return None
    device = torch.device(device)
    if gen.device.type == device.type and (device.index is None or gen.device.index in (None, device.index)):
        return gen
    seed = int(torch.randint(0, 2**62, (1,), generator=gen, device=gen.device))
    return torch.Generator(device=device).manual_seed(seed)


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside it (dicts, lists, tuples) moved to the CPU: what a checkpoint saves."""
    if torch.is_tensor(obj):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def check_device(device: str) -> torch.device:
    """`device` as a `torch.device` this machine has; one line naming what is missing otherwise."""
    from assay.errors import AssayError

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise AssayError(f"device {device!r} is not a torch device ({e}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise AssayError(f"device {device!r}: this torch ({torch.__version__}) sees no CUDA device; use cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise AssayError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif dev.type in ("mps", "xpu"):
        backend = getattr(torch.backends, "mps", None) if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            raise AssayError(f"device {device!r}: this torch ({torch.__version__}) sees no {dev.type} device; use cpu or cuda")
    elif dev.type != "cpu":
        raise AssayError(f"device {device!r}: assay runs on cpu or cuda (mps and xpu untested)")
    return dev


def set_matmul_precision(device: torch.device, tf32: bool) -> None:
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (`tf32`), or forbid it; a CPU is left alone."""
    if torch.device(device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32


def release_memory(device: torch.device) -> None:
    """Hand cached, unused device memory back (between rollout and update); nothing to do on a CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def activation_budget_mb(mb: float | None, device: str | torch.device) -> float:
    """`train.micro_batch_mb` resolved for `device`: as given, else 256 MiB on a CPU and an eighth of a GPU's memory."""
    device = torch.device(device)
    if mb is not None:
        return mb
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 8 / 2**20
    return 256.0


@contextlib.contextmanager
def seeded(seed: int, device: str | torch.device = "cpu"):
    """Inside, torch's global random streams of the CPU and of `device` (where it is a GPU) start from `seed`; after, they are
    as they were. For draws that take no generator, such as a library's weight initialisation; other GPUs' streams are not
    touched (`torch.manual_seed` would reseed every GPU's and `fork_rng(devices=[])` restore none)."""
    device = torch.device(device)
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus):
        torch.random.default_generator.manual_seed(seed)
        for i in gpus:
            torch.cuda.default_generators[i].manual_seed(seed)
        yield
