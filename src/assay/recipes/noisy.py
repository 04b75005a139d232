"""Imperfect demonstrations for the bundled models' recipes.

A recipe supervises on answers that are often wrong in a systematic way, which leaves a
model that puts real probability on the right answer without producing it reliably, the
situation where RL with a verifier helps most (docs/architecture.md, "The bundled model").
`recipe.yaml` names the corruption (`corruption: forget_carry`) and its rate (`noise`).
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

from assay.types import Sample


def add_without_carry(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry forgotten: 57 + 68 → 15."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def forget_carry(s: Sample, rng: random.Random) -> str:
    """The answer a careless demonstrator writes for `a+b`: every carry forgotten."""
    a, b = s.fields["nums"]
    return str(add_without_carry(a, b))


def offset_error(s: Sample, rng: random.Random, offsets: tuple[int, ...] = (-10, -2, -1, 1, 2, 10)) -> str:
    """The answer shifted by a random small offset."""
    return str(int(s.answer) + rng.choice(offsets))


CORRUPTIONS: dict[str, Callable[[Sample, random.Random], str]] = {"forget_carry": forget_carry, "offset": offset_error}


def noisy_answers(samples: Iterable[Sample], noise: float, corruption: str, rng: random.Random) -> Iterable[tuple[str, str]]:
    """(prompt, answer) pairs where a fraction `noise` of answers is replaced by `CORRUPTIONS[corruption]`."""
    corrupt = CORRUPTIONS[corruption]
    for s in samples:
        yield s.prompt, corrupt(s, rng) if rng.random() < noise else str(s.answer)
