"""The sections of an `assay train` config that say what is trained and how: the model (and its LoRA adapters), the
data, the rollout, the algorithm, the critic, prompt selection, preference objectives, the optimizer and the loop."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from assay.config.base import Section


class LoraSettings(Section):
    """Low-rank adapters on the policy's linear layers (Hu et al., "LoRA: Low-Rank Adaptation of Large
    Language Models", arXiv:2106.09685): a layer computes W·x + (alpha/r)·B·A·x with W frozen."""

    r: int = Field(8, ge=1)
    """Rank of each adapter (A is r × in, B is out × r)."""
    alpha: float = Field(16.0, gt=0.0)
    """Scale numerator: the adapter's output is multiplied by alpha / r."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input while training. Above 0, the update runs the model's own
    forward (assay's fused forward folds B·A into W, which dropout on the adapter alone forbids)."""
    target_modules: list[str] | str = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    """Names of the linear layers that get adapters (`peft`'s `target_modules`), or `all-linear`.
    Default: every attention and MLP projection of a Llama-family model."""


class ModelConfig(Section):
    path: str = "tiny-arith"
    """A bundled model name (`tiny-arith`) or a Hugging Face causal-LM folder on disk."""
    device: str = "cpu"
    """Torch device for the policy (and its sampler, reference and critic): `cpu`, `cuda`, `cuda:1`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype. `float32`: weights, gradients and AdamW state in fp32 (on a CPU keep it:
    bf16 matmuls are hundreds of times slower there). `bfloat16` (a GPU's choice): the policy's
    weights are bf16 — the sampler decodes and the learner runs forward and backward with them —
    and the optimizer keeps fp32 master weights and moments, so small updates are not rounded
    away; logprobs and the loss are fp32 either way (`assay.training.precision`). `float16`:
    the same with fp16 weights and dynamic loss scaling (`actor/loss_scale`), for GPUs without bf16 (V100, T4);
    where bf16 runs, prefer it: fp16's narrow range costs skipped steps and scale changes bf16 never needs."""
    tf32: bool = True
    """On a CUDA device, let fp32 matmuls use TF32 tensor cores (`torch.backends.cuda.matmul.allow_tf32`);
    false keeps them in full fp32. No effect on a CPU or on bf16 weights."""
    chat_template: str | None = None
    """A chat template (a Jinja file, or the template text) that replaces the tokenizer's own;
    it is saved with the trained model. Null: the tokenizer's own template, if it has one."""
    disable_dropout: bool = True
    """Set every dropout of the policy (and so of its reference and critic) to 0, as TRL's `disable_dropout` does: the
    learner scores tokens in training mode, and dropout there would make its logprobs differ from the sampler's (an
    importance ratio off 1 before any update; `mismatch/*`). False keeps the model's own dropout rates."""
    freeze: list[str] = Field(default_factory=list)
    """Parameters left untrained: regular expressions, each searched in every parameter's name (`vision_tower` freezes a
    LLaVA model's vision tower; `embed_tokens` the embeddings). Each must match a parameter; the summary's
    `trainable parameters` counts what is left. Empty: every weight trains (or only the adapters, with `lora`)."""
    lora: LoraSettings | None = None
    """Train low-rank adapters instead of every weight (`peft`'s LoRA; the `lora` extra,
    `pip install 'assay[lora]'`), for example `{r: 8, alpha: 16}`: only the adapters train and
    are checkpointed, the KL reference is the same model with its adapter switched off (no
    second copy), and `final/` holds the adapter (`assay export --merge` folds it into the base
    weights; docs/lora.md). Null: full fine-tuning."""


DEFAULT_TASK = "arithmetic"


