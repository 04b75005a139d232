"""The typed run configuration: YAML plus dotted `key=value` overrides, validated.

Every section is a pydantic model that forbids unknown keys; each field is documented
where it is declared. `load_config` turns any mistake into one `AssayError` line that
names the key, the value given and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from assay.errors import AssayError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str = "tiny-arith"
    """A bundled model name (`tiny-arith`) or a Hugging Face causal-LM folder on disk."""
    device: str = "cpu"
    """Torch device for the policy: `cpu`, `cuda`, `cuda:1`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype; keep float32 on CPU (bf16 matmul is hundreds of times slower there)."""


class DataConfig(Section):
    task: str | None = "arithmetic"
    """A built-in task (`arithmetic`, `countdown`); set to null to train on `path`."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the built-in task, for example `{terms: 3, ops: "+-"}`."""
    path: str | None = None
    """User data: a `.jsonl` or `.parquet` file, or a Hugging Face `datasets` folder saved to disk."""
    eval_path: str | None = None
    """Held-out user data in the same format; without it, `eval_fraction` of `path` is held out."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of `path` held out for evaluation when `eval_path` is not given."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column mapping, for example `{prompt: question, answer: solution, id: uid}`."""


class RolloutConfig(Section):
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled per training step."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt (G)."""
    max_new_tokens: int = Field(6, ge=1)
    """Completion length limit in tokens, EOS included."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; the trainer scores tokens under the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""


class AlgoConfig(Section):
    advantage: str = "grpo"
    """Advantage estimator (see docs/algorithms.md)."""
    loss: str = "ppo_clip"
    """Policy loss."""
    aggregation: str = "token-mean"
    """How the per-token loss is reduced to a scalar."""
    advantage_args: dict[str, Any] = Field(default_factory=dict)
    """Hyperparameters of the estimator, for example `{k: 4}` for passk."""
    loss_args: dict[str, Any] = Field(default_factory=dict)
    """Extra hyperparameters of the loss, for example `{dual_clip: 3.0}`."""
    clip_low: float | None = Field(None, ge=0.0)
    """Ratio clip below 1; null: the loss's own default (0.2 for ppo_clip)."""
    clip_high: float | None = Field(None, ge=0.0)
    """Ratio clip above 1 (raise it for DAPO's clip-higher); null: the loss's default."""
    kl_coef: float = Field(0.0, ge=0.0)
    """Weight of the KL-to-reference loss term; 0 loads no reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1, k2 or k3."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Weight of an entropy bonus."""
    epochs: int = Field(1, ge=1)
    """Optimizer passes over each batch of rollouts."""
    minibatches: int = Field(1, ge=1)
    """Optimizer steps per pass (the batch is split into this many parts)."""


class OptimConfig(Section):
    lr: float = Field(5e-5, gt=0.0)
    """Adam learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in training steps."""


class TrainConfig(Section):
    steps: int = Field(200, ge=1)
    """Training steps (one batch of rollouts each)."""
    eval_every: int = Field(20, ge=0)
    """Held-out greedy accuracy every this many steps (0: only at the end)."""
    eval_n: int = Field(500, ge=1)
    """Held-out problems per evaluation."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    threads: int = Field(0, ge=0)
    """torch CPU threads (0: torch's default)."""


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
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in the nested dict `data` (the value is read as YAML)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise AssayError(f"override {item!r} is not key=value (for example train.steps=100)")
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise AssayError(f"override {item!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = _parse_value(value)


def _explain(err: ValidationError, data: dict[str, Any]) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) or True)
    value: Any = data
    for p in e["loc"]:
        value = value.get(p, None) if isinstance(value, dict) else None
    if e["type"] == "extra_forbidden":
        section: type[BaseModel] = RunConfig
        for p in e["loc"][:-1]:
            ann = section.model_fields.get(str(p))
            section = ann.annotation if ann and isinstance(ann.annotation, type) and issubclass(ann.annotation, BaseModel) else section
        allowed = ", ".join(section.model_fields)
        return f"unknown config key {loc!r}; allowed here: {allowed}"
    return f"invalid config value {loc}={value!r}: {e['msg']}"


def load_config(path: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (optional), apply `key=value` overrides, validate."""
    data: dict[str, Any] = {}
    if path:
        p = Path(path)
        if not p.is_file():
            raise AssayError(f"config file {path!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise AssayError(f"config file {path!r} is not valid YAML: {str(e).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise AssayError(f"config file {path!r} must hold a mapping at the top level")
        data = loaded or {}
    for item in overrides or []:
        apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(_explain(e, data)) from None
