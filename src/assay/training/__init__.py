"""The training loop and what it is made of: `rl.py` (the RL loop), `learner.py` (losses and
updates), `extras.py` (what estimators need), `critic.py`, `checkpoint.py`, `runs.py`, `sft.py`, ...

The Python API's `train` is `assay.api.train` (`from assay import train`).
"""
