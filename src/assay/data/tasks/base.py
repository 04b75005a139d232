"""Built-in procedural tasks: deterministic problems with disjoint train/held-out splits.

A problem belongs to the held-out split when a hash of its prompt falls below
`heldout_fraction`, so the two splits can never share a problem however many are drawn.
Held-out problems come in a fixed order (the same for every run); training problems are
drawn from a seeded stream that skips held-out ones.
"""

from __future__ import annotations

import abc
import hashlib
import random
from typing import Any, Iterator

from assay.errors import AssayError
from assay.registry import Registry
from assay.types import Sample

SPLITS = ("train", "heldout")


def in_heldout(prompt: str, fraction: float) -> bool:
    """True when `prompt` belongs to the held-out split (stable across runs and machines)."""
    h = int.from_bytes(hashlib.blake2b(prompt.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < fraction


class Task(abc.ABC):
    """A problem generator plus the name of the reward that verifies it."""

    #: registered name of the verifier reward for this task
    reward: str
    heldout_fraction: float = 0.2

    @abc.abstractmethod
    def make(self, rng: random.Random) -> Sample:
        """One random problem (its id is filled in by the caller)."""

    def key(self, sample: Sample) -> str:
        """What makes two problems the same, for the split and the ids: the prompt (a task whose prompts are not
        plain text, such as a picture and a question, gives a text of its own)."""
        return sample.prompt

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def stream(self, split: str, seed: int) -> Iterator[Sample]:
        """An endless stream of problems of one split (held-out: without repeats)."""
        if split not in SPLITS:
            raise AssayError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
        rng = random.Random(f"{type(self).__name__}:{split}:{seed}")
        want_heldout = split == "heldout"
        seen: set[str] = set()
        misses = 0
        while True:
            s = self.make(rng)
            key = self.key(s)
            if in_heldout(key, self.heldout_fraction) != want_heldout:
                continue
            if want_heldout:
                if key in seen:
                    misses += 1
                    if misses > 10_000:
                        return  # the held-out space is exhausted
                    continue
                seen.add(key)
                misses = 0
            s.id = f"{split}-{hashlib.blake2b(key.encode(), digest_size=6).hexdigest()}"
            yield s

    def heldout(self, n: int) -> list[Sample]:
        """The first `n` held-out problems (the same list in every run)."""
        out = []
        for s in self.stream("heldout", seed=0):
            out.append(s)
            if len(out) == n:
                break
        return out


TASKS: Registry[type[Task]] = Registry("task")


def make_task(name: str, **kwargs: Any) -> Task:
    """Instantiate a registered task, with a clear error for a bad argument."""
    cls = TASKS.get(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise AssayError(f"task {name!r}: {e}") from None
