"""The sections of an `assay train` config that other parts own (image sampling, the hacking monitors, a multi-turn
environment, Ray placement), the whole `RunConfig`, and `load_config`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from assay.errors import AssayError
from assay.config.base import Section, apply_override, explain, read_yaml_mapping
from assay.config.sections import (AlgoConfig, CriticConfig, DataConfig, ModelConfig, OptimConfig, PreferenceConfig, RolloutConfig,
                                   SelectionConfig, TrainConfig)


class ImageConfig(Section):
    """How an image policy samples (docs/images.md); each field left null keeps the model's own `sampling` (config.json)."""

    steps: int | None = Field(None, ge=1, le=200)
    """Denoising steps of a training rollout (SDE): the actions of one trajectory."""
    eval_steps: int | None = Field(None, ge=1, le=500)
    """Steps of a greedy (temperature 0) picture: the deterministic ODE, used by evaluation."""
    noise_level: float | None = Field(None, gt=0.0, le=5.0)
    """`a` in Flow-GRPO's σ_t = a·√(t/(1−t)): how much noise each SDE step injects."""
    train_steps: int | None = Field(None, ge=1)
    """How many of a rollout's first (noisiest) steps are actions (SDE steps that train); the later steps follow the ODE (MixGRPO)."""
    shared_noise: bool | None = None
    """A group's pictures start from one noise (DanceGRPO), so they differ only by their SDE steps, the actions."""
    kernel: Literal["sde", "ddim"] | None = None
    """The stochastic step an action is: `sde`, Flow-GRPO's SDE (`noise_level`); `ddim`, the DDIM step with noise `eta`,
    DDPO's sampler (the model's own: `sde`)."""
    eta: float | None = Field(None, gt=0.0, le=1.0)
    """η of the `ddim` kernel: 1 is DDPM's ancestral step (the model's own: 1)."""


class MonitorConfig(Section):
    """Reward-hacking monitors and the canary (docs/integrity.md): alarms every run carries."""

    enabled: bool = True
    """Run the monitors (a few means per step; false: no `monitor/*`, `canary/*` or `alarm` keys)."""
    window: int = Field(10, ge=2)
    """Steps per window: each monitor compares the last `window` steps with the first (or the one before)."""
    length_corr: float = Field(0.3, ge=-1.0, le=1.0)
    """`length` fires when the reward's correlation with length averaged at least this over the last window ..."""
    length_growth: float = Field(0.3, gt=0.0)
    """... and completions grew by at least this share (and one token) over the first window."""
    repetition_rise: float = Field(0.1, gt=0.0)
    """`repetition` fires when the share of repeated 4-grams rose by this much over the first window."""
    accel: float = Field(2.0, ge=1.0)
    """`kl` and `entropy` fire when KL rose (entropy fell) over both of the last two windows, the last change at least
    this many times the one before ..."""
    kl_rise: float = Field(0.5, gt=0.0)
    """... and KL rose by at least this share of its level in one window (`kl`, only when `algo.kl_coef > 0`) ..."""
    entropy_drop: float = Field(0.25, gt=0.0, le=1.0)
    """... or entropy fell by at least this share of its level in one window ..."""
    entropy_floor: float = Field(0.1, ge=0.0)
    """... and by at least this many nats (an entropy already near 0 wobbles by large shares)."""
    saturation: float = Field(0.9, gt=0.0, le=1.0)
    """`saturation` fires when at least this share of groups score all alike over the last window (the reward no longer
    tells completions apart), at most half of them all failing, ..."""
    saturation_verified: float = Field(0.5, ge=0.0, le=1.0)
    """... while the latest verified accuracy (the canary, else held-out accuracy) is at most this."""
    accuracy_drop: float = Field(0.05, gt=0.0, le=1.0)
    """`divergence` fires when held-out accuracy was this far below its best at two evaluations in a row while the training
    reward rose (z ≥ `z`)."""
    z: float = Field(2.0, gt=0.0)
    """How significant a rise of the training reward must be (Welch's z over per-step means)."""
    canary: str | dict[str, Any] | None = "auto"
    """An independent reward that re-scores a sample of completions (a reward block); `auto`: the task's verifier when
    a `reward` block trains on something else; null: none."""
    canary_every: int = Field(1, ge=1)
    """Re-score every this many steps."""
    canary_n: int = Field(64, ge=1)
    """Completions re-scored per check."""
    canary_z: float = Field(1.0, gt=0.0)
    """`canary` fires when the training reward rose (z ≥ `z`) while the canary fell by at least this z."""
    blind_reliance: float = Field(0.05, ge=0.0, le=1.0)
    """`blind` (prompts with pictures) fires when held-out accuracy rose by `accuracy_drop` over the first evaluation while
    it is at most this far above the same questions asked about other rows' pictures (`eval/image_reliance`)."""
    canary_corr_drop: float = Field(0.3, gt=0.0)
    """... or when the correlation of the training reward with the canary (per check, on the same completions), averaged
    over the last max(3, window/2) checks, fell at least this much below its average over the first `window` checks."""
    canary_discordance_rise: float = Field(0.2, gt=0.0, le=1.0)
    """... or when the share of pairs the two order differently (`canary/discordant`: the canary's worse completion paid at
    least as much), averaged over the last max(3, window/2) checks, rose at least this much above its first `window`."""


