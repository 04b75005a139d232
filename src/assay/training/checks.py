"""Checks that run before a run makes anything: a misspelled plugin name or hyperparameter, a group of one."""

from __future__ import annotations

from assay.algos import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from assay.config import RunConfig
from assay.errors import AssayError
from assay.report.trackers import check_trackers
from assay.rollout.base import check_backend
from assay.training.learner import estimator_args, loss_args


def check_group_size(advantage: str, group_size: int) -> None:
    """One line for a group-relative estimator (`fn.groups`) with one completion per prompt: every advantage would be 0."""
    if group_size == 1 and getattr(ADVANTAGES.get(advantage), "groups", False):
        grouped = sorted(n for n in ADVANTAGES.names() if getattr(ADVANTAGES.get(n), "groups", False))
        raise AssayError(f"rollout.group_size=1 with algo.advantage={advantage}: it compares each completion with the rest of its group, "
                         "so one completion per prompt gets advantage 0 and nothing trains; set rollout.group_size to 2 or more, or an "
                         f"estimator that needs no group (the ones that do: {', '.join(grouped)})")


def check_plugins(cfg: RunConfig) -> None:
    """Fail fast, before any folder is made, on a misspelled plugin name or hyperparameter."""
    check_backend(cfg.rollout.backend)
    check_group_size(cfg.algo.advantage, cfg.rollout.group_size)
    POLICY_LOSSES.get(cfg.algo.loss)
    AGGREGATIONS.get(cfg.algo.aggregation)
    KL_ESTIMATORS.get(cfg.algo.kl_estimator)
    estimator_args(cfg.algo)
    loss_args(cfg.algo)
    check_trackers(cfg.train.report_to)
    if cfg.env is not None:
        from assay.envs import env_factory

        env_factory(cfg.env.name, cfg.env.args)
