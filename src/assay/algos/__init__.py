"""The RL maths as pure tensor functions, each registered by name.

- `ADVANTAGES`: `(rewards [B], group [B], mask [B, T], **extras, **hyperparameters) -> advantages [B, T]`;
  each estimator declares the extras it needs in `fn.needs` (read it with
  `requirements(name)`) and whether it normalises across groups in `fn.mixes_groups`;
  `bind_args` checks a config's hyperparameters against the signature.
- `POLICY_LOSSES`: `(logprobs, old_logprobs, advantages, mask, **hparams) -> (loss [B, T], metrics)`
- `AGGREGATIONS`: `(loss [B, T], mask [B, T], **kw) -> scalar`
- `KL_ESTIMATORS`: `(logprobs, ref_logprobs) -> kl [B, T]`

Helpers that are not registry entries: `mismatch_correction` (TIS/MIS weights),
`entropy_from_logits`, `future_kl`, `kl_reward_penalty`, `compute_gae`,
`explained_variance`, `step_to_token`, `value_loss`. See docs/algorithms.md.
"""

from assay.algos.advantages import ADVANTAGES, requirements
from assay.algos.args import bind_args, hyperparameters
from assay.algos import credit  # noqa: F401  (registers the token- and step-level estimators)
from assay.algos import turns  # noqa: F401  (registers the turn-level estimators)
from assay.algos.correction import mismatch_correction
from assay.algos.credit import compute_gae, explained_variance, step_to_token
from assay.algos.entropy import entropy_from_logits, entropy_stats
from assay.algos.kl import KL_ESTIMATORS, future_kl, kl_reward_penalty
from assay.algos.losses import AGGREGATIONS, POLICY_LOSSES, aggregate, loss_reads, value_loss

__all__ = [
    "ADVANTAGES", "POLICY_LOSSES", "AGGREGATIONS", "KL_ESTIMATORS", "aggregate",
    "requirements", "bind_args", "hyperparameters", "mismatch_correction", "entropy_from_logits", "entropy_stats",
    "future_kl", "kl_reward_penalty", "compute_gae", "explained_variance", "step_to_token", "value_loss", "loss_reads",
]
