"""The reward-integrity lab (`assay lab NAME`): watch a reward get hacked, and see which fix stops it (docs/integrity.md).

An experiment is a few arms, `assay train` runs that differ only in their reward (or one
setting), on the same model, seed and budget. `run_lab` trains them one after the other into
`OUT/NAME/ARM/` (each an ordinary run folder, with its own report), then writes `lab.png`
(held-out verified accuracy and the hack's own signals against step, one line per arm),
`summary.json` and `index.html`: what was run (each arm's overrides), the figures per arm, and
the experiment's claims checked against those figures, each marked as seen or not seen. A claim
that does not hold at this scale is reported as such, with the figures.
"""

from assay.lab.experiments import EXPERIMENTS, Arm, Claim, Experiment
from assay.lab.run import run_lab

__all__ = ["EXPERIMENTS", "Arm", "Claim", "Experiment", "run_lab"]
