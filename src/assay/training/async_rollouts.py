"""Asynchronous rollouts with bounded staleness (`rollout.max_staleness=k`, docs/async.md).

A producer thread generates and scores the batches of the next steps while the learner
trains on the current one. The schedule is fixed, not raced: the batch of step j is sampled
by policy version max(0, j − k) exactly (version v: the weights after v optimizer steps), so

- the learner trains step j on rollouts at most k versions old (`async/staleness_max` ≤ k,
  exactly k once j ≥ k);
- the producer never runs further ahead: before batch j it waits (admission) until the
  learner has published version j − k; it generates each batch once, in order, and nothing
  it finished is dropped. At a stop the batches not yet trained are regenerated on resume,
  the same ones: the checkpoint holds the run's position before the next batch and the
  weights of the versions still to sample with;
- a run is reproducible: which weights sample which batch does not depend on timing, and
  the producer alone draws from the run's random stream and consumes prompts, so a fixed
  seed with fixed thread counts (`train.threads=N`) gives the same metrics and weights
  every time;
- k = 0 is the synchronous schedule (batch j sampled by version j, after update j − 1): the
  pipeline then reproduces the synchronous trainer bit for bit (`tests/test_async.py`).

The producer owns a copy of the policy (a LoRA policy's copy shares the frozen base weights
and copies the adapters alone), its own sampler and tokenizer; the learner publishes its
trainable weights after every update (`Versions`), and the producer loads the version its
next batch needs between batches. On a GPU the same producer holds an inference engine
instead, which takes each version through its weight sync (docs/async.md says what is
verified where).

The loss corrects for the gap with the decoupled PPO objective (Hilton et al., "Batch
size-invariance for policy optimization", arXiv:2110.00641; used for asynchronous LLM RL by
AReaL, Fu et al., arXiv:2505.24298): the learner recomputes the proximal policy π_prox (its
weights at the start of the step) and the loss clips π_θ/π_prox, weighted by the truncated
behaviour ratio π_prox/π_behav of `algo.mismatch` (π_behav: the sampler's logprobs).
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from assay.models import context_length
from assay.rollout.base import make_sampler, sampler_metrics

#: checkpoint file stem of an older policy version's trainable weights (`policy-version-12.safetensors`)
VERSION_STEM = "policy-version-"
#: the learner waited for rollouts more than this share of its time ...
WAIT_WARN = 0.5
#: ... or the staleness correction truncated (or masked) more than this share of tokens ...
CLIP_WARN = 0.5
#: ... for this many steps in a row: a warning (the bound is too tight, or too loose)
WARN_STEPS = 10


def thread_shares(n: int) -> tuple[int, int]:
    """(learner, producer) torch threads out of `n` while both run at once; each at least 1, the learner the larger half."""
    producer = max(1, n // 2)
    return max(1, n - producer), producer


def staleness(trajs: list, version: int) -> dict[str, float]:
    """`async/staleness_mean` and `async/staleness_max`: how many versions older than `version` the trajectories' samplers were."""
    ages = [version - t.version for t in trajs] or [0]
    return {"async/staleness_mean": sum(ages) / len(ages), "async/staleness_max": float(max(ages))}


class Versions:
    """The trainable weights of the policy versions that batches still to be generated may need.

    Only parameters that require grad are kept (a LoRA policy's adapters; every weight under
    full fine-tuning): the rest never change.
    """

    def __init__(self, model):
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.store: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, model) -> None:
        params = dict(model.named_parameters())
        self.store[version] = {n: params[n].detach().clone() for n in self.names}

    def load_into(self, version: int, model) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for n, t in self.store[version].items():
                params[n].copy_(t)

    def keep_from(self, version: int) -> None:
        for v in [v for v in self.store if v < version]:
            del self.store[v]


def load_versions(ckpt: Path) -> dict[int, dict[str, torch.Tensor]]:
    """The older versions' weights a checkpoint of an asynchronous run holds (none for a synchronous run)."""
    from safetensors.torch import load_file

    return {int(p.name[len(VERSION_STEM) : -len(".safetensors")]): load_file(p) for p in Path(ckpt).glob(f"{VERSION_STEM}*.safetensors")}


