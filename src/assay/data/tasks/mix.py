"""A mixture of built-in tasks: each problem is drawn from one part, chosen by weight.

    >>> import random
    >>> four_digit_sums = {"task": "arithmetic", "args": {"min_value": 1000, "max_value": 9999}}
    >>> two_digit_products = {"task": "arithmetic", "args": {"min_value": 10, "ops": "*"}}
    >>> task = Mix([four_digit_sums, two_digit_products])
    >>> task.reward
    'arithmetic'
    >>> [task.make(random.Random(s)).prompt for s in (0, 1)]
    ['63*15=', '2033+5179=']
"""

from __future__ import annotations

import random
from typing import Any

from assay.data.tasks.base import TASKS, Task, make_task
from assay.errors import AssayError
from assay.types import Sample


@TASKS.register("mix")
class Mix(Task):
    """Problems from several tasks that share one verifier (`task_args: {parts: [...]}`).

    Args:
        parts: one `{task: NAME, args: {...}, weight: 1.0}` per part (`args` and `weight` optional).
    """

    def __init__(self, parts: list[dict[str, Any]], heldout_fraction: float = 0.2):
        if not parts or any(not isinstance(p, dict) or "task" not in p or set(p) - {"task", "args", "weight"} for p in parts):
            raise AssayError("mix: parts is a list of {task: NAME, args: {...}, weight: W}")
        self.parts = parts
        self._tasks = [make_task(p["task"], **p.get("args", {})) for p in parts]
        self._weights = [float(p.get("weight", 1.0)) for p in parts]
        rewards = sorted({t.reward for t in self._tasks})
        if len(rewards) != 1:
            raise AssayError(f"mix: the parts must share one verifier; got {', '.join(rewards)}")
        if min(self._weights) < 0 or sum(self._weights) <= 0:
            raise AssayError(f"mix: weights must be >= 0 with a positive sum; got {self._weights}")
        self.reward = rewards[0]
        self.heldout_fraction = heldout_fraction

    def make(self, rng: random.Random) -> Sample:
        return rng.choices(self._tasks, self._weights)[0].make(rng)
