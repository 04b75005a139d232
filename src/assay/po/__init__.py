"""Preference optimisation (docs/preference.md): DPO-family losses on preference pairs, offline and online.

- `losses.py`: the losses, pure functions of sequence log-probabilities registered by name
  (`PREFERENCE_LOSSES`: dpo, cdpo, robust, ipo, hinge, simpo, orpo, kto).
- `data.py`: preference files in the layouts TRL and the Hub use (and `assay rm pairs` output), tokenised.
- `logps.py`: sequence log-probabilities of prompt/response pairs through the learner's forward;
  `step.py`: one preference update (micro-batches, cached reference log-probabilities, metrics).
- `config.py`, `train.py`: `assay po train`, offline training on a pair file with checkpoints and exact resume.
- `pairs.py`: pairs from scored groups (best against worst, or every pair above a margin; ties
  dropped and counted) and `assay po pairs`, pairs sampled from a model and scored by any reward.
- `online.py`: `assay train algo.objective=NAME`, iterative (online) preference training and
  best-of-N SFT (RAFT) inside the RL loop; `selfjudge.py`, the policy judging its own samples.
"""
