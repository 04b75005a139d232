"""Extras: what an advantage estimator can ask the trainer for, one provider per name.

An estimator declares the extras it needs by name (`@declare(needs={"values"})`); the
trainer builds the provider registered under each name once per run and calls it every
step, passing exactly the declared extras to the estimator. A provider may hold state (the
critic behind `values`), train it after the policy update (`after_update`) and save it in
checkpoints (`tensors`, `state_dict`, `load`).

Adding an estimator that needs something new touches two places, the estimator and one
provider (in assay or in the user's own module, registered when it is imported; select
the estimator with `algo.advantage=my_module:shorter_prompts_first`):

    @EXTRAS.register("prompt_len")
    class PromptLength(Extra):
        doc = "[B] prompt length in tokens"

        def __call__(self, step):
            return torch.tensor([len(t.prompt_ids) for t in step.trajs], dtype=torch.float32, device="cpu")

    @declare(needs={"prompt_len"})
    def shorter_prompts_first(rewards, group, mask, prompt_len, scale: float = 0.01):
        return grpo(rewards - scale * prompt_len, group, mask)

`tests/test_extras.py` runs this example through the trainer.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from assay.algos import hyperparameters
from assay.devices import to_cpu
from assay.errors import AssayError
from assay.registry import Registry
from assay.types import RewardResult, Sample, Trajectory


@dataclass
class StepData:
    """What one training step hands to the providers."""

    batch: Any  # assay.batch.Batch
    trajs: list[Trajectory]
    results: list[RewardResult]
    prompts: list[Sample]  # one per group, in group order
    cache: dict[str, Any] = field(default_factory=dict)  # for providers that compute several extras at once


class Extra:
    """Makes one extra for the estimator, built once per run with the trainer it serves.

    Subclasses implement `__call__(step) -> value` (a tensor on any device, which the estimator
    receives on the batch's device, or a number);
    `doc` says what it is, with its shape, for the docs and for error messages.
    """

    doc: str = ""

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def __call__(self, step: StepData) -> Any:
        raise NotImplementedError

    def after_update(self, step: StepData, value: Any) -> dict[str, float]:
        """Called after the policy update with this step's value; returns metrics."""
        return {}

    def tensors(self) -> dict[str, torch.Tensor] | None:
        """Weights to save in checkpoints (None: nothing)."""
        return None

    def state_dict(self) -> dict[str, Any] | None:
        return None

    def load(self, tensors: dict[str, torch.Tensor] | None, state: dict[str, Any] | None) -> None:
        pass

    # -- a torchrun job (`assay.training.sharded`) --------------------------------------
    def shard(self, ranks: Any, bf16: bool) -> None:
        """Shard this extra's model over the job's ranks (nothing to shard: no-op)."""

    def save_shards(self, folder: Path) -> None:
        """Write this extra's shards into the checkpoint `folder` (called on every rank; nothing sharded: no-op)."""

    def load_shards(self, folder: Path) -> bool:
        """Read the shards `save_shards` wrote into `folder`, if it wrote any (True), into any number of ranks or one process."""
        return False


EXTRAS: Registry[type[Extra]] = Registry("extra")


def build_extras(trainer: Any, needs: frozenset[str], estimator: str) -> dict[str, Extra]:
    """The providers of `needs`; one line naming the known extras when one has none."""
    out = {}
    for name in sorted(needs):
        if name not in EXTRAS:
            raise AssayError(f"algo.advantage={estimator!r} needs {name!r}, which no extra provides; known extras: {', '.join(EXTRAS.names())} "
                             "(register one in assay.training.extras.EXTRAS)")
        out[name] = EXTRAS.get(name)(trainer)
    return out


# ---------------------------------------------------------------- read off the batch


@EXTRAS.register("components")
class Components(Extra):
    doc = "[B, K] the reward's named components (sorted by name), NaN where absent"

    def __call__(self, step):
        if step.batch.components.shape[1] == 0:
            raise AssayError(f"algo.advantage={self.trainer.cfg.algo.advantage!r} needs named reward components; "
                             "use a composed reward block (docs/rewards.md)")
        return step.batch.components


@EXTRAS.register("correct")
class Correct(Extra):
    doc = "[B] bool, the reward is at least 1 (unscored: False)"

    def __call__(self, step):
        return torch.nan_to_num(step.batch.rewards, nan=0.0) >= 1.0


@EXTRAS.register("logprobs")
class Logprobs(Extra):
    doc = "[B, T] the sampling policy's logprobs of the completion tokens"

    def __call__(self, step):
        return step.batch.old_logprobs.cpu()


@EXTRAS.register("kl_coef")
class KLCoef(Extra):
    doc = "float, the run's algo.kl_coef"

    def __call__(self, step):
        return self.trainer.cfg.algo.kl_coef


# ---------------------------------------------------------------- computed by the trainer


@EXTRAS.register("ref_logprobs")
class RefLogprobs(Extra):
    doc = "[B, T] the reference policy's logprobs of the completion tokens (the reference is the starting policy)"

    def __init__(self, trainer):
        super().__init__(trainer)
        if trainer.ref is None:
            raise AssayError(f"algo.advantage={trainer.cfg.algo.advantage!r} needs ref_logprobs: set algo.kl_coef > 0 to load a reference model")

    def __call__(self, step):
        from assay.models.logprobs import token_logprobs

        cfg = self.trainer.cfg
        with torch.no_grad():
            lp, _ = token_logprobs(self.trainer.ref, step.batch, cfg.rollout.temperature, fast=cfg.train.fast_forward)
        return lp.cpu()


@EXTRAS.register("greedy_rewards")
class GreedyRewards(Extra):
    doc = "[B] the reward of one greedy rollout of each sample's prompt (ReMax's baseline), NaN where unscored"

    def __call__(self, step):
        from assay.rollout.base import SamplingParams

        t = self.trainer
        with t.generating():
            greedy = t.sampler.generate(step.prompts, 1, SamplingParams(t.cfg.rollout.max_new_tokens, temperature=0.0))
        scores = torch.tensor([float("nan") if r.score is None else r.score for r in t.executor.score(greedy, training=True)],
                              dtype=torch.float32, device=step.batch.group.device)
        return scores[step.batch.group]


def _step_tensors(step: StepData, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    if "steps" not in step.cache:
        from assay.batch import step_tensors

        step.cache["steps"] = step_tensors(step.trajs, step.results, tokenizer)
    return step.cache["steps"]


@EXTRAS.register("step_rewards")
class StepRewards(Extra):
    doc = "[B, S] the reward's per-step scores, NaN-padded"

    def __call__(self, step):
        return _step_tensors(step, self.trainer.tokenizer)[0]


@EXTRAS.register("step_ends")
class StepEnds(Extra):
    doc = "[B, S] the completion token index where each step ends, -1-padded"

    def __call__(self, step):
        return _step_tensors(step, self.trainer.tokenizer)[1]


@EXTRAS.register("values")
class Values(Extra):
    """The learned critic (`assay.training.critic`): V before the update, fitted to the estimator's returns after it.

    The targets are the estimator's `value_targets` (`turn_gae`: each turn's λ-return on the
    turn's first token), by default `gae_targets` (token-level GAE returns). Their discount
    and λ are the estimator's own hyperparameters (its signature's defaults, overridden by
    `algo.advantage_args`), and the extras they read are the estimator's, so the critic's
    targets are the returns its advantages used.
    """

    doc = "[B, T] the critic's values V_t of the state before each completion token"

    def __init__(self, trainer):
        from assay.algos import ADVANTAGES
        from assay.training.critic import Critic, gae_targets

        super().__init__(trainer)
        cfg = trainer.cfg
        self.critic = Critic(trainer.model, cfg.critic, cfg.seed)
        fn = ADVANTAGES.get(cfg.algo.advantage)
        self.targets = getattr(fn, "value_targets", gae_targets)
        args = {**hyperparameters(fn, ("rewards", "group", "mask")), **cfg.algo.advantage_args}
        params = inspect.signature(self.targets).parameters
        self.target = {k: args[k] for k in params if k in args}
        self.target_extras = [k for k in params if k in getattr(fn, "needs", ()) and k != "values"]

    def __call__(self, step):
        return self.critic.values(step.batch)  # on the batch's device; the estimator gets a CPU copy

    def after_update(self, step, value):
        algo, batch = self.trainer.cfg.algo, step.batch
        kw = to_cpu({n: self.trainer.extras[n](step) for n in self.target_extras})  # on the CPU, as the rewards, values and mask
        returns, on = self.targets(batch.rewards.cpu(), value.cpu(), batch.mask.cpu(), **kw, **self.target)
        dev = batch.mask.device
        return self.critic.fit(batch, value, returns.to(dev), on.to(dev), epochs=algo.epochs, minibatches=algo.minibatches)

    SHARDS = "dcp-critic"  # a torchrun job's checkpoint: the critic's weights and AdamW shards, beside the policy's `dcp/`

    def tensors(self):
        return None if self.critic.ranks is not None else self.critic.tensors()  # sharded: in `save_shards`' folder

    def state_dict(self):
        return {"shards": self.SHARDS} if self.critic.ranks is not None else self.critic.state_dict()

    def load(self, tensors, state):
        if tensors is None or state is None:
            raise AssayError(f"--resume: the checkpoint has no critic; algo.advantage={self.trainer.cfg.algo.advantage!r} needs one")
        self.critic.load(tensors, state)

    def shard(self, ranks, bf16):
        self.critic.shard(ranks, bf16)

    def save_shards(self, folder):
        if self.critic.ranks is not None:
            from assay.training.dist import save_sharded

            save_sharded(folder, self.critic.model, self.critic.opt, name=self.SHARDS)

    def load_shards(self, folder):
        if not (Path(folder) / self.SHARDS).is_dir():
            return False
        from assay.training.dist import load_sharded

        load_sharded(folder, self.critic.model, self.critic.opt, name=self.SHARDS)
        return True


# ---------------------------------------------------------------- turns of an episode


def turn_tensors(trajs: list[Trajectory], T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-turn rewards `[B, K]`, the turn of each completion token `[B, T]` and per-turn progress `[B, K]`.

    K is the most turns of any episode in the batch. A row's turn rewards are its episode's
    `info["turn_rewards"]` (None, an unscored turn, as 0; NaN after the last turn); its
    progress is `info["turn_progress"]` (NaN where none). A token of the model's j-th span
    in `Trajectory.turns` belongs to episode turn `info["first_turn"] + j` (a split
    episode's later part starts past 0); every other token to none (−1). A trajectory
    without `turns` is one turn covering its whole completion.

    >>> from assay.types import Sample
    >>> t = Trajectory(Sample("x", "p", "1"), "", [0], [5, 6, 7, 8], [0.0] * 4, True, turns=[(0, 1), (3, 4)],
    ...                info={"turn_rewards": [0.0, 1.0]})
    >>> r, idx, p = turn_tensors([t], 5)
    >>> r, idx
    (tensor([[0., 1.]]), tensor([[ 0, -1, -1,  1, -1]]))
    """
    def n_turns(t: Trajectory) -> int:
        return max(len(t.info.get("turn_rewards") or []), t.info.get("first_turn", 0) + len(t.turns or []), 1)

    K = max([n_turns(t) for t in trajs] + [1])
    rewards = torch.full((len(trajs), K), float("nan"), device="cpu")  # extras are made on the CPU (see `Extra`)
    progress = torch.full((len(trajs), K), float("nan"), device="cpu")
    index = torch.full((len(trajs), T), -1, dtype=torch.long, device="cpu")
    for i, t in enumerate(trajs):
        rewards[i, : n_turns(t)] = 0.0
        for k, r in enumerate(t.info.get("turn_rewards") or []):
            rewards[i, k] = 0.0 if r is None else float(r)
        for k, p in enumerate(t.info.get("turn_progress") or []):
            progress[i, k] = float("nan") if p is None else float(p)
        spans = t.turns if t.turns is not None else [(0, len(t.completion_ids))]
        for j, (a, b) in enumerate(spans):
            index[i, a : min(b, T)] = t.info.get("first_turn", 0) + j
    return rewards, index, progress


def _turn_tensors(step: StepData) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if "turns" not in step.cache:
        step.cache["turns"] = turn_tensors(step.trajs, step.batch.response_len)
    return step.cache["turns"]


@EXTRAS.register("turn_rewards")
class TurnRewards(Extra):
    doc = "[B, K] each episode turn's environment reward (0 where none), NaN after the last turn; a single turn without info: [0]"

    def __call__(self, step):
        return _turn_tensors(step)[0]


@EXTRAS.register("turn_index")
class TurnIndex(Extra):
    doc = "[B, T] long, the episode turn of each completion token, -1 on environment tokens and padding"

    def __call__(self, step):
        return _turn_tensors(step)[1]


@EXTRAS.register("turn_progress")
class TurnProgress(Extra):
    doc = "[B, K] the environment's info['progress'] after each turn, NaN where it measured none"

    def __call__(self, step):
        return _turn_tensors(step)[2]