class Serialised:
    """The run's rewards, one caller at a time: the producer scores batches while the learner evaluates."""

    def __init__(self, inner):
        self.inner = inner
        self.lock = threading.Lock()

    def score(self, batch, *, training: bool):
        with self.lock:
            return self.inner.score(batch, training=training)

    def scorer(self, training: bool):
        return lambda batch: self.score(batch, training=training)

    def heldout_scorers(self):
        return tuple(self._locked(f) for f in self.inner.heldout_scorers())

    def health(self, results, trajs) -> dict[str, float]:
        with self.lock:
            return self.inner.health(results, trajs)

    def _locked(self, fn):
        if fn is None:
            return None

        def call(batch):
            with self.lock:
                return fn(batch)
        return call

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def producer_policy(trainer) -> tuple[Any, Any]:
    """The producer's copy of the policy (sharing the weights that never train) and its sampler, with a tokenizer of its own."""
    from assay.rollout.multiturn import episode_sampler

    cfg = trainer.cfg
    frozen = {id(p): p for p in trainer.model.parameters() if not p.requires_grad}
    model = copy.deepcopy(trainer.model, memo=frozen).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tokenizer = copy.deepcopy(trainer.tokenizer)
    sampler = make_sampler(cfg.rollout.backend, model, tokenizer, cfg.rollout, trainer.device)
    if cfg.env is not None:
        sampler = episode_sampler(sampler, model, tokenizer, cfg.env, context_length(model))
    return model, sampler


@dataclass
class AsyncHealth:
    """Streaks behind the two warnings of an asynchronous run (`check`)."""

    wait_streak: int = 0
    clip_streak: int = 0

    def check(self, metrics: dict[str, float]) -> str | None:
        """A warning when the learner has mostly waited, or the correction mostly clipped, for `WARN_STEPS` steps in a row."""
        step_s = max(metrics.get("perf/step_s", 0.0), 1e-9)
        waited = metrics.get("async/learner_idle_s", 0.0) / step_s
        clipped = metrics.get("mismatch/corrected_frac", 0.0)
        self.wait_streak = self.wait_streak + 1 if waited > WAIT_WARN else 0
        self.clip_streak = self.clip_streak + 1 if clipped > CLIP_WARN else 0
        out = []
        if self.wait_streak and self.wait_streak % WARN_STEPS == 0:
            held = metrics.get("async/producer_idle_s", 0.0) / step_s
            out.append(f"the learner waited for rollouts {waited:.0%} of the last step ({WARN_STEPS} steps in a row above {WAIT_WARN:.0%}), "
                       f"the producer {held:.0%} for admission: " + ("rollout.max_staleness is too tight for the variation in step times; "
                       "raise it" if held > 0.1 else "generation is the bottleneck; a larger rollout.max_staleness will not help, "
                       "more of the machine for generation (or fewer completions per step) will"))
        if self.clip_streak and self.clip_streak % WARN_STEPS == 0:
            out.append(f"the staleness correction truncated or masked {clipped:.0%} of tokens ({WARN_STEPS} steps in a row above "
                       f"{CLIP_WARN:.0%}): the policy moves too far in rollout.max_staleness versions; lower it, or optim.lr")
        return "; ".join(out) or None

    def state_dict(self) -> dict[str, int]:
        return {"wait_streak": self.wait_streak, "clip_streak": self.clip_streak}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.wait_streak, self.clip_streak = state["wait_streak"], state["clip_streak"]