class EnvConfig(Section):
    """A multi-turn environment (docs/agents.md): each rollout is an episode of it, scored by its reward.

    Without this block every rollout is one completion of the prompt, as before.
    """

    name: str
    """A bundled environment (`calculator`, `sql-agent`, `code-fix`) or a `module:attr` factory of the user's own."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the environment, for example `{syntax: json}`."""
    max_turns: int = Field(4, ge=1)
    """Model turns per episode at most (each at most `rollout.max_new_tokens` tokens)."""
    max_tokens: int | None = Field(None, ge=2)
    """Tokens of a whole episode (prompt, turns and observations) at most (null: the model's context)."""
    max_seconds: float = Field(60.0, gt=0.0)
    """Wall time of one episode at most, checked before each turn."""
    chat: bool = False
    """Prompts and observations through the tokenizer's chat template (observations as `tool` messages),
    for chat models; false: plain text, as the bundled character-level model reads."""


class ClusterConfig(Section):
    """Workers placed by Ray (docs/scaling.md, "Ray"): rollout, reward and learner processes as Ray actors."""

    ray: bool = False
    """Run the workers below as Ray actors (needs the `ray` extra: `pip install 'assay[ray]'`)."""
    address: str | None = None
    """An existing Ray cluster (`auto`, or `ray://HOST:10001`); null: a local cluster started for the run."""
    rollout_workers: int = Field(0, ge=0)
    """Ray actors that generate (each holds the policy, its weights pushed after every update); 0: the learner generates."""
    reward_workers: int = Field(0, ge=0)
    """Ray actors that score (each runs the reward with `reward_workers` processes of its own for isolation);
    0: the learner's own reward executor."""
    learner_workers: int = Field(1, ge=1)
    """Ray actors that train, as the ranks of one FSDP2 job (`torchrun`'s, set up by assay), kept together by a placement group."""
    cpus_per_worker: float = Field(1.0, gt=0.0)
    """CPUs Ray reserves for each actor."""
    gpus_per_learner: float = Field(0.0, ge=0.0)
    """GPUs Ray reserves for each learner actor (one each with `model.device=cuda`; a whole number when there are several)."""
    gpus_per_rollout: float = Field(0.0, ge=0.0)
    """GPUs Ray reserves for each rollout actor."""

    @model_validator(mode="after")
    def _whole_gpus_per_rank(self) -> "ClusterConfig":
        g = self.gpus_per_learner
        if self.learner_workers > 1 and g != int(g):  # a fraction lets Ray pack two ranks onto one GPU, which NCCL refuses
            raise ValueError(f"invalid config value cluster.gpus_per_learner={g!r}: with learner_workers={self.learner_workers} each rank "
                             "trains on a GPU of its own; give 0 or a whole number")
        return self


