"""Training past one process: ranks under `torchrun`, the policy sharded with FSDP2, sharded checkpoints.

`torchrun --nproc-per-node N -m assay train ...` starts N copies of the same loop (`Ranks.from_env`
joins them: NCCL between GPUs, gloo between CPU processes). Every rank holds the same prompt
source, so each step's prompts are the same list everywhere; a rank generates and scores only its
share, whole groups each (`Ranks.share`), and the trajectories and rewards are then gathered so
that every rank sees the whole step — the same list, in the same order, as one process would
have. Everything that decides from the whole batch (metrics, group selection, advantages) runs on
it identically everywhere; only the update splits again: a rank trains on its share of the groups,
its loss scaled by the whole batch's denominator, and FSDP2 sums the gradients (`shard`), so the
step is the single-process step up to the order of floating-point sums.

The policy is sharded with `torch.distributed.fsdp.fully_shard`, each decoder layer and then the
root: a rank keeps 1/N of every weight and of AdamW's state. Generation needs the whole weights:
`full_weights` gathers them for the rollout and shards them again before the update. With
`model.dtype=bfloat16`, FSDP2's mixed precision keeps fp32 shards (the master weights) and
computes and gathers in bf16, reducing gradients in fp32. Checkpoints are written with
`torch.distributed.checkpoint`: every rank writes its own shard, nothing is gathered on one rank,
and a checkpoint loads into any number of ranks (`save_sharded`, `load_sharded`); `final/` is the
one place the whole model is assembled, on rank 0, as an ordinary Hugging Face folder.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NoReturn

import torch

from assay.errors import AssayError


@dataclass
class Ranks:
    """This process's place among the run's processes (rank 0 of 1 without `torchrun`)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, device: torch.device) -> "Ranks":
        """Join the process group `torchrun` describes (`WORLD_SIZE`, `RANK`, `LOCAL_RANK`), or stay alone."""
        import torch.distributed as dist

        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if device.type == "cuda" and device.index is not None:  # every rank would take that one GPU
            raise AssayError(f"model.device={device}: with {world} processes each trains on its own GPU (cuda:LOCAL_RANK); "
                             "give model.device=cuda")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if not dist.is_initialized():
            if device.type == "cuda":
                torch.cuda.set_device(local)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), local)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def device(self, requested: torch.device) -> torch.device:
        """`cuda` means this rank's own GPU (`cuda:LOCAL_RANK`) when there are several ranks."""
        if self.active and requested.type == "cuda" and requested.index is None:
            return torch.device("cuda", self.local_rank)
        return requested

    def share(self, n: int, rank: int | None = None) -> slice:
        """This rank's contiguous share of `n` items (shares differ in size by at most one)."""
        r = self.rank if rank is None else rank
        base, extra = divmod(n, self.world)
        start = r * base + min(r, extra)
        return slice(start, start + base + (r < extra))

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (`[obj]` alone)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj`, on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on any (a signal that reached one rank stops them all)."""
        return any(self.gather(bool(flag)))

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self, clean: bool = True) -> None:
        """Leave the process group, after a barrier that lets gloo's worker threads finish and free the
        collectives still in flight while the interpreter is alive: without it, an all-gather freed on a worker
        thread that needs the GIL during interpreter shutdown aborts the process ("terminate called without an
        active exception"; 5 exits in 30 on a busy 2-core machine, 2 in 110 with it, none with `exit_rank` too). `clean`: every rank got here
        the same way (the run finished, or one signal stopped them all). After an error on one rank the others
        may never arrive: gloo's barrier then gives up after a few seconds, and NCCL's is skipped."""
        import datetime

        import torch.distributed as dist

        if not (self.active and dist.is_initialized()):
            return
        try:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60 if clean else 5))
            elif clean:
                dist.barrier()
        except RuntimeError:
            pass  # a rank that never came: leave anyway
        dist.destroy_process_group()


def exit_rank(code: int | None) -> NoReturn:
    """End a `torchrun` rank's process with `code`: the exit handlers run (`atexit`: temporary folders, worker
    pools, loggers), then the process leaves without tearing the interpreter down. gloo frees a finished
    collective on its own worker thread, which takes the GIL to drop the tensors' Python objects; when that
    falls after the interpreter began to shut down, the thread is killed inside a destructor and the process
    aborts ("terminate called without an active exception", exit −6) after a run that finished and saved
    everything (the barrier in `Ranks.close` makes it rare, not impossible)."""
    import atexit
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(int(code or 0))


class NullSink:
    """What a rank other than 0 writes its metrics and samples to: nothing (rank 0 writes the run's files)."""

    def log(self, step: int, row: dict) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass


def weighted_mean(ranks: Ranks, metrics: dict[str, float], weight: float, sums: tuple[str, ...] = ("actor/loss",)) -> dict[str, float]:
    """Each key's mean over ranks, weighted by each rank's `weight` (its share of the batch); the keys in `sums`
    (a loss divided by the whole batch's denominator on every rank) are sums of shares already and are added."""
    rows = ranks.gather((metrics, weight))
    total = sum(w for _, w in rows) or 1.0
    keys = sorted({k for m, _ in rows for k in m})
    out = {}
    for k in keys:
        parts = [(m[k], w) for m, w in rows if k in m]
        out[k] = sum(v for v, _ in parts) if k in sums else sum(v * w for v, w in parts) / (sum(w for _, w in parts) or total)
    return out


def shard(model, ranks: Ranks, bf16: bool = False):
    """Shard `model` over the ranks with FSDP2: every decoder layer, then the root. Gradients are summed, not
    averaged (each rank's loss already carries its share of the batch's denominator); with `bf16`, fp32 shards
    computed and gathered in bf16, gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for layer in _layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    for module in fsdp_modules(model):
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum: gloo has no pre-multiplied sum (PREMUL_SUM)
    return model


def _layers(model) -> list:
    """The decoder layers, each an FSDP2 unit: `model.layers` of the Llama family's body (a critic's `backbone`), else the
    model's list of `num_hidden_layers` blocks wherever it lives (GPT-2's `transformer.h`, GPT-NeoX's `gpt_neox.layers`)."""
    body = getattr(model, "model", None) or getattr(model, "base_model", None) or getattr(model, "backbone", None)  # a critic's
    layers = getattr(body, "layers", None)
    if layers is not None:
        return list(layers)
    n = getattr(getattr(model, "config", None) or getattr(body, "config", None), "num_hidden_layers", None)
    found = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and n and len(m) == n), None)
    return list(found) if found is not None else []


def fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    return bool(fsdp_modules(model))


@contextlib.contextmanager
def full_weights(model) -> Iterator[None]:
    """Every weight whole on every rank for the block (generation), sharded again after it; a no-op unsharded."""
    modules = fsdp_modules(model)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()


def _options(trainable_only: bool, **kw):
    """`StateDictOptions` for a model whose frozen weights stay out of its checkpoints (a LoRA policy's base)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only, **kw)


def _state_dicts(model, optimizer, trainable_only: bool) -> tuple[dict, dict]:
    """The model's and optimizer's state dicts, sharded; with `trainable_only` no frozen weight (DCP's own option keeps a
    frozen weight tied to another name, such as a tied `lm_head`: dropped here by name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    if trainable_only:
        keep = {n for n, p in model.named_parameters() if p.requires_grad}
        msd = {k: v for k, v in msd.items() if k in keep}
    return msd, osd


def engine_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """A sharded policy's weights for an inference engine, as `assay.models.lora.merged_weights` names them, gathered one
    FSDP2 unit at a time: the root's own (embeddings, final norm, LM head), then each decoder layer, each copied out and
    its unit sharded again before the next is gathered, so no rank holds more than one unit whole beside its shards (and
    what the engine still holds of what it was given). Every rank must consume it, in step: each gather is collective."""
    from assay.models.lora import merged_weights

    units = [(prefix, m) for prefix, m in model.named_modules() if prefix and m in set(fsdp_modules(model))]
    inner = tuple(f"{prefix}." for prefix, _ in units)
    for prefix, unit in [("", model), *units]:
        unit.unshard()
        try:
            for name, tensor in merged_weights(unit, skip=inner if unit is model else ()):
                yield (f"{prefix}.{name}" if prefix else name), tensor.clone()  # the gathered buffer is freed by reshard
        finally:
            unit.reshard()


def save_sharded(folder: Path, model, optimizer, trainable_only: bool = False, name: str = "dcp") -> None:
    """The model's and optimizer's shards under `folder/name` (every rank writes its own; call on every rank).
    `trainable_only`: the weights that train and nothing frozen (a LoRA run: the adapters, not the base)."""
    import torch.distributed.checkpoint as dcp

    msd, osd = _state_dicts(model, optimizer, trainable_only)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(Path(folder) / name))


def load_sharded(folder: Path, model, optimizer, trainable_only: bool = False, name: str = "dcp") -> None:
    """Load `save_sharded`'s checkpoint into `model` and `optimizer`, however many ranks wrote it and however many read it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    msd, osd = _state_dicts(model, optimizer, trainable_only)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(Path(folder) / name))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_options(trainable_only))


def full_state(model, optimizer=None, trainable_only: bool = False) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The whole model's state (and the optimizer's, keyed by parameter name) on rank 0's CPU; call on every rank."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    options = _options(trainable_only, full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, optimizer, options=options) if optimizer is not None else None
    return msd, osd


def load_full_state(model, optimizer, msd: dict[str, torch.Tensor], osd: dict | None) -> None:
    """Load a whole state (a single-process checkpoint's) into the sharded `model` and `optimizer`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, msd, options=options)
    if osd is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=options)


def named_optimizer_state(model, state: dict) -> dict:
    """A single-process AdamW `state_dict()` (keyed by parameter index) keyed by parameter name, as DCP expects."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out_state = {names[i]: s for i, s in state["state"].items()}
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": out_state, "param_groups": groups}
