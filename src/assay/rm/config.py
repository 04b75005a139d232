"""The typed configuration of `assay rm train`: YAML plus dotted `key=value` overrides, validated.

Each field is documented where it is declared; `load_rm_config` turns any mistake into one
`AssayError` line naming the key, the value and what is allowed (`assay.config.explain`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from assay.config import LoraSettings, OptimConfig, Section, apply_override, explain, read_yaml_mapping
from assay.errors import AssayError


class RMDataConfig(Section):
    path: str | None = None
    """Training pairs: a `.jsonl` (gzipped too) or `.parquet` file, or a `datasets` folder, with
    `prompt`, `chosen`, `rejected` columns (RewardBench rows as they are; RewardBench 2 rows,
    whose chosen and rejected are lists, give every chosen × rejected pair). Required."""
    eval_path: str | None = None
    """Held-out comparisons in the same layouts; without it, `eval_fraction` of `path`'s prompts are held out."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of `path`'s prompts held out when `eval_path` is not given (a prompt goes wholly to one side)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column mapping, for example `{prompt: question, chosen: good, rejected: bad}`."""
    max_length: int = Field(256, ge=8)
    """Longest sequence (prompt + response + EOS) in tokens; a longer one loses tokens from its start."""
    step_separator: str = "\n"
    """`kind=prm`: what joins a row's steps into its completion when the row names no `separator` of its own."""


class RMLossConfig(Section):
    margin: float = 0.0
    """m in −log σ(r_c − r_r − m): the chosen reward must clear the rejected one by m (Llama 2's margin loss)."""
    center_coef: float = Field(0.0, ge=0.0)
    """η of the reward-centering term η·(r_c + r_r)² (Eisenstein et al., arXiv 2312.09244); 0: off."""
    length_coef: float = Field(0.0, ge=0.0)
    """λ of the length-debiasing term λ·corr(reward, length)² over each batch (ODIN, arXiv 2402.07319); 0: off."""


class RMOptimConfig(OptimConfig):
    """`assay train`'s optimizer settings, with the reward model's own defaults."""

    lr: float = Field(1e-4, gt=0.0)
    """AdamW learning rate, constant after the warm-up (so a resumed run that trains longer is still exact)."""
    warmup_steps: int = Field(20, ge=0)
    """Linear learning-rate warm-up, in steps."""
    fused: bool = False
    """AdamW's fused kernel (see `assay train`'s `optim.fused`); off here: the figures in
    docs/reward-models.md were measured with the per-tensor loop."""


class RMTrainConfig(Section):
    steps: int = Field(1000, ge=1)
    """Optimizer steps; each reads `batch_size` pairs (epochs wrap around, each in its own seeded order)."""
    batch_size: int = Field(64, ge=1)
    """Pairs per step (2 × this many sequences per forward); for `kind=prm`, step-labelled rows per step."""
    eval_every: int = Field(100, ge=0)
    """Held-out pairwise accuracy every this many steps and at the end (0: only at the end)."""
    save_every: int = Field(200, ge=0)
    """Checkpoint every this many steps and at the end (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    threads: int = Field(0, ge=0)
    """torch CPU threads. 0: as many as there are cores other processes leave free, re-checked
    before every step (`assay.threads`, as `assay train` does); N: always N (for bit-for-bit
    reproducible runs on a machine whose load varies)."""
    time_limit: float = Field(0.0, ge=0.0)
    """Seconds of wall time for the whole run, loading included: the first step that ends past it is
    the last (evaluated, saved, `final/` written) and `rm/stopped_early` is 1 in its row (0: no limit)."""


class RMConfig(Section):
    """A whole `assay rm train` run."""

    kind: Literal["orm", "prm", "image"] = "orm"
    """`orm`: an outcome model on preference pairs (Bradley–Terry); `prm`: a process reward model on
    step-labelled rows (`assay rm label-steps`, PRM800K), a score per step trained with binary cross-entropy;
    `image`: a picture scorer on pairs of pictures (`assay rm pairs --task shapes`), Bradley–Terry too
    (`assay.images.scorer`, docs/images.md)."""
    seed: int = 0
    """Seeds the score head, the held-out split and the order of the pairs."""
    output_dir: str = "runs"
    """Runs are written to `output_dir/run_name`."""
    run_name: str | None = None
    """Folder name of this run; default: `rm-` and a time stamp."""
    model: str = "tiny-arith"
    """The causal LM the reward model starts from: a bundled name or a Hugging Face folder. For
    `kind=image`, the image policy (for example `tiny-shapes`) whose tokenizer and picture size a
    new scorer takes."""
    device: str = "cpu"
    """Torch device: `cpu`, `cuda`, `cuda:1`."""
    dtype: str = "float32"
    """Parameter dtype: `float32` (keep it on a CPU), `bfloat16` or `float16` (fp32 master weights; fp16 with loss scaling),
    as `model.dtype` means for `assay train`."""
    lora: LoraSettings | None = None
    """Train low-rank adapters and the score head instead of every weight (`peft`; the `lora` extra),
    for example `{r: 8, alpha: 16}`: checkpoints hold the adapters and the head, `final/` the merged
    sequence classifier that `rm eval` and the `rm` reward read (docs/lora.md). Null: every weight trains."""
    data: RMDataConfig = Field(default_factory=RMDataConfig)
    loss: RMLossConfig = Field(default_factory=RMLossConfig)
    optim: RMOptimConfig = Field(default_factory=RMOptimConfig)
    train: RMTrainConfig = Field(default_factory=RMTrainConfig)

    @model_validator(mode="after")
    def _needs_data(self) -> "RMConfig":
        if not self.data.path:
            raise ValueError("invalid config value data.path=None: give the training pairs, for example data.path=pairs.jsonl "
                             "(`assay rm pairs --out pairs.jsonl` builds some from the bundled task; for kind=prm, "
                             "`assay rm label-steps --out steps.jsonl` builds step labels)")
        if self.kind == "image" and (self.lora is not None or self.dtype != "float32" or self.loss.length_coef):
            what = "lora" if self.lora is not None else "loss.length_coef" if self.loss.length_coef else f"dtype={self.dtype}"
            raise ValueError(f"invalid config value {what} with kind=image: a picture scorer trains every weight in float32, "
                             "and pictures have no length")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"invalid config value dtype={self.dtype!r}: allowed float32, bfloat16, float16")
        return self


#: dotted keys an override may change when a run is resumed
SAFE_ON_RESUME = ("train.steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.threads", "train.time_limit")


def validate(data: dict[str, Any]) -> RMConfig:
    try:
        return RMConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, RMConfig, "rm config")) from None


def load_rm_config(path: str | None = None, overrides: list[str] | None = None) -> RMConfig:
    """Read YAML (optional), apply `key=value` overrides, validate."""
    data: dict[str, Any] = read_yaml_mapping(path) if path else {}
    for item in overrides or []:
        apply_override(data, item)
    return validate(data)