class AsyncRollouts:
    """The producer thread and the learner's side of it (see the module docstring).

    Args:
        trainer: the run (`assay.training.rl.Trainer`) at the step it continues from; its
            rollouts are drawn with the producer's sampler from now on.
        k: `rollout.max_staleness`.
        split_threads: give the learner and the producer each a share of the run's torch
            threads (default: when k > 0, where they run at the same time).
    """

    def __init__(self, trainer, k: int, split_threads: bool | None = None):
        self.trainer, self.k = trainer, k
        self.split = k > 0 if split_threads is None else split_threads
        self.start, self.end = trainer.step, trainer.cfg.train.steps
        self.model, self.sampler = producer_policy(trainer)
        self.sampler.update_weights(self.model, trainer.step)
        trainer.rollout_model, trainer.rollout_sampler = self.model, self.sampler
        trainer.executor = Serialised(trainer.executor)
        self.versions = Versions(trainer.model)
        self.versions.store.update(getattr(trainer, "resumed_versions", {}))
        self.versions.publish(trainer.step, trainer.model)
        self.positions = {trainer.step: trainer._snapshot()}  # the run's position before each batch: what a checkpoint saves
        self.ready: dict[int, tuple] = {}  # step → its rollout, as `Trainer.collect` returns it
        self.cond = threading.Condition()
        self.stopping = False
        self.error: BaseException | None = None
        self.idle, self.waiting_since = 0.0, None
        self.thread = threading.Thread(target=self._run, name="assay-producer", daemon=True)
        self.thread.start()

    # -- the producer thread -------------------------------------------------------------
    def _run(self) -> None:
        try:
            for step in range(self.start, self.end):
                version = max(0, step - self.k)
                if not self._admit(version):
                    return
                with self.cond:
                    self.versions.load_into(version, self.model)
                self.sampler.update_weights(self.model, version)
                threads = self.trainer.threads.threads
                torch.set_num_threads(thread_shares(threads)[1] if self.split else threads)
                rollout = self.trainer._collect()
                rollout[2].update(sampler_metrics(self.sampler))
                position = self.trainer._snapshot()
                with self.cond:
                    self.ready[step] = rollout
                    self.positions[step + 1] = position
                    self.cond.notify_all()
        except BaseException as e:  # handed to the learner, which raises it at its next batch
            with self.cond:
                self.error = e
                self.cond.notify_all()

    def _admit(self, version: int) -> bool:
        """Wait until `version` is published (the bound); False when the run is stopping."""
        with self.cond:
            self.waiting_since = time.perf_counter()
            while version not in self.versions.store and not self.stopping:
                self.cond.wait()
            self.idle += time.perf_counter() - self.waiting_since
            self.waiting_since = None
            return not self.stopping

    # -- the learner's side --------------------------------------------------------------
    def take(self, step: int) -> tuple:
        """The rollout of `step` (waiting for it), as `Trainer.collect` returns it, with the `async/*` metrics added.

        Its start time is when the learner began to wait, so `perf/step_s` is the learner's whole step.
        """
        threads = self.trainer.threads.update()
        if self.split:
            torch.set_num_threads(thread_shares(threads)[0])
        t0 = time.perf_counter()
        with self.cond:
            depth = sum(j >= step for j in self.ready)
            while step not in self.ready:
                if self.error is not None:
                    raise self.error
                if not self.thread.is_alive():
                    raise RuntimeError(f"the rollout producer stopped before step {step + 1}'s batch")
                self.cond.wait(0.1)
            item = self.ready.pop(step)
            now = time.perf_counter()
            producer_idle = self.idle + (now - self.waiting_since if self.waiting_since is not None else 0.0)
            self.idle = 0.0
            if self.waiting_since is not None:
                self.waiting_since = now
            for j in [j for j in self.positions if j < step]:
                del self.positions[j]
        trajs, results, metrics, _ = item
        metrics.update(staleness(trajs, step))
        metrics.update({"async/queue_depth": float(depth), "async/learner_idle_s": now - t0, "async/producer_idle_s": producer_idle})
        return trajs, results, metrics, t0

    def publish(self, version: int) -> None:
        """The learner's weights after an update are `version`; versions no batch still to come needs are let go."""
        with self.cond:
            self.versions.publish(version, self.trainer.model)
            self.versions.keep_from(max(0, version - self.k))
            self.cond.notify_all()

    def position(self, step: int) -> dict[str, Any]:
        """The run's data, selection and random-stream state before the batch of `step` was generated (for a checkpoint)."""
        with self.cond:
            return self.positions[step]

    def version_tensors(self, step: int) -> dict[str, dict[str, torch.Tensor]]:
        """The weights of the versions that the batches of `step` onwards sample with, older than `step` (for a checkpoint)."""
        with self.cond:
            return {f"{VERSION_STEM}{v}": dict(self.versions.store[v]) for v in range(max(0, step - self.k), step)}

    def close(self) -> None:
        """Stop the producer after the batch it is generating (never mid-batch) and let go of its sampler."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        while self.thread.is_alive():
            self.thread.join(0.1)
        self.sampler.close()
