"""An environment for training tests, importable as `_agents_env:Retry`: arithmetic with retries."""

import re

from assay.envs import Environment, Step


class Retry(Environment):
    """The arithmetic problem; a wrong answer is told `no, again:` and may try again, up to `tries` turns; reward 1 when right.

    `info["progress"]` after each turn: the fraction of the answer's leading characters the turn's number got right.
    """

    def __init__(self, tries: int = 3):
        self.tries = tries

    def reset(self, sample):
        self.answer, self.left = str(sample.answer), self.tries
        return sample.prompt

    def step(self, action):
        self.left -= 1
        found = re.search(r"-?\d+", action)
        guess = found.group() if found else ""
        same = next((i for i, (a, b) in enumerate(zip(guess, self.answer)) if a != b), min(len(guess), len(self.answer)))
        progress = same / len(self.answer)
        if guess == self.answer:
            return Step("", 1.0, True, {"finish_reason": "right", "progress": progress})
        if self.left == 0:
            return Step("", 0.0, True, {"finish_reason": "wrong", "progress": progress})
        return Step("no,again:", 0.0, False, {"progress": progress})


def hang_forever(x: str) -> str:
    """Never returns (the isolated tool worker is killed at the deadline)."""
    import time

    while True:
        time.sleep(1)


def crash(x: str) -> str:
    """Kills its own process."""
    import os

    os._exit(3)


def double(x: int) -> int:
    """Twice x."""
    return 2 * x


def fail(x: str) -> str:
    """Always raises."""
    raise ValueError("kaboom")
