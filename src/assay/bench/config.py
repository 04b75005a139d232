"""The typed configuration of `assay bench train`: one GRPO step shape run by every framework.

Every field is documented where it is declared; `load_bench_config` turns a mistake into
one `AssayError` line that names the key, the value and what is allowed.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError

from assay.config import Section, explain, read_yaml_mapping
from assay.errors import AssayError


class BenchModelConfig(Section):
    path: str | None = None
    """A bundled model name (`tiny-arith`) or a Hugging Face folder; null: build a random Qwen2 from the sizes below."""
    hidden: int = Field(256, ge=8)
    """Hidden size of the built model."""
    layers: int = Field(4, ge=1)
    """Decoder layers of the built model."""
    heads: int = Field(4, ge=1)
    """Attention heads (and key/value heads) of the built model."""
    intermediate: int = Field(1024, ge=8)
    """MLP inner size of the built model."""
    seed: int = 0
    """Initialisation seed of the built model."""


class BenchConfig(Section):
    """One benchmark: the model, the step shape, and how many steps to time."""

    model: BenchModelConfig = Field(default_factory=BenchModelConfig)
    task: str = "arithmetic"
    """Built-in task whose training prompts and verifier both frameworks use."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the task, for example `{terms: 3}`."""
    prompts_per_step: int = Field(8, ge=1)
    """Distinct prompts per step (U)."""
    group_size: int = Field(8, ge=2)
    """Completions per prompt (G); TRL needs at least 2."""
    max_new_tokens: int = Field(32, ge=1)
    """Completion length limit in tokens, EOS included."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature (top-p 1, no top-k) in both frameworks."""
    lr: float = Field(5e-5, gt=0.0)
    """Adam learning rate, constant (no warm-up schedule) in both frameworks."""
    seed: int = 0
    """Seeds sampling and the prompt order."""
    warmup: int = Field(1, ge=0)
    """Steps run before timing starts."""
    steps: int = Field(5, ge=1)
    """Timed steps."""
    threads: int = Field(0, ge=0)
    """torch CPU threads in every run (0: every core this process may use)."""
    reward_workers: int = Field(0, ge=0)
    """Reward worker processes in assay (0: score in the step's own process, as the TRL reward function does)."""
    trl_gradient_checkpointing: bool = True
    """TRL's own default: each layer's forward is rerun in the backward pass (less memory, about 2·N more FLOPs per token)."""
    matmul_sizes: list[int] = Field(default_factory=lambda: [1024, 1536, 2048], min_length=1)
    """Square fp32 matmul sizes timed for the machine's rate; the best is used."""

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def load_bench_config(path: str | None = None, **overrides: Any) -> BenchConfig:
    """Read a YAML file (optional) and apply top-level overrides that are not None, validated."""
    data: dict[str, Any] = read_yaml_mapping(path) if path else {}
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, BenchConfig, "bench config")) from None

