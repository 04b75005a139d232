"""The training loop and what it is made of (`rl.py`, `learner.py`, `extras.py`, ...).

The package is also the API's `train` function: `from assay import train` gives this
package, and calling it, `train(config, *overrides, resume=..., progress=...)`, runs
`assay.api.train`. (A package and a function cannot share the name `assay.train` any other
way: importing `assay.train.rl` binds the package to that name.)
"""

from __future__ import annotations

import sys
import types
from typing import Any

from assay.api import train as _train


class _TrainPackage(types.ModuleType):
    """A module that runs `assay.api.train` when called."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _train(*args, **kwargs)


__wrapped__ = _train  # inspect.signature(assay.train) and help() show the function's
sys.modules[__name__].__class__ = _TrainPackage
