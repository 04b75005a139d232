"""Imperfect demonstrations for the bundled models' recipes.

A recipe supervises on answers that are often wrong in a systematic way, which leaves a
model that puts real probability on the right answer without producing it reliably, the
situation where RL with a verifier helps most (docs/architecture.md, "The bundled model").
`recipe.yaml` names the corruption (`corruption: forget_carry`) and its rate (`noise`).

A step corruption (`STEP_CORRUPTIONS`, for multi-line solutions such as `arithmetic_steps`)
writes every demonstration itself and errs at each step independently with probability `noise`.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

from assay.errors import AssayError
from assay.types import Sample


def add_without_carry(a: int, b: int) -> int:
    """a + b computed digit by digit with every carry forgotten: 57 + 68 → 15."""
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def forget_carry(s: Sample, rng: random.Random) -> str:
    """The answer a careless demonstrator writes for a sum `a+b(+c...)`: every carry forgotten (digit sums mod 10)."""
    nums = s.fields["nums"]
    if set(s.fields["ops"]) != {"+"}:
        raise AssayError(f"forget_carry: needs a sum (ops '+'), got {s.fields['ops']!r}")
    out = nums[0]
    for n in nums[1:]:
        out = add_without_carry(out, n)
    return str(out)


def offset_error(s: Sample, rng: random.Random, offsets: tuple[int, ...] = (-10, -2, -1, 1, 2, 10)) -> str:
    """The answer shifted by a random small offset."""
    return str(int(s.answer) + rng.choice(offsets))


CORRUPTIONS: dict[str, Callable[[Sample, random.Random], str]] = {"forget_carry": forget_carry, "offset": offset_error}


def forget_carry_steps(s: Sample, rng: random.Random, noise: float) -> str:
    """A sum `a+b+c+...` solved one line per addition, each line forgetting its carries with probability `noise`.

    A careless line adds to the running sum as written, so a wrong line carries into every later one:
    `12+34+56=` → `12+34=46\n46+56=102` done right, `12+34=46\n46+56=92` when the second line forgets its carry.
    """
    nums, ops = s.fields["nums"], s.fields["ops"]
    if set(ops) != {"+"}:
        raise AssayError(f"forget_carry_steps: needs a sum (ops '+'), got {ops!r}")
    value, lines = nums[0], []
    for n in nums[1:]:
        new = add_without_carry(value, n) if rng.random() < noise else value + n
        lines.append(f"{value}+{n}={new}")
        value = new
    return "\n".join(lines)


STEP_CORRUPTIONS: dict[str, Callable[[Sample, random.Random, float], str]] = {"forget_carry_steps": forget_carry_steps}


def noisy_answers(samples: Iterable[Sample], noise: float, corruption: str, rng: random.Random) -> Iterable[tuple[str, str]]:
    """(prompt, answer) pairs where a fraction `noise` of answers is replaced by `CORRUPTIONS[corruption]`."""
    if corruption in STEP_CORRUPTIONS:
        step_corrupt = STEP_CORRUPTIONS[corruption]
        for s in samples:
            yield s.prompt, step_corrupt(s, rng, noise)
        return
    if corruption not in CORRUPTIONS:
        raise AssayError(f"unknown corruption {corruption!r}; known: {', '.join([*CORRUPTIONS, *STEP_CORRUPTIONS])}")
    corrupt = CORRUPTIONS[corruption]
    for s in samples:
        yield s.prompt, corrupt(s, rng) if rng.random() < noise else str(s.answer)
