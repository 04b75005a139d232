"""`assay eval`: any model on a built-in task's held-out split, a data file, or a run's own held-out data.

`evaluate_model` resolves what to evaluate and how to score it, then calls
`assay.eval.policy.evaluate` through the sampler interface and the reward executor (so a
reward that raises or hangs fails one item, never the evaluation). With an environment (a
run's `env:` block, or `env=`) each problem is a whole episode of it, as in training's
held-out evaluation, scored by the episode's reward unless another is given.
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
    from assay.training.checkpoint import resumable_checkpoint

    final = Path(run) / "final"
    if (final / "config.json").is_file() or (final / "adapter_config.json").is_file():
        return str(final)
    ckpt = resumable_checkpoint(Path(run) / "checkpoints")
    if ckpt is None:
        raise AssayError(f"--run: {run!r} has neither final/ nor a finished checkpoint to evaluate")
    return str(ckpt)


def env_config(spec: Any):
    """An `EnvConfig` from a name (`calculator`), a `module:attr` factory, or a block (`{name: calculator, args: {...}}`)."""
    from pydantic import ValidationError

    from assay.config import EnvConfig, explain

    block = {"name": spec} if isinstance(spec, str) else spec
    if not isinstance(block, dict):
        raise AssayError(f"--env: expected an environment name or a block {{name, args, max_turns, ...}}, got {spec!r}")
    try:
        return EnvConfig.model_validate(block)
    except ValidationError as e:
        raise AssayError(explain(e, block, EnvConfig, "--env")) from None


def resolve(task: str | None, task_args: dict | None, data, run: str | None, reward: Any, n: int,
            seed: int) -> tuple[list, Any, Any, dict[str, Any]]:
    """`(problems, reward spec, the data's own verifier spec or None, description)` for exactly one of task, data
    (a `DataConfig` with a path) or run."""
    from assay.data.datasets import build_source, data_reward, samples_from
    from assay.data.tasks import make_task

    if sum(x is not None for x in (task, data, run)) > 1:
        raise AssayError("eval: give one of --task, --data or --run")
    if run is not None:
        cfg = _run_config(run)
        source = build_source(cfg.data, cfg.seed, n)
        if not source.heldout:
            raise AssayError(f"--run: the run {run!r} has no held-out data (data.eval_fraction=0 and no data.eval_path)")
        return source.heldout, reward or cfg.reward or source.reward, source.reward, {"run": run, "data": cfg.data.task or cfg.data.path}
    if data is not None:
        own = data_reward(data)
        reward = reward or own
        if reward is None:
            raise AssayError("--data needs --reward (the reward that checks these rows: a name, module:attr, or a YAML block) "
                             "or --format (a standard layout that brings its reward)")
        return samples_from(data.path, data)[:n], reward, own, {"data": data.path, **({"format": data.format} if data.format else {})}
    import assay.envs  # noqa: F401  (registers the environments' tasks: sql-agent, code-fix)

    t = make_task(task or "arithmetic", **(task_args or {}))
    return t.heldout(n), reward or t.reward, t.reward, {"task": task or "arithmetic"}


def evaluate_model(model: str | None = None, *, task: str | None = None, task_args: dict | None = None, data: str | None = None,
                   fields: dict | None = None, format: str | None = None, chat: bool = False, system_prompt: str | None = None,
                   chat_template_kwargs: dict | None = None, chat_template: str | None = None, run: str | None = None,
                   reward: Any = None, n: int = 500, k: int = 8, max_new_tokens: int | None = None, temperature: float = 1.0,
                   backend: str = "torch", device: str = "cpu", seed: int = 0, workers: int = 2, timeout: float = 5.0,
                   server_url: str | None = None, env: Any = None, images: str = "keep") -> dict[str, Any]:
    """Greedy accuracy, pass@k and mean length of `model` on a task, a data file or a run's held-out data.

    Args:
        model: a bundled model name or a Hugging Face folder (default: the run's `final/`
            with `run`, else `tiny-arith`).
        task, task_args: a built-in task; its held-out split is evaluated.
        data, fields, format: a JSONL/Parquet file or `datasets` folder, read as `data.path`,
            `data.fields` and `data.format` are in training (a format brings its reward); its
            first `n` rows are evaluated.
        chat, system_prompt, chat_template_kwargs: how prompts meet the chat template, as the
            `data` settings of the same names; `chat_template` replaces the tokenizer's.
        run: a run folder: its own held-out split, reward, chat settings and completion length.
        reward: any reward spec (default: the task's, the format's or the run's verifier).
        n, k, temperature: problems, pass@k samples and their temperature (k=0: greedy only).
        max_new_tokens: completion limit (default: the run's, else 6).
        backend, server_url: the generation backend (`rollout.backend`: torch, vllm, openai)
            and, for `openai`, the server (it is given `model`'s weights when it takes them).
        env: an environment (a name, `module:attr` or an `env:` block; default: the run's):
            each problem is an episode, scored by the `episode` reward unless `reward` is given.
        images: for prompts with pictures, `keep` them, `blank` them (black pictures of the same size),
            `shuffle` them (each row gets the next row's), or `describe` them (the row's `image_description`
            text in their place): the controls that show whether a policy uses the pictures.
    Returns:
        `{model, task|data|run, n, accuracy, pass@k, sampled_accuracy, mean_length, unscored}` (`sampled_accuracy`:
        the share of the k samples right, with k > 0); with an
        environment also `env`, `turns_mean` and `tool_calls_per_episode` (over every
        episode run, the pass@k samples included). A reward whose scores are not verdicts
        (a reward model, a judge) gives `mean_reward` instead, with `accuracy` and `pass@k`
        from the task's, format's or run's own verifier when there is one (`verifier`).
    """
    from contextlib import ExitStack

    from assay.eval.bestof import spec_name
    from assay.eval.policy import evaluate
    from assay.rewards.executor import gives_verdicts
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward

    problems, reward_spec, own, what, model, sampler, max_new_tokens = _prepare(
        model, task, task_args, data, fields, format, chat, system_prompt, chat_template_kwargs, chat_template, run, reward, n,
        max_new_tokens, backend, device, seed, server_url, env)
    try:
        if images != "keep":
            problems, what["images"] = picture_control(images, problems), images
        with ExitStack() as stack:
            ex = stack.enter_context(RewardExecutor(build_reward(reward_spec), workers=workers, timeout=timeout))
            if gives_verdicts(ex.reward):
                r = evaluate(sampler, ex.score, problems, max_new_tokens, k=k, seed=seed, temperature=temperature)
            else:  # a learned score is no verdict: its mean, beside the verifier's accuracy when the data has one
                check = stack.enter_context(RewardExecutor(build_reward(own), workers=workers, timeout=timeout)) if own else None
                what["verifier"] = spec_name(own) if own else None
                r = evaluate(sampler, check.score if check else None, problems, max_new_tokens, k=k if check else 0, seed=seed,
                             temperature=temperature, reward=ex.score)
        episodes = sampler.metrics() if "env" in what else {}
    finally:
        sampler.close()
    agent = {k: episodes[f"agent/{k}"] for k in ("turns_mean", "tool_calls_per_episode") if f"agent/{k}" in episodes}
    return {"model": model, **what, **r.as_dict(), **agent}


def picture_control(images: str, problems: list) -> list:
    """`problems` with their pictures as `--images` says (`assay.vision.inputs.PICTURE_CONTROLS`); one line for an unknown
    control or problems without pictures."""
    from assay.vision.inputs import PICTURE_CONTROLS, has_images

    if images not in PICTURE_CONTROLS:
        raise AssayError(f"eval: --images {images!r}; allowed: {', '.join(PICTURE_CONTROLS)}")
    if not any(has_images(p) for p in problems):
        raise AssayError(f"eval: --images {images} applies to prompts with pictures, and none of these {len(problems)} has one")
    return PICTURE_CONTROLS[images](problems)


def _prepare(model, task, task_args, data, fields, format, chat, system_prompt, chat_template_kwargs, chat_template, run, reward, n,
             max_new_tokens, backend, device, seed, server_url, env=None) -> tuple[list, Any, Any, dict[str, Any], str, Any, int]:
    """`(problems, reward spec, the data's own verifier spec, description, model, sampler, max_new_tokens)`: what
    `evaluate_model` and `evaluate_best_of` share."""
    from assay.config import DataConfig
    from assay.data.datasets import PromptLimit
    from assay.models import context_length, load_policy
    from assay.rollout.base import make_sampler
    from assay.rollout.multiturn import episode_sampler

    if data is None:  # read only with a data file: given without one, each would be silently ignored
        given = [name for name, v in (("--fields", fields), ("--format", format), ("--chat", chat), ("--system-prompt", system_prompt),
                                      ("--chat-template-kwargs", chat_template_kwargs)) if v]
        if given:
            raise AssayError(f"eval: {given[0]} applies to a data file, and --data is not given (a task's prompts are its own; "
                             "--run uses the run's data settings)")
    run_cfg = _run_config(run) if run else None
    env_cfg = env_config(env) if env is not None else (run_cfg.env if run_cfg else None)
    if env_cfg is not None and reward is None:
        reward = (run_cfg.reward if run_cfg else None) or "episode"  # the episode's own reward, as in training
    spec = None if data is None else DataConfig(task=None, path=data, fields=fields or {}, format=format, chat=chat,
                                                system_prompt=system_prompt, chat_template_kwargs=chat_template_kwargs or {})
    problems, reward_spec, own, what = resolve(task, task_args, spec, run, reward, n, seed)
    if env_cfg is not None:
        from assay.envs.base import env_factory

        env_factory(env_cfg.name, env_cfg.args)  # an unknown environment or bad arguments: one line before the model loads
        what["env"] = env_cfg.name
    if reward_spec is None:
        raise AssayError("eval: this data has no built-in verifier; give --reward")
    if max_new_tokens is None:
        max_new_tokens = run_cfg.rollout.max_new_tokens if run_cfg else 6
    if run_cfg and chat_template is None:
        chat_template = run_cfg.model.chat_template
    model = model or (_run_model(run) if run else "tiny-arith")
    policy, tokenizer = load_policy(model, device, chat_template=chat_template)
    context = context_length(policy)
    if context:  # the training-time rule: a prompt and its completion fit the model, else one line naming the prompt
        problems = PromptLimit(tokenizer, context - max_new_tokens, "error", context).apply(problems, "eval data")
    rollout = None
    if backend != "torch":
        from assay.config import RolloutConfig

        rollout = RolloutConfig(backend=backend, server_url=server_url)
    sampler = make_sampler(backend, policy, tokenizer, rollout, device)
    if env_cfg is not None:  # each problem an episode, as in training's held-out evaluation
        sampler = episode_sampler(sampler, policy, tokenizer, env_cfg, context)
    return problems, reward_spec, own, what, model, sampler, max_new_tokens


def evaluate_best_of(model: str | None = None, *, select: Any, best_of: int, verifier: Any = None, task: str | None = None,
                     task_args: dict | None = None, data: str | None = None, fields: dict | None = None, format: str | None = None,
                     chat: bool = False, system_prompt: str | None = None, chat_template_kwargs: dict | None = None,
                     chat_template: str | None = None, run: str | None = None, n: int = 500, max_new_tokens: int | None = None,
                     temperature: float = 1.0, backend: str = "torch", device: str = "cpu", seed: int = 0, workers: int = 2,
                     timeout: float = 5.0, server_url: str | None = None, env: Any = None) -> dict[str, Any]:
    """Verified accuracy of the best of n samples under the reward `select`, for n = 1, 2, 4, ..., `best_of` (`assay.eval.bestof`).

    The problems, model and verifier are resolved as in `evaluate_model` (`verifier`: the
    task's, the format's or the run's own when None). Returns `{model, task|data|run,
    problems, best_of, selector, verifier, temperature, seed, curve: [{n, best_of, pass,
    majority}], per_problem: [...]}`.
    """
    from assay.eval import bestof
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward

    if best_of < 1:
        raise AssayError(f"--best-of must be at least 1, got {best_of}")
    if select is None:
        raise AssayError("--best-of needs --reward SPEC: the reward that picks one of the samples (a verifier, {name: rm, args: {path: ...}}, ...)")
    if data is not None and verifier is None and format is None:
        raise AssayError("--best-of on --data needs --verifier SPEC (the reward that checks the picked answer) or --format")
    selector = build_reward(select)  # a bad spec fails here, before the model loads
    problems, verifier_spec, _, what, model, sampler, max_new_tokens = _prepare(
        model, task, task_args, data, fields, format, chat, system_prompt, chat_template_kwargs, chat_template, run, verifier, n,
        max_new_tokens, backend, device, seed, server_url, env)
    try:
        with RewardExecutor(build_reward(verifier_spec), workers=workers, timeout=timeout) as check, \
                RewardExecutor(selector, workers=workers, timeout=timeout, failure_score=None) as pick:
            per_problem = bestof.sample_and_score(sampler, check.score, pick.score, problems, best_of, max_new_tokens, temperature, seed)
    finally:
        sampler.close()
    curve = bestof.best_of_curve([p["correct"] for p in per_problem], [p["scores"] for p in per_problem],
                                 [p["answers"] for p in per_problem], bestof.sizes(best_of))
    return {"model": model, **what, "problems": len(per_problem), "best_of": best_of, "selector": bestof.spec_name(select),
            "verifier": bestof.spec_name(verifier_spec), "temperature": temperature, "seed": seed, "max_new_tokens": max_new_tokens,
            "curve": curve, "per_problem": per_problem}