class RunConfig(Section):
    """A whole `assay train` run."""

    seed: int = 0
    """Seeds prompt order, sampling and initialisation."""
    output_dir: str = "runs"
    """Runs are written to `output_dir/run_name`."""
    run_name: str | None = None
    """Folder name of this run; default: task-and-time stamp."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: str | dict[str, Any] | None = None
    """Reward block (docs/rewards.md); default: the task's own verifier."""
    reward_workers: int = Field(2, ge=0)
    """Reward worker processes (0: score in this process, with no per-item deadline)."""
    reward_timeout: float = Field(5.0, gt=0.0)
    """Seconds one item may take before it is failed."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    env: EnvConfig | None = None
    """A multi-turn environment (docs/agents.md); null: single-turn completions. With an
    environment the default reward is the episode's (`episode`); a `reward` block replaces it."""
    image: ImageConfig = Field(default_factory=ImageConfig)
    """Sampling of an image policy (`policy_kind: image`, docs/images.md); ignored for a language model."""
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    """Reward-hacking monitors and the canary (docs/integrity.md)."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Workers placed by Ray (docs/scaling.md); by default everything runs in this process (or in `torchrun`'s)."""

    @model_validator(mode="before")
    @classmethod
    def _old_section_name(cls, data: Any) -> Any:
        """`sampling:` is the name configs written before 0.2 gave the `selection:` section."""
        if isinstance(data, dict) and "sampling" in data:
            if "selection" in data:
                raise ValueError("invalid config value sampling: give the section once, as selection (sampling is its old name)")
            data = {("selection" if k == "sampling" else k): v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _mismatch_default(self) -> "RunConfig":
        """`algo.mismatch: null` resolves by backend: the in-process samplers (`torch`, and `image`, an image policy's)
        compute the learner's own logprobs, any other backend (or an asynchronous run, whose rollouts come from older
        versions of the policy) gets truncated importance weights."""
        if self.algo.mismatch is None:
            in_process = self.rollout.backend in ("torch", "image") and self.rollout.max_staleness == 0
            self.algo.mismatch = "none" if in_process else "tis"
        return self

    @model_validator(mode="after")
    def _async_backend(self) -> "RunConfig":
        if self.rollout.max_staleness and self.rollout.backend != "torch":
            raise ValueError(f"invalid config value rollout.max_staleness={self.rollout.max_staleness!r}: asynchronous rollouts run their "
                             f"producer on the torch backend for now, not rollout.backend={self.rollout.backend}; set max_staleness=0 "
                             "or backend=torch (docs/async.md)")
        return self

    @model_validator(mode="after")
    def _old_ema_in_process(self) -> "RunConfig":
        if self.algo.old_ema == 0:
            return self
        why = ("rollout.max_staleness > 0 (an asynchronous run's producer has its own older policy)" if self.rollout.max_staleness
               else f"rollout.backend={self.rollout.backend} (an engine holds its own weights)" if self.rollout.backend not in ("torch", "image")
               else "cluster.rollout_workers (Ray actors hold their own weights)" if self.cluster.ray and self.cluster.rollout_workers else None)
        if why is not None:
            raise ValueError(f"invalid config value algo.old_ema={self.algo.old_ema!r}: the moving-average rollout policy must sample "
                             f"in this process, and with {why} it does not; set algo.old_ema=0 or change that")
        return self

    @model_validator(mode="after")
    def _env_without_gold(self) -> "RunConfig":
        if self.env is not None and self.selection.inject_gold:
            raise ValueError("invalid config value selection.inject_gold=True: a reference solution is one completion, "
                             "not an episode of env; switch one of them off")
        return self

    @model_validator(mode="after")
    def _pool_holds_a_batch(self) -> "RunConfig":
        pool, n = self.selection.pool_size, self.rollout.prompts_per_step
        if pool is not None and pool < n:
            raise ValueError(f"invalid config value selection.pool_size={pool!r}: must be at least rollout.prompts_per_step={n}")
        return self


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (optional), apply `key=value` overrides, validate."""
    data: dict[str, Any] = read_yaml_mapping(path) if path else {}
    for item in overrides or []:
        apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, RunConfig)) from None
