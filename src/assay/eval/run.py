"""`assay eval`: any model on a built-in task's held-out split, a data file, or a run's own held-out data.

`evaluate_model` resolves what to evaluate and how to score it, then calls
`assay.eval.policy.evaluate` through the sampler interface and the reward executor (so a
reward that raises or hangs fails one item, never the evaluation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from assay.errors import AssayError


def _run_config(run: str):
    import yaml

    from assay.config import RunConfig

    path = Path(run) / "config.yaml"
    if not path.is_file():
        raise AssayError(f"--run: {run!r} is not a run folder (no config.yaml)")
    return RunConfig.model_validate(yaml.safe_load(path.read_text()))


def _run_model(run: str) -> str:
    from assay.train.checkpoint import latest_checkpoint

    final = Path(run) / "final"
    if (final / "config.json").is_file():
        return str(final)
    ckpt = latest_checkpoint(Path(run) / "checkpoints")
    if ckpt is None:
        raise AssayError(f"--run: {run!r} has neither final/ nor a finished checkpoint to evaluate")
    return str(ckpt)


def resolve(task: str | None, task_args: dict | None, data: str | None, fields: dict | None, run: str | None,
            reward: Any, n: int, seed: int) -> tuple[list, Any, dict[str, Any]]:
    """`(problems, reward spec, description)` for exactly one of task, data file or run."""
    from assay.data.datasets import build_source, read_rows, rows_to_samples
    from assay.data.tasks import make_task

    if sum(x is not None for x in (task, data, run)) > 1:
        raise AssayError("eval: give one of --task, --data or --run")
    if run is not None:
        cfg = _run_config(run)
        source = build_source(cfg.data, cfg.seed, n)
        if not source.heldout:
            raise AssayError(f"--run: the run {run!r} has no held-out data (data.eval_fraction=0 and no data.eval_path)")
        return source.heldout, reward or cfg.reward or source.reward, {"run": run, "data": cfg.data.task or cfg.data.path}
    if data is not None:
        if reward is None:
            raise AssayError("--data needs --reward: the reward that checks these rows (a name, module:attr, or a YAML block)")
        return rows_to_samples(read_rows(data), fields or {}, data)[:n], reward, {"data": data}
    t = make_task(task or "arithmetic", **(task_args or {}))
    return t.heldout(n), reward or t.reward, {"task": task or "arithmetic"}


def evaluate_model(model: str | None = None, *, task: str | None = None, task_args: dict | None = None, data: str | None = None,
                   fields: dict | None = None, run: str | None = None, reward: Any = None, n: int = 500, k: int = 8,
                   max_new_tokens: int | None = None, temperature: float = 1.0, backend: str = "torch", device: str = "cpu",
                   seed: int = 0, workers: int = 2, timeout: float = 5.0, server_url: str | None = None) -> dict[str, Any]:
    """Greedy accuracy, pass@k and mean length of `model` on a task, a data file or a run's held-out data.

    Args:
        model: a bundled model name or a Hugging Face folder (default: the run's `final/`
            with `run`, else `tiny-arith`).
        task, task_args: a built-in task; its held-out split is evaluated.
        data, fields: a JSONL/Parquet file or `datasets` folder, mapped like `data.fields`
            in training; its first `n` rows are evaluated.
        run: a run folder: its own held-out split, reward and completion length.
        reward: any reward spec (default: the task's or the run's verifier).
        n, k, temperature: problems, pass@k samples and their temperature (k=0: greedy only).
        max_new_tokens: completion limit (default: the run's, else 6).
        backend, server_url: the generation backend (`rollout.backend`: torch, vllm, openai)
            and, for `openai`, the server (it is given `model`'s weights when it takes them).
    Returns:
        `{model, task|data|run, n, accuracy, pass@k, mean_length, unscored}`.
    """
    from assay.eval.policy import evaluate
    from assay.models import load_policy
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward
    from assay.rollout.base import make_sampler

    problems, spec, what = resolve(task, task_args, data, fields, run, reward, n, seed)
    if spec is None:
        raise AssayError("eval: this data has no built-in verifier; give --reward")
    if max_new_tokens is None:
        max_new_tokens = _run_config(run).rollout.max_new_tokens if run else 6
    model = model or (_run_model(run) if run else "tiny-arith")
    policy, tokenizer = load_policy(model, device)
    rollout = None
    if backend != "torch":
        from assay.config import RolloutConfig

        rollout = RolloutConfig(backend=backend, server_url=server_url)
    sampler = make_sampler(backend, policy, tokenizer, rollout, device)
    try:
        with RewardExecutor(build_reward(spec), workers=workers, timeout=timeout) as ex:
            r = evaluate(sampler, ex.score, problems, max_new_tokens, k=k, seed=seed, temperature=temperature)
    finally:
        sampler.close()
    return {"model": model, **what, **r.as_dict()}
