"""assay from Python: `train`, `evaluate` and `score`, the functions the `assay` command calls.

They raise instead of exiting (`AssayError` for a user mistake, one line; `KeyboardInterrupt`
after Ctrl-C, with the checkpoint saved), draw the live progress bar only on a terminal
(a notebook gets plain lines), and start worker processes without running the caller's
script again, so they work the same from a script, a notebook or a test.

    >>> from assay import RunConfig
    >>> run_config({"train": {"steps": 5}}, ["rollout.group_size=4"]).rollout.group_size
    4
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable

from pydantic import ValidationError

from assay.config import RunConfig, apply_override, explain, read_yaml_mapping
from assay.errors import AssayError
from assay.types import RewardResult, Trajectory

if TYPE_CHECKING:
    from assay.rewards.base import Reward
    from assay.training.runs import RunResult

ConfigLike = RunConfig | Mapping[str, Any] | str | Path | None


def run_config(config: ConfigLike = None, overrides: Iterable[str] = ()) -> RunConfig:
    """A validated `RunConfig` from a `RunConfig`, a nested dict, a YAML file or None (the defaults), plus `key=value` overrides."""
    if isinstance(config, RunConfig):
        data: dict[str, Any] = config.model_dump(mode="json", exclude_unset=True)
    elif isinstance(config, Mapping):
        data = dict(config)
    elif isinstance(config, (str, Path)):
        data = read_yaml_mapping(str(config))
    elif config is None:
        data = {}
    else:
        raise AssayError(f"config: expected a RunConfig, a dict, a YAML file path or None, got {type(config).__name__}")
    for item in overrides:
        apply_override(data, item)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, RunConfig)) from None


def _progress(progress: bool | None) -> bool:
    """The live bar on a terminal only (a notebook's or a pipe's stderr gets plain lines)."""
    if progress is not None:
        return progress
    return bool(getattr(sys.stderr, "isatty", lambda: False)()) and "ipykernel" not in sys.modules


def train(config: ConfigLike = None, *overrides: str, resume: str | Path | None = None, restart: str | Path | None = None,
          progress: bool | None = None) -> "RunResult":
    """Run RL training; returns the run folder and its final figures.

    Args:
        config: a `RunConfig`, a nested dict (`{"train": {"steps": 50}}`), a YAML file, or
            None for the defaults (GRPO on the bundled model and task).
        overrides: dotted `key=value` strings applied on top (`"algo.advantage=rloo"`).
        resume: a run folder to continue from its newest checkpoint with its own config
            (`overrides` may then change only `train.steps`, the cadences, threads, workers,
            trackers); `config` must be None.
        restart: the folder of a run that stopped before its first checkpoint: the run starts
            again from the beginning in it, with its own `config.yaml` plus `overrides`;
            `config` must be None.
        progress: the live progress bar (None: only when stderr is a terminal).
    A run without `run_name` gets a folder named after its YAML file (else its task or data
    file) and the time, so the same file can be run again.
    Returns:
        `RunResult`: `run_dir`, `final` (the summary figures), `model` (the `final/` folder),
        `metrics()` (the rows of `metrics.jsonl`).
    Raises:
        AssayError: a user mistake, in one line. KeyboardInterrupt (Ctrl-C) or
        `assay.training.interrupt.Preempted` (SIGTERM) after the checkpoint is saved; the
        exception's `run_dir` and `step` say where to resume.
    """
    from assay.training.interrupt import Preempted
    from assay.training.runs import RunResult
    from assay.po.online import trainer_class  # assay.training.sharded's, or PreferenceTrainer for algo.objective other than pg
    from assay.po.selfjudge import serving_policy
    from assay.training.runs import RunFolderLock, clear_outputs, restart_data, resume_config, stamped

    if resume is not None and restart is not None:
        raise AssayError("give one of resume (continue from the newest checkpoint) and restart (start again from the beginning)")
    if (resume is not None or restart is not None) and config is not None:
        raise AssayError(f"{'resume' if resume is not None else 'restart'} runs the folder's own config; give only overrides "
                         "(train.steps=...), not a config")
    folder: str | Path | None = resume
    lock = None
    if resume is not None:
        cfg = resume_config(resume, list(overrides))
    elif restart is not None:
        cfg, folder = run_config(restart_data(restart, list(overrides))), restart
        if os.environ.get("RANK", "0") == "0":  # not while a run is still writing there; the trainer (rank 0's) takes it over
            lock = RunFolderLock(restart)
        clear_outputs(restart)
    else:
        cfg = run_config(config, overrides)
        if isinstance(config, (str, Path)) and cfg.run_name is None:
            folder = Path(cfg.output_dir) / stamped(Path(config).stem, cfg.output_dir)
    if cfg.cluster.ray:  # workers placed by Ray (assay.cluster); the learner (or learner actor 0) holds the folder from here
        if lock is not None:
            lock.release()
        return _train_on_ray(cfg, folder, resume is not None, progress)
    trainer = trainer_class()(cfg, run_dir=folder, resume=resume is not None)  # one rank of a torchrun job, or the one process
    if lock is not None:
        lock.release()
    if trainer.finished:
        if trainer.folder_lock is not None:
            trainer.folder_lock.release()
        print(f"assay: run {str(trainer.run_dir)!r} is already finished at step {trainer.step} (train.steps={cfg.train.steps}); "
              "nothing to do (raise train.steps to continue it)", file=sys.stderr)
        return RunResult(trainer.run_dir, trainer.summary())
    if trainer.ranks.main:
        print(f"run folder: {trainer.run_dir}" + (f" ({trainer.ranks.world} processes)" if trainer.ranks.active else ""), file=sys.stderr)
    clean = False  # every rank stopped the same way: the run finished, or one signal stopped them all
    try:
        with serving_policy(trainer.model, trainer.tokenizer):  # a judge at url local://policy asks the policy itself
            result = trainer.fit(progress=_progress(progress) and trainer.ranks.main)
        clean = True
        return result
    except (KeyboardInterrupt, Preempted) as e:
        e.run_dir, e.step = trainer.run_dir, trainer.step  # type: ignore[attr-defined]
        clean = True
        raise
    finally:
        if trainer.ranks.active:
            trainer.sampler.close()  # an engine's own groups live in the run's process group: they go first
        trainer.ranks.close(clean)


def _train_on_ray(cfg, folder, resume: bool, progress: bool | None) -> "RunResult":
    """`train` with `cluster.ray`: the learner here, or `cluster.learner_workers` learner actors; the local cluster stopped after."""
    from assay.cluster import connect, shutdown
    from assay.cluster.learners import run_learners
    from assay.training.rl import Trainer
    from assay.training.runs import RunResult, new_run_dir

    started = connect(cfg.cluster)
    try:
        if cfg.cluster.learner_workers == 1:
            trainer = Trainer(cfg, run_dir=folder, resume=resume)
            print(f"run folder: {trainer.run_dir} (Ray: {cfg.cluster.rollout_workers} rollout, {cfg.cluster.reward_workers} reward workers)",
                  file=sys.stderr)
            try:
                return trainer.fit(progress=_progress(progress))
            except BaseException as e:
                e.run_dir, e.step = trainer.run_dir, trainer.step  # type: ignore[attr-defined]
                raise
            finally:
                trainer.sampler.close()  # the rollout actors
        run_dir = Path(folder) if resume else new_run_dir(cfg, folder)
        print(f"run folder: {run_dir} (Ray: {cfg.cluster.learner_workers} learner workers)", file=sys.stderr)
        return RunResult(run_dir, run_learners(cfg, run_dir, resume))
    finally:
        shutdown(started)


def evaluate(model: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Greedy accuracy, pass@k and mean length of a model; the keyword arguments of
    `assay.eval.run.evaluate_model` (task, data, format, run, reward, n, k, ...)."""
    from assay.eval.run import evaluate_model

    return evaluate_model(model, **kwargs)


def score(reward: "str | dict[str, Any] | Reward", items: Iterable[Trajectory | Mapping[str, Any]], *, workers: int = 0,
          timeout: float = 5.0) -> list[RewardResult]:
    """Score a batch with any reward; one `RewardResult` per item, in order.

    Args:
        reward: a reward name, a reward block (`{name, args, transforms}`), a YAML file,
            `module:attr`, or a `Reward` instance.
        items: `Trajectory` objects, or rows `{prompt, completion, answer, **fields}` (a
            prompt may be a list of chat messages; the other fields are what the reward reads).
        workers: reward worker processes (0: in this process, no per-item deadline).
        timeout: seconds per item with workers.

    >>> [r.score for r in score("math", [{"completion": "so \\\\boxed{4}", "answer": "4"}, {"completion": "5", "answer": "4"}])]
    [1.0, 0.0]
    """
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.scoring import row_to_traj
    from assay.rewards.spec import build_reward

    built = build_reward(reward)
    trajs = [it if isinstance(it, Trajectory) else row_to_traj(dict(it), i) for i, it in enumerate(items)]
    with RewardExecutor(built, workers=workers, timeout=timeout) as ex:
        return ex.score(trajs)
