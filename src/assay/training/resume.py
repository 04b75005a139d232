"""A run's checkpoints, from the trainer's side: the state a step leaves, saving it, and resuming from the latest one.

`Trainer` (`assay.training.rl`) takes these methods from `Checkpoints`; the files themselves (atomic folders, pruning,
random streams) are `assay.training.checkpoint`'s. `ShardedTrainer` overrides where the files of a `torchrun` job
differ: who writes and cleans the folder (`save`, `_clean_checkpoints`), how the policy and optimizer are read
(`_load_policy`), and each rank's own random stream (`_saved_rng`). Everything else a resume restores (data position,
group selection, extras, health, monitors, wall time) is one code path for both.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

from assay.errors import AssayError
from assay.models.lora import load_adapter
from assay.training.async_rollouts import load_versions
from assay.training.checkpoint import (clean_leftovers, extra_stem, load_state, load_tensors, load_weights, prune_checkpoints,
                                       resumable_checkpoint, rng_state, save_checkpoint, set_rng_state)
from assay.training.dist import load_sharded
from assay.training.runs import RUN_FILE, check_same_run, read_record, run_record


class Checkpoints:
    """Save and resume for `Trainer`: reads the attributes its `__init__` sets (the policy, optimizer, scheduler, data
    source, picker, extras, health gates, monitors, the run's generator and folders)."""

    def _state(self) -> dict[str, Any]:
        """What `state.pt` holds besides the tensors: the optimizer, schedule, data position, random streams and the
        state of everything that keeps some across steps."""
        return {
            "step": self.step, "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
            **self._position(), "config": self.cfg.model_dump(mode="json"), "extras": {n: e.state_dict() for n, e in self.extras.items()},
            "health": self.health.state_dict(), "master_weights": self.weights.master_state(),
            "async_health": self.async_health.state_dict(), "wall_s": self._wall(),
            "monitor": self.watch.state_dict(),
        }

    def _position(self) -> dict[str, Any]:
        """Data position, group selection and the run's random stream before the next batch is generated: now, or, with
        a producer that has run ahead, as it recorded them before that batch (the global RNGs are the learner's, now)."""
        if self.async_ is None:
            return {"data": self.source.state_dict(), "rng": rng_state(self.generator), "selection": self.picker.state_dict()}
        pos = self.async_.position(self.step)
        return {"data": pos["data"], "rng": {**rng_state(), "sampler": pos["rng"]["sampler"]}, "selection": pos["selection"]}

    def _wall(self) -> float:
        """Seconds this run has been running (over every resume), evaluations and checkpoints included."""
        return self._wall_offset + time.perf_counter() - self._wall_t0

    def save(self) -> Path:
        """A checkpoint of the current (finished) step; the oldest beyond `train.keep_checkpoints` go."""
        tensors = {extra_stem(n): t for n, e in self.extras.items() if (t := e.tensors()) is not None}
        if self.async_ is not None:  # the older weights that batches still to be generated sample with
            tensors.update(self.async_.version_tensors(self.step))
        if self.old is not None:
            tensors.update(self.old.tensors())
        record = json.dumps(run_record(self.step, self.evaluated_at, self.cfg), indent=1)
        self.sink.sync()
        self.samples.sync()
        self.trackers.flush()
        folder = save_checkpoint(self.ckpt_dir / f"step_{self.step:06d}", self.saved_model, self.tokenizer, self._state(), tensors, {RUN_FILE: record})
        prune_checkpoints(self.ckpt_dir, self.cfg.train.keep_checkpoints, self.step)
        self._saved_at = self.step
        return folder

    def _resume(self) -> None:
        """Continue from the latest finished checkpoint exactly where its step left off."""
        self._clean_checkpoints()
        ckpt = self._checkpoint_to_resume()
        if ckpt is None:
            raise AssayError(f"--resume: no finished checkpoint under {self.ckpt_dir}")
        record = read_record(ckpt)
        check_same_run(record["config"], self.cfg)
        if self.cfg.train.steps < record["step"]:
            raise AssayError(f"--resume: train.steps={self.cfg.train.steps} is below the {record['step']} steps the run has already trained")
        state = load_state(ckpt)
        self._load_policy(ckpt, state)
        self.sched.load_state_dict(state["scheduler"])
        selection = state.get("selection", state.get("sampling"))  # `sampling`: its name before group selection had its own block
        self._restore({"data": state["data"], "selection": selection, "rng": self._saved_rng(ckpt, state)})
        self._load_extras(ckpt, state)
        if self.old is not None:
            self.old.load(ckpt, state["step"])
        self.resumed_health = state.get("health")
        if self.resumed_health is not None:
            self.health.load_state_dict(self.resumed_health)
        if state.get("async_health") is not None:
            self.async_health.load_state_dict(state["async_health"])
        self.watch.load_state_dict(state.get("monitor"))
        self.resumed_versions = load_versions(ckpt)
        self._wall_offset = state.get("wall_s", 0.0)
        self.step, self.evaluated_at, self._saved_at = state["step"], record["evaluated_at"], state["step"]
        self.resumed_from = ckpt
        self.sampler.update_weights(self.model, self.step)

    def _checkpoint_to_resume(self) -> Path | None:
        """The newest checkpoint that reads back whole (`resumable_checkpoint`)."""
        return resumable_checkpoint(self.ckpt_dir)

    def _clean_checkpoints(self) -> None:
        """Remove what an interrupted save left (a half-written folder) before the latest finished one is looked for."""
        clean_leftovers(self.ckpt_dir)

    def _load_policy(self, ckpt: Path, state: dict[str, Any]) -> None:
        """The policy's weights (a LoRA run's adapters) and the optimizer's state, from one process's files or a
        `torchrun` job's shards read whole."""
        if (ckpt / "dcp").is_dir():
            load_sharded(ckpt, self.model, self.opt, trainable_only=self.adapter is not None)
            return
        if self.adapter is not None:
            load_adapter(self.adapter, ckpt)
        else:
            load_weights(self.model, ckpt)
        if self.ref is not None and hasattr(self.model, "tie_weights"):
            self.model.tie_weights()
        self.weights.load_master(state.get("master_weights"))
        self.opt.load_state_dict(state["optimizer"])

    def _saved_rng(self, ckpt: Path, state: dict[str, Any]) -> dict[str, Any]:
        """The random streams to continue with (`rng_state`'s form): one process has one set."""
        return state["rng"]

    def _load_extras(self, ckpt: Path, state: dict[str, Any]) -> None:
        """The extras' weights and state (the critic's): a torchrun job's shards, read into any number of ranks, or the
        files one process wrote."""
        saved = state.get("extras") or {"values": state.get("critic_optimizer")}  # checkpoints before extras had names
        for name, extra in self.extras.items():
            if extra.load_shards(ckpt):
                continue
            weights = load_tensors(ckpt, extra_stem(name)) if (ckpt / f"{extra_stem(name)}.safetensors").is_file() else None
            extra.load(weights, saved.get(name))

    def _snapshot(self) -> dict[str, Any]:
        """What generating a step's rollouts changes (data position, group samplers, RNG), to put back on an interrupt."""
        return {"data": self.source.state_dict(), "selection": copy.deepcopy(self.picker.state_dict()), "rng": rng_state(self.generator)}

    def _restore(self, snap: dict[str, Any]) -> None:
        self.source.load_state_dict(snap["data"])
        if snap["selection"] is not None:  # absent from checkpoints written before group selection existed
            self.picker.load_state_dict(copy.deepcopy(snap["selection"]))
        set_rng_state(snap["rng"], self.generator)
