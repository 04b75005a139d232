"""Reward models: Bradley–Terry training on preference pairs, process reward models on step labels, measurement, use as a reward.

* `data.py` — preference rows (pairwise, RewardBench 2, a field mapping) and the seeded order;
* `pairs.py` — preference pairs built from a built-in task with its verifier (`assay rm pairs`);
* `losses.py` — the objective as pure functions (Bradley–Terry, margin, centering, length);
* `model.py` — the scalar-head model, a Hugging Face sequence classifier, and its scoring;
* `train.py` — `assay rm train`: the loop, checkpoints, exact resume;
* `eval.py` — pairwise and best-of-N accuracy (`assay rm eval`);
* `reward.py` — `reward: {name: rm, args: {path: ...}}` and `{name: prm, args: {path: ..., reduce: min}}`;
* `steps.py` — step splitting with spans, step-labelled rows (PRM800K, ProcessBench);
* `label_steps.py` — Monte Carlo step labels from a policy and a verifier (`assay rm label-steps`);
* `prm.py` — the process reward model: per-step scores, BCE, reduces (PURE's min form), first-error F1.
"""
