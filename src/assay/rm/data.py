"""Preference data for reward models: pairs to train on, comparisons to evaluate.

A row holds a prompt, a chosen response and a rejected one. Three layouts are read as
they are, from JSONL, JSON or CSV (gzipped too), Parquet or a `datasets` folder (`assay.data.datasets.read_rows`):

* pairwise rows: `{prompt, chosen, rejected}` with strings (RewardBench's own layout);
* RewardBench 2 rows: `{prompt, chosen: [..], rejected: [..]}`, lists of responses, where
  every chosen response should score above every rejected one;
* any other column names, renamed with a field mapping (`{prompt: question, chosen: good}`).

A prompt is text, or a conversation (a list of `{role, content}` messages) that the
reward model's chat template renders. Extra columns (`subset`, `kind`, `id`) stay with the
row, so accuracy can be reported per subset.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from typing import Any

from assay.data.datasets import MISSING, check_messages, column, read_rows
from assay.errors import AssayError

PAIR_FIELDS = ("prompt", "chosen", "rejected", "id")


@dataclass
class Comparison:
    """One prompt with responses that should rank above others.

    Attributes:
        id: the row's id (its `id` column, else its position).
        prompt: text, or a list of chat messages.
        chosen: responses that should score higher (one for pairwise rows).
        rejected: responses that should score lower.
        subset: the row's group for per-subset accuracy (`subset` or `kind` column; "" when neither).
        fields: the row's other columns.
    """

    id: str
    prompt: str | list[dict[str, Any]]
    chosen: list[str]
    rejected: list[str]
    subset: str = ""
    fields: dict[str, Any] = field(default_factory=dict)

    def pairs(self) -> list[tuple[str, str]]:
        """Every (chosen, rejected) combination: what pairwise training and accuracy count."""
        return [(c, r) for c in self.chosen for r in self.rejected]


@dataclass
class Pair:
    """One training pair: `prompt`, `chosen` above `rejected`."""

    prompt: str | list[dict[str, Any]]
    chosen: str
    rejected: str
    subset: str = ""


def _responses(value: Any, where: str, column: str) -> list[str]:
    """A response column as a list of strings: a string, or a non-empty list of strings."""
    if isinstance(value, str):
        return [value]
    if _is_picture(value):  # a picture as Hugging Face `datasets` stores an Image column ({bytes, path})
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) or _is_picture(v) for v in value):
        return list(value)
    raise AssayError(f"{where}: column {column!r} must be a string or a non-empty list of strings, got {str(value)[:60]!r}")


def _is_picture(value: Any) -> bool:
    return isinstance(value, dict) and (value.get("bytes") is not None or bool(value.get("path")))


def rows_to_comparisons(rows: list[dict[str, Any]], fields: dict[str, str], source: str) -> list[Comparison]:
    """Map rows to `Comparison`s with `fields` ({prompt: col, chosen: col, rejected: col, id: col}).

    A missing column or an empty file is one `AssayError` line naming the file and the row.
    """
    unknown = sorted(set(fields) - set(PAIR_FIELDS))
    if unknown:
        raise AssayError(f"{source}: unknown field mapping key {unknown[0]!r}; allowed: {', '.join(PAIR_FIELDS)}")
    names = {k: fields.get(k, k) for k in PAIR_FIELDS}
    out = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i + 1}"
        values = {k: column(row, n) for k, n in names.items()}  # a dotted name reads a nested column
        for key in ("prompt", "chosen", "rejected", *(["id"] if "id" in fields else [])):
            if values[key] is MISSING:
                raise AssayError(f"{where} has no {key} column {names[key]!r} (map it with fields.{key}=COLUMN)")
        prompt = values["prompt"]
        if not isinstance(prompt, str):
            prompt = check_messages(prompt, where)
        extra = {k: v for k, v in row.items() if k not in names.values()}
        subset = str(row.get("subset", row.get("kind", "")) or "")
        out.append(Comparison(id=str(i if values["id"] is MISSING else values["id"]), prompt=prompt,
                              chosen=_responses(values["chosen"], where, names["chosen"]),
                              rejected=_responses(values["rejected"], where, names["rejected"]), subset=subset, fields=extra))
    if not out:
        raise AssayError(f"{source}: no rows (a preference file needs prompt, chosen and rejected columns)")
    return out


def read_comparisons(path: str, fields: dict[str, str] | None = None) -> list[Comparison]:
    """The comparisons of a JSONL/Parquet file or `datasets` folder (see the module doc)."""
    return rows_to_comparisons(read_rows(path), fields or {}, path)


def to_pairs(comparisons: list[Comparison]) -> list[Pair]:
    """Every (chosen, rejected) combination of every comparison, in order."""
    return [Pair(c.prompt, ch, rj, c.subset) for c in comparisons for ch, rj in c.pairs()]


def prompt_key(prompt: str | list[dict[str, Any]]) -> str:
    return prompt if isinstance(prompt, str) else repr(prompt)


def split_by_prompt(comparisons: list[Comparison], fraction: float, seed: int) -> tuple[list[Comparison], list[Comparison]]:
    """`(train, held-out)`: a prompt goes wholly to one side, chosen by a seeded hash of its text.

    No held-out comparison shares a prompt with a training one, so held-out accuracy is on
    prompts the model was not trained on.
    """
    if fraction <= 0:
        return comparisons, []
    salt = f"rm-split:{seed}:"

    def held(c: Comparison) -> bool:
        h = int.from_bytes(hashlib.blake2b((salt + prompt_key(c.prompt)).encode(), digest_size=8).digest(), "big")
        return h / 2**64 < fraction

    train = [c for c in comparisons if not held(c)]
    heldout = [c for c in comparisons if held(c)]
    return train, heldout


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of `n` training pairs in one epoch: a permutation fixed by `(seed, epoch)`.

    The batch of any step is a function of the seed and the step alone, so a resumed run
    reads exactly the pairs an uninterrupted one would.
    """
    order = list(range(n))
    random.Random(f"rm-order:{seed}:{epoch}").shuffle(order)
    return order


def batch_indices(n: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Indices of the pairs of training step `step` (0-based): consecutive slices of the epoch orders."""
    start = step * batch_size
    out = []
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        order = epoch_order(n, seed, epoch)
        out += order[offset : offset + batch_size - len(out)]
    return out