class DataConfig(Section):
    task: str | None = DEFAULT_TASK
    """A built-in task (`arithmetic`, `countdown`, `sql-agent`, `code-fix`). With `path` the file is the
    data and the task is null (the default task gives way; naming another task as well is an error)."""
    task_args: dict[str, Any] = Field(default_factory=dict)
    """Arguments of the built-in task, for example `{terms: 3, ops: "+-"}`."""
    path: str | None = None
    """User data: a `.jsonl` or `.parquet` file, or a Hugging Face `datasets` folder saved to disk."""
    eval_path: str | None = None
    """Held-out user data in the same format; without it, `eval_fraction` of `path` is held out."""
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of `path` held out for evaluation when `eval_path` is not given."""
    fields: dict[str, str] = Field(default_factory=dict)
    """Column mapping, for example `{prompt: question, answer: solution, id: uid}`; with
    `format`, the format's own column names: `{question: q}` reads GSM8K's question from `q`."""
    format: str | None = None
    """A standard dataset layout (`gsm8k`, `math`, `mbpp`, `humaneval`, `apps`): its columns
    and answer convention become prompts, references and tests, and its reward is chosen
    (docs/data.md). Null: rows with `prompt`/`answer`/`id` (renamed with `fields`)."""
    chat: bool = False
    """Send a plain-text prompt to the model as one user message through its chat template
    (conversational rows, whose prompt is a list of messages, always go through it)."""
    system_prompt: str | None = None
    """A system message put first in every conversation that has none of its own."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the chat template, for example `{enable_thinking: false}`; a row's
    own `chat_template_kwargs` column overrides them."""
    overlong: Literal["error", "drop", "truncate"] = "error"
    """A prompt longer than the model's context less `rollout.max_new_tokens`: `error` (one
    line naming it), `drop` it (with a count), or `truncate` it from the left."""

    @model_validator(mode="before")
    @classmethod
    def _file_or_task(cls, data: Any) -> Any:
        """`path` and `task` both name the training data: the default task gives way to a file; another task, its
        `task_args`, or the settings of a file without one are mistakes, one line each."""
        if not isinstance(data, dict):
            return data
        task = data.get("task", DEFAULT_TASK)
        if data.get("path") is not None:
            if task not in (None, DEFAULT_TASK):
                raise ValueError(f"invalid config value data.task={task!r}: data.path={data['path']!r} is the training data; "
                                 "give one of them (data.task=null trains on the file)")
            if data.get("task_args"):
                raise ValueError(f"invalid config value data.task_args={data['task_args']!r}: task arguments apply to a built-in "
                                 f"task, and data.path={data['path']!r} is the training data")
            return {**data, "task": None}
        for key in ("format", "fields", "eval_path"):
            if data.get(key):
                raise ValueError(f"invalid config value data.{key}={data[key]!r}: it applies to a data file, and data.path is not set "
                                 "(set data.path=FILE)")
        return data


class RolloutConfig(Section):
    backend: str = "torch"
    """Generation backend: `torch` (in-process sampler over the learner's own model), `vllm`
    (a vLLM engine in this process), `openai` (an OpenAI-compatible server at `server_url`),
    or a `module:attr` factory (`assay.rollout.base.SAMPLERS`; docs/engines.md)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts sampled per training step."""
    group_size: int = Field(8, ge=1)
    """Completions per prompt (G). 1 is refused with an estimator that compares a completion with
    its group (GRPO, RLOO, ...: `declare(groups=True)`), whose advantages would all be 0."""
    max_new_tokens: int = Field(6, ge=1)
    """Completion length limit in tokens, EOS included. 6 fits the bundled tasks; a run on a data
    file warns once when most of a step's completions stop at the limit."""
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; the trainer scores tokens under the same temperature."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling threshold."""
    cuda_graphs: bool = True
    """`torch` on a CUDA device: record one decoding step as a CUDA graph and replay it for every
    token (the step's ~25 kernels per layer then cost one launch; docs/performance.md, "On a GPU")."""
    compile: bool = False
    """`torch`: run the decoding step and the token draw through `torch.compile` (Inductor fuses their
    small operations; the first generation compiles, tens of seconds). Off by default until measured on a GPU
    (`benchmarks/gpu_check.py`, row `assay-decode-compiled`)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """`vllm`: extra keyword arguments of `vllm.LLM` (for example `{gpu_memory_utilization: 0.5,
    max_model_len: 4096}`); they override assay's choices."""
    sleep: bool | None = None
    """`vllm`: release the engine's GPU memory (vLLM's sleep mode) while the learner updates
    (null: on when the policy is on a CUDA device; vLLM has no sleep mode on CPU)."""
    verify_sync: bool = True
    """`vllm`, `openai`: after each weight sync, check that the engine's logprobs of a fixed
    probe equal the learner's, and stop with one line when they do not."""
    sync_tolerance: float | None = Field(None, gt=0.0)
    """Largest mean |Δ logprob| of that check (null: 1e-3 in float32, 5e-2 in bfloat16, 2e-2 in float16)."""
    server_url: str | None = None
    """`openai`: the server's base URL, for example `http://127.0.0.1:8000` (a trailing `/v1` is allowed)."""
    server_model: str | None = None
    """`openai`: the model name the server knows (null: the first one it lists at `/v1/models`)."""
    api_key_env: str = "OPENAI_API_KEY"
    """`openai`: the environment variable holding the server's API key (sent when set)."""
    max_concurrency: int = Field(8, ge=1)
    """`openai`: requests in flight at once."""
    request_timeout: float = Field(120.0, gt=0.0)
    """`openai`: seconds one request may take."""
    max_retries: int = Field(3, ge=0)
    """`openai`: retries of a request that failed to connect, timed out or got a 5xx/429 answer (with backoff)."""
    max_staleness: int = Field(0, ge=0)
    """Asynchronous rollouts (docs/async.md): with k > 0 a producer thread generates and scores the
    next batches while the learner trains, each batch sampled by the policy exactly k versions older
    than the one it trains (fewer in the first k steps); the producer pauses rather than run further
    ahead, and no finished trajectory is dropped. The loss's ratio then follows decoupled PPO
    (`algo.mismatch`, `tis` by default). 0: the synchronous loop, generation and update in turn."""
    weight_sync: Literal["auto", "push", "none"] = "auto"
    """`openai`: `push` the learner's weights after each update through vLLM's weight-transfer
    routes (the server runs with `VLLM_SERVER_DEV_MODE=1` and assay's `assay_http` transfer
    backend); `none`: a fixed server, trained off-policy with the staleness logged; `auto`:
    push when the server offers the routes, else `none` with a warning."""


class AlgoConfig(Section):
    objective: str = "pg"
    """How scored groups become an update: `pg` (policy gradient: the advantage estimator and policy loss
    below); a preference loss (`dpo`, `cdpo`, `robust`, `ipo`, `hinge`, `simpo`, `orpo`, `kto`): online
    iterative preference training on pairs formed from each step's groups (`preference:`); `raft`: SFT on
    each group's best completions (docs/preference.md)."""
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
    mismatch: Literal["none", "tis", "mis"] | None = None
    """Rollout/trainer mismatch correction: `tis` truncates, `mis` masks the importance weight
    π_trainer/π_sampler (with one optimizer step per batch the update's own forward gives π_trainer;
    with several, `epochs` or `minibatches` > 1, it costs one extra forward pass per step) (`none`: off; null: `tis`
    for an engine backend such as `vllm` or `openai` and for `rollout.max_staleness` > 0, `none`
    for `torch`). With staleness this is decoupled PPO's behaviour weight (docs/async.md)."""
    mismatch_cap: float = Field(2.0, gt=0.0)
    """Upper bound on that weight (tis: truncated to it; mis: tokens above it are masked)."""
    mismatch_floor: float = Field(0.0, ge=0.0)
    """mis only: tokens whose weight is below this are masked too."""
    mismatch_level: Literal["token", "sequence"] = "token"
    """One weight per token, or one per response (the product of its token ratios)."""
    old_ema: float = Field(0.0, ge=0.0, lt=1.0)
    """The rollout ("old") policy trails the trained one as a moving average, θ_old ← d·θ_old + (1 − d)·θ after each
    step, d rising to this (DiffusionNFT's soft update of the sampling policy; docs/images.md). It samples the batches
    and gives the loss π_old (a text policy's logprobs, a picture generator's v_old); evaluation and the saved weights
    are the trained policy. 0: the rollout policy is the trained one (the loop without it). Runs in one process, with
    the in-process samplers and no `rollout.max_staleness`."""
    old_ema_rate: float | None = Field(0.001, gt=0.0)
    """How much d rises a step (DiffusionNFT: 0.001 up to 0.5, or 0.0075 after 75 steps up to 0.999); null: d is
    `old_ema` from the first step."""
    old_ema_after: int = Field(0, ge=0)
    """Steps with d = 0 before it starts to rise."""

    @model_validator(mode="after")
    def _floor_below_cap(self) -> "AlgoConfig":
        if self.mismatch_floor >= self.mismatch_cap:
            raise ValueError(f"invalid config value algo.mismatch_floor={self.mismatch_floor!r}: must be below algo.mismatch_cap={self.mismatch_cap!r}")
        return self


class CriticConfig(Section):
    """The learned value model that `gae`, `evpo` and `turn_gae` need; built only for an estimator that needs `values`.

    It is a copy of the policy's backbone with a scalar head, trained by its own AdamW on
    the clipped value loss, with the epochs and minibatches of `algo`.
    """

    lr: float = Field(1e-4, gt=0.0)
    """Critic learning rate (constant; the critic has no warm-up)."""
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the critic's gradient norm to this value."""
    value_clip: float | None = Field(0.2, gt=0.0)
    """PPO value clipping: V may move at most this far from its rollout-time value (null: unclipped)."""


class SelectionConfig(Section):
    """Group selection (docs/algorithms.md, "Group selection"): which prompts to roll out, which groups to train on."""

    prompts: Literal["stream", "variance"] = "stream"
    """`stream`: the source's seeded order; `variance`: the variance-prioritised sampler over a pool of recent prompts."""
    pool_size: int | None = Field(None, ge=1)
    """`variance`: how many recent prompts are candidates (null: 4 × rollout.prompts_per_step)."""
    var_prior: float = Field(0.25, ge=0.0)
    """`variance`: the variance assumed for a prompt never rolled out (0.25: the largest of a 0/1 reward)."""
    var_decay: float = Field(0.5, ge=0.0, lt=1.0)
    """`variance`: weight of the old estimate in the moving average of a prompt's reward variance."""
    var_floor: float = Field(0.01, gt=0.0)
    """`variance`: added to every variance, so a prompt with variance 0 can still be drawn."""
    var_temperature: float = Field(1.0, ge=0.0)
    """`variance`: priority = (variance + floor) ** temperature (0: uniform)."""
    retry: bool = False
    """Keep prompts the policy could not solve in a retry buffer and roll them out again."""
    retry_frac: float = Field(0.25, ge=0.0, le=1.0)
    """Share of each step's prompts taken from the retry buffer when it holds any."""
    retry_max: int = Field(3, ge=1)
    """Failed retries after which a prompt is given up."""
    retry_capacity: int = Field(1024, ge=1)
    """Most prompts the buffer holds (the oldest leave first)."""
    dynamic: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal and generate more to refill the batch."""
    max_rounds: int = Field(3, ge=1)
    """`dynamic`: generation rounds per step at most (the bound on extra generation)."""
    inject_gold: bool = False
    """When every completion of a group failed, put the verified reference solution in place of its worst one."""
    gold_field: str = "answer"
    """Where the reference completion is: `answer`, or the name of a data field."""
    success: float = 1.0
    """A reward at or above this counts as solved (retry buffer, ground-truth injection)."""


class PreferenceConfig(Section):
    """Online preference training and best-of-N SFT: `algo.objective` other than `pg` (docs/preference.md).

    Each step samples a group per prompt and scores it, as GRPO does; then pairs are formed
    from each group and the loss named by `algo.objective` takes `algo.epochs` passes of
    `algo.minibatches` optimizer steps over them (`raft`: SFT on each group's best completions).
    """

    loss_args: dict[str, Any] = Field(default_factory=dict)
    """Hyperparameters of the loss named by `algo.objective`, for example `{beta: 0.1}` (checked against
    its signature and ranges when the run starts)."""
    pairs: Literal["best_worst", "all"] = "best_worst"
    """Which pairs of a group: its best completion against its worst, or every two whose rewards differ by more than `margin`."""
    margin: float = Field(0.0, ge=0.0)
    """Two completions whose rewards differ by this much or less are a tie: never a pair, and counted (`po/ties`)."""
    reference: Literal["round", "initial"] = "round"
    """The loss's reference policy: `round`, the policy as the step began (refreshed every step); `initial`,
    the starting model, kept for the whole run."""
    raft_keep: int = Field(1, ge=1)
    """`raft`: the best completions of each group trained on, at most."""
    raft_min_reward: float = 1.0
    """`raft`: a completion is trained on only when its reward is at least this (1: verified right, for a verifier)."""
    canary_floor: float = Field(0.5, ge=0.0, le=1.0)
    """With a reward that gives no verdicts (a judge, a self-judge) and a task verifier beside it: warn when the
    verifier agrees with the reward's choice on fewer than this share of the step's pairs (`canary/pair_agreement`)."""


class OptimConfig(Section):
    lr: float = Field(5e-5, gt=0.0)
    """Adam learning rate."""
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, gt=0.0)
    """Clip the global gradient norm to this value."""
    warmup_steps: int = Field(10, ge=0)
    """Linear learning-rate warm-up, in training steps."""
    decay: Literal["constant", "linear", "cosine"] = "constant"
    """After the warm-up: `constant`, or a `linear` or `cosine` decay toward `min_lr_ratio` × `lr` at `train.steps`."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """Where `linear` and `cosine` decay to, as a fraction of `lr`."""
    fused: bool = True
    """AdamW's fused kernel (`torch.optim.AdamW(fused=True)`): one pass over each parameter instead
    of a dozen elementwise ops (same update to rounding). False: the per-tensor loop."""


class TrainConfig(Section):
    steps: int = Field(200, ge=1)
    """Training steps (one batch of rollouts each)."""
    report_to: list[Literal["tensorboard", "wandb", "mlflow", "trackio"]] = Field(default_factory=list)
    """Experiment trackers that get every metric row, the config and the report's plots, besides
    `metrics.jsonl` (any of `tensorboard`, `wandb`, `mlflow`, `trackio`; each an optional extra)."""

    @field_validator("report_to", mode="before")
    @classmethod
    def _one_tracker(cls, v: Any) -> Any:
        """`train.report_to=tensorboard` is the list of that one tracker."""
        return [v] if isinstance(v, str) else v
    eval_every: int = Field(20, ge=0)
    """Held-out greedy accuracy (and `eval_samples`) every this many steps (0: only at the end)."""
    eval_n: int = Field(500, ge=1)
    """Held-out problems per evaluation."""
    eval_samples: int = Field(0, ge=0, le=64)
    """Besides the greedy completion, this many sampled at `rollout.temperature` per held-out problem, the same
    draws at every evaluation (seeded by `seed`): `eval/sampled_accuracy` (the policy as it is sampled, what training
    moves) and `eval/pass@k`. 0: greedy only."""
    save_every: int = Field(50, ge=0)
    """Checkpoint every this many steps (0: only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """How many of the newest checkpoints to keep."""
    threads: int = Field(0, ge=0)
    """torch CPU threads. 0: as many as there are cores other processes leave free,
    re-checked before every step (`assay.threads`); N: always N (set it for bit-for-bit
    reproducible runs on a machine whose load varies)."""
    micro_batch_mb: float | None = Field(None, ge=0.0)
    """Activation memory one forward/backward pass may keep, in MiB (estimated from the model's
    sizes): a longer minibatch is split into micro-batches, shortest rows first, whose
    gradients accumulate to one optimizer step equal to the whole minibatch's (0: never split;
    null: 256 on a CPU, an eighth of the device's memory on a GPU, where each pass costs
    launches whatever its size)."""
    fast_forward: bool = True
    """Llama-family models (Llama, Mistral, Qwen2, Qwen3) run assay's own forward in the update
    and wherever the trainer recomputes logprobs: each distinct prompt once per micro-batch
    (Prefix Grouper's shared-prefix forward), fused projections; the same logprobs and
    gradients as the model's own forward, to rounding. False: always the model's own forward."""
    activation_checkpointing: bool = False
    """Keep only each decoder layer's input during the update and recompute the layer in the
    backward pass: activation memory falls from every layer's intermediates to one layer's (plus
    one hidden vector per layer and token), for about one more forward of compute. The same
    gradients, to rounding; larger micro-batches (`micro_batch_mb` is sized for it)."""
    samples_every: int = Field(20, ge=0)
    """Write a few prompts with their completions, rewards and reasons to `samples.jsonl` at
    step 1 and every this many steps (0: never)."""
    samples_n: int = Field(2, ge=1)
    """Prompts per sample dump (each with up to 4 of its completions)."""
    show_samples: bool = False
    """Also print one sampled completion above the progress bar at each dump."""
    stop_unscored_steps: int = Field(3, ge=0)
    """Stop the run, with one line saying why, when no completion could be scored for this
    many steps in a row (0: never stop)."""
    zero_var_warn: float = Field(0.9, gt=0.0, le=1.0)
    """Warn when at least this share of a step's groups have all-equal rewards (no learning signal) ..."""
    zero_var_steps: int = Field(10, ge=0)
    """... for this many steps in a row (0: never warn)."""
    on_alarm: Literal["warn", "stop"] = "warn"
    """What a hacking monitor's alarm does (docs/integrity.md): `warn` notes it (progress bar, `metrics.jsonl`, report,
    trackers) and trains on; `stop` also ends the run at that step with a checkpoint and exit code 3."""
    skip_zero_advantage: bool = True
    """Leave out of the update the rows whose advantage is zero on every token (groups whose
    completions all scored alike, under GRPO and the other group-relative estimators): they
    add no loss and no gradient, so the update is the same to rounding, only shorter. Applies
    when the loss is one of the built-ins, with no entropy bonus and no KL term in the loss;
    `actor/skipped_frac` reports the share left out. False: every row runs."""
