"""The typed configuration of `assay po train`: YAML plus dotted `key=value` overrides, validated.

Each field is documented where it is declared; `load_po_config` turns any mistake into one
`AssayError` line naming the key, the value and what is allowed (`assay.config.explain`).
The loss and its hyperparameters are checked against the loss's signature and ranges when
the run starts, before any folder is made (`assay.po.losses.loss_args`).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, model_validator

from assay.config import OptimConfig, Section, apply_override, explain, read_yaml_mapping
from assay.errors import AssayError


class PODataConfig(Section):
    path: str | None = None
    """Training pairs: a `.jsonl` (gzipped too) or `.parquet` file, or a `datasets` folder, in any layout of
    docs/preference.md (`prompt`/`chosen`/`rejected` text or messages, whole conversations, an implicit prompt,
    `assay rm pairs` and `assay po pairs` output; `prompt`/`completion`/`label` rows for `kto`). Required."""
    eval_path: str | None = None
    """Held-out pairs in the same layouts; without it, `eval_fraction` of `path`'s prompts are held out."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of `path`'s prompts held out when `eval_path` is not given (a prompt goes wholly to one side)."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column mapping, for example `{prompt: question, chosen: good, rejected: bad}` (keys: prompt, chosen,
    rejected, completion, label, id)."""
    max_length: int | None = Field(None, ge=8)
    """Longest row in tokens (prompt plus its longest response, EOS included); longer rows are left out with a
    count. Null: the model's context (`max_position_embeddings`)."""


class POEvalConfig(Section):
    """Greedy accuracy on a built-in task's held-out split (`eval/accuracy`), beside the held-out pairs' figures."""

    task: str | None = None
    """A built-in task (`arithmetic`, ...) whose held-out problems the policy answers greedily, checked by the
    task's verifier; null: no generation, only the held-out pairs' loss and reward accuracy."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of that task, for example `{terms: 3}`."""
    n: int = Field(500, ge=1)
    """Held-out problems per evaluation."""
    max_new_tokens: int = Field(6, ge=1)
    """Completion length limit of those answers, EOS included."""


class POOptimConfig(OptimConfig):
    """`assay train`'s optimizer settings, with the preference trainer's own defaults."""

    lr: float = Field(1e-5, gt=0.0)
    """AdamW learning rate, constant after the warm-up (so a resumed run that trains longer is still exact)."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in steps."""
    fused: bool = False
    """AdamW's fused kernel (see `assay train`'s `optim.fused`); off here, as in `assay rm train`."""


class POTrainConfig(Section):
    steps: int = Field(500, ge=1)
    """Optimizer steps; each reads `batch_size` rows (epochs wrap around, each in its own seeded order)."""
    batch_size: int = Field(32, ge=1)
    """Rows per step: pairs (2 × this many responses), or labelled responses for an unpaired file."""
    micro_batch: int = Field(0, ge=0)
    """Rows per forward/backward pass, whose gradients add up to the step's (0: the whole batch at once)."""
    eval_every: int = Field(50, ge=0)
    """Held-out figures every this many steps, at step 0 and at the end (0: only at step 0 and the end)."""
    save_every: int = Field(100, ge=0)
    """Checkpoint every this many steps and at the end (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    threads: int = Field(0, ge=0)
    """torch CPU threads. 0: as many as there are cores other processes leave free, re-checked before every
    step (`assay.threads`); N: always N (for bit-for-bit reproducible runs on a machine whose load varies)."""
    time_limit: float = Field(0.0, ge=0.0)
    """Seconds of wall time for the whole run, loading included: the first step that ends past it is the last
    (evaluated, saved, `final/` written) and `po/stopped_early` is 1 in its row (0: no limit)."""
    fast_forward: bool = True
    """Llama-family models run assay's shared-prefix forward (a pair's prompt once for both responses); false:
    the model's own forward (`assay train`'s `train.fast_forward`)."""


class POConfig(Section):
    """A whole `assay po train` run."""

    seed: int = 0
    """Seeds the held-out split and the order of the rows."""
    output_dir: str = "runs"
    """Runs are written to `output_dir/run_name`."""
    run_name: str | None = None
    """Folder name of this run; default: `po-` and a time stamp."""
    model: str = "tiny-arith"
    """The policy to train: a bundled name or a Hugging Face causal-LM folder."""
    reference: str | None = None
    """The reference policy π_ref of the loss (its log-probabilities of every row are computed once, before
    training, and kept in the run folder): a bundled name or a folder; null: `model` as it starts."""
    chat_template: str | None = None
    """A chat template (a Jinja file, or the text) replacing the tokenizer's own, for conversational rows."""
    device: str = "cpu"
    """Torch device: `cpu`, `cuda`, `cuda:1`."""
    dtype: str = "float32"
    """Parameter dtype: `float32` (keep it on a CPU), `bfloat16` or `float16` (fp32 master weights; fp16 with loss scaling),
    as `model.dtype` means for `assay train`."""
    loss: str = "dpo"
    """The preference loss (docs/preference.md): `dpo`, `cdpo`, `robust`, `ipo`, `hinge`, `simpo`, `orpo`, `kto`,
    or `module:function`."""
    loss_args: dict[str, Any] = Field(default_factory=dict)
    """Hyperparameters of the loss, for example `{beta: 0.1}`; checked against its signature and ranges."""
    data: PODataConfig = Field(default_factory=PODataConfig)
    eval: POEvalConfig = Field(default_factory=POEvalConfig)
    optim: POOptimConfig = Field(default_factory=POOptimConfig)
    train: POTrainConfig = Field(default_factory=POTrainConfig)

    @model_validator(mode="after")
    def _needs_data(self) -> "POConfig":
        if not self.data.path:
            raise ValueError("invalid config value data.path=None: give the training pairs, for example data.path=pairs.jsonl "
                             "(`assay rm pairs --out pairs.jsonl` builds some from the bundled task, `assay po pairs` from a model's samples)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"invalid config value dtype={self.dtype!r}: allowed float32, bfloat16, float16")
        return self


#: dotted keys an override may change when a run is resumed
SAFE_ON_RESUME = ("train.steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.threads", "train.time_limit")


def validate(data: dict[str, Any]) -> POConfig:
    try:
        return POConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, POConfig, "po config")) from None


def load_po_config(path: str | None = None, overrides: list[str] | None = None) -> POConfig:
    """Read YAML (optional), apply `key=value` overrides, validate."""
    data: dict[str, Any] = read_yaml_mapping(path) if path else {}
    for item in overrides or []:
        apply_override(data, item)
    return validate(data)
