"""Prompt sources: a built-in task or user data (JSONL, JSON or CSV, Parquet, or a `datasets` folder).

A row's prompt is plain text or a conversation (a list of `{"role", "content"}` messages,
the layout TRL, verl and the Hub's RL datasets use); a standard layout (`data.format`) is
converted first (`assay.data.formats`). A source hands out training prompts in a seeded
order and remembers how many it has handed out, so a resumed run continues with exactly
the prompts it would have seen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import io
import json
import random
import zlib
from pathlib import Path
from typing import Any, Iterator

from assay.data.formats import MISSING, column, convert_rows, get_format
from assay.data.tasks import make_task
from assay.data.tasks.base import Task
from assay.errors import AssayError
from assay.log import log
from assay.types import Sample
from assay.vision.inputs import jsonable, resolve_images

CORE_FIELDS = ("prompt", "answer", "id")


def iter_jsonl(path: str | Path, strict: bool = True) -> Iterator[tuple[int, dict[str, Any]]]:
    """`(line number, row)` for each non-blank line of a JSONL file, read as it goes.

    A missing file, a line that is not JSON, or one that is not an object is one
    `AssayError` that names the file and the line. The text is decoded as `_text_lines` says (`strict`).
    """
    with _open_data(path) as f:
        for lineno, line in _text_lines(f, path, strict):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise AssayError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise AssayError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield lineno, row


def _text_lines(f: Any, path: str | Path, strict: bool = True) -> Iterator[tuple[int, str]]:
    """`(line number, text)` for each line of a data file opened in bytes, line ends kept.

    UTF-8, with or without the byte-order mark Windows tools write. A file that starts with UTF-16's byte-order mark (what
    Windows PowerShell 5's `>` and `Out-File` write) is read as UTF-16. Anything else that is not UTF-8 (a spreadsheet
    saved in a Windows code page, Latin-1) is one line naming the file, the line, the column and the byte: decoding it
    with replacement characters would change answers and prompts without a word. Not `strict`: such bytes are read as
    replacement characters (what `assay reward score` does with model outputs, which may end inside a character).
    """
    head = f.peek(4)[:4] if hasattr(f, "peek") else b""
    if head.startswith((b"\xff\xfe", b"\xfe\xff")) and not head.startswith(b"\xff\xfe\x00\x00"):
        text = io.TextIOWrapper(f, encoding="utf-16", errors="strict" if strict else "replace", newline="")
        try:
            yield from enumerate(text, 1)
        except UnicodeDecodeError as e:
            raise AssayError(f"{path}: starts as UTF-16 but is not UTF-16 text ({e.reason}); save it as UTF-8") from None
        finally:
            text.detach()
        return
    lineno = 0
    for chunk in f:
        for raw in chunk.splitlines(keepends=True):  # a line ends at \n, \r\n or a lone \r (a classic Mac's CSV)
            lineno += 1
            try:
                line = raw.decode("utf-8", errors="strict" if strict else "replace")
            except UnicodeDecodeError as e:
                column = len(raw[: e.start].decode("utf-8", errors="replace")) + 1
                raise AssayError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {column}); save it as UTF-8 "
                                 "(a spreadsheet: \"CSV UTF-8\"; a file in a Windows code page: `iconv -f cp1252 -t utf-8`)") from None
            yield lineno, line.removeprefix("\ufeff") if lineno == 1 else line


@contextlib.contextmanager
def _open_data(path: str | Path) -> Iterator[Any]:
    """A data file opened for reading bytes, gunzipped when its name ends in `.gz`. A file that cannot be opened or
    stops reading part-way (missing, a gzip stream cut short or changed, an I/O error) is one line."""
    try:
        with gzip.open(path, "rb") if str(path).endswith(".gz") else open(path, "rb") as f:
            yield f
    except (OSError, EOFError, zlib.error) as e:
        raise AssayError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file (see `iter_jsonl`)."""
    return [row for _, row in iter_jsonl(path)]


def read_json(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a `.json` file, read as Hugging Face `datasets`' JSON loader reads one: JSON Lines if every line is an
    object, else one document, either an array of objects (Alpaca's and many exports' layout) or an object of columns
    (lists of equal length). What is neither is one line naming the file, and the line for a syntax error."""
    try:
        return read_jsonl(path)
    except AssayError as lines_error:
        with _open_data(path) as f:
            text = "".join(line for _, line in _text_lines(f, path))
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            if text.lstrip().startswith("["):
                raise AssayError(f"{path}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno})") from None
            raise lines_error from None
    if isinstance(doc, list):
        for i, row in enumerate(doc):
            if not isinstance(row, dict):
                raise AssayError(f"{path}: item {i} of the array is a {type(row).__name__}; expected a JSON object per row")
        return doc
    if isinstance(doc, dict) and doc and all(isinstance(v, list) for v in doc.values()):
        lengths = {len(v) for v in doc.values()}
        if len(lengths) == 1:
            return [dict(zip(doc, values)) for values in zip(*doc.values())]
    raise AssayError(f"{path}: one JSON {type(doc).__name__} that is not rows; a .json file holds JSON Lines, an array of "
                     "objects, or an object of columns (lists of equal length)")


def read_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a `.jsonl`/`.json`/`.csv` file (or any of them gzipped), a `.parquet` file, or a `datasets` folder saved with
    `save_to_disk`."""
    p = Path(path)
    if not p.exists():
        raise AssayError(f"data path {path!r} does not exist")
    if p.is_dir():
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except (FileNotFoundError, ValueError) as e:
            raise AssayError(f"data folder {path!r} is not a saved Hugging Face dataset: {e}") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return [dict(r) for r in ds]
    if p.suffix == ".jsonl" or "".join(p.suffixes[-2:]) == ".jsonl.gz":
        return read_jsonl(p)
    if p.suffix == ".json" or "".join(p.suffixes[-2:]) == ".json.gz":
        return read_json(p)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise AssayError(f"cannot read parquet file {path!r}: {e}") from None
    if p.suffix == ".csv" or "".join(p.suffixes[-2:]) == ".csv.gz":
        return read_csv(p)
    raise AssayError(f"data file {path!r}: unsupported format {p.suffix!r}; allowed: .jsonl, .json, .csv (gzipped too), .parquet, "
                     "or a datasets folder")


def _column_names(header: list[str]) -> list[str]:
    """The header's names as pandas (and so `datasets`) reads them: an empty one is `Unnamed: i` (the index column
    `to_csv` writes), a repeated one `name.1`, `name.2`, ..."""
    names: list[str] = []
    for i, h in enumerate(header):
        name = h.strip() or f"Unnamed: {i}"
        base, k = name, 0
        while name in names:
            k += 1
            name = f"{base}.{k}"
        names.append(name)
    return names


def read_csv(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a CSV file with a header row (Excel's and pandas' `to_csv` layout; text as `_text_lines` decodes it). A value
    is the string written, and an empty or missing cell None, as `datasets` reads one (a reward that needs numbers reads
    them from the text); column names as `_column_names` gives them. A row with more cells than the header is one line
    naming the file and the line."""
    import csv

    csv.field_size_limit(max(csv.field_size_limit(), 1 << 28))  # a whole program or document in one cell
    with _open_data(path) as f:
        reader = csv.reader(line for _, line in _text_lines(f, path))
        try:
            header = next(reader, None)
            if not header:
                raise AssayError(f"{path}: empty CSV file; the first line names the columns")
            named = _column_names(header)
            rows = []
            for cells in reader:
                if not any(c.strip() for c in cells):
                    continue
                if len(cells) > len(named):
                    raise AssayError(f"{path}:{reader.line_num}: {len(cells)} cells under a header of {len(named)} columns")
                rows.append({name: (cell if cell != "" else None) for name, cell in zip(named, cells + [""] * (len(named) - len(cells)))})
        except csv.Error as e:
            raise AssayError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    return rows




def check_field_keys(fields: dict[str, str], allowed: tuple[str, ...], where: str) -> None:
    """One line for a mapping key that names no field (`data.fields={answr: sol}` would be ignored)."""
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise AssayError(f"{where}: unknown field mapping key {unknown[0]!r}; allowed: {', '.join(allowed)}")


def rows_to_samples(rows: list[dict[str, Any]], fields: dict[str, str], source: str) -> list[Sample]:
    """Map user columns to `Sample`s with `fields` ({prompt: col, answer: col, id: col}; a dotted name reads a
    nested column, see `column`).

    A prompt is a string or a list of `{"role", "content"}` messages; anything else is one
    line naming the row. A row without its prompt, or without a column that `fields` names
    (an answer mapped to a column that is not there), is one line naming the row and column;
    an unmapped `answer` or `id` column may be absent (the answer is then None).
    """
    check_field_keys(fields, CORE_FIELDS, f"{source}: data.fields")
    names = {k: fields.get(k, k) for k in CORE_FIELDS}
    out = []
    for i, row in enumerate(rows):
        values = {k: column(row, n) for k, n in names.items()}
        for k, v in values.items():
            if v is MISSING and (k == "prompt" or k in fields):
                raise AssayError(f"{source}: row {i + 1} has no {k} column {names[k]!r}; its columns: {_names(row)} "
                                 f"(map one with data.fields.{k}=COLUMN)")
        prompt = values["prompt"]
        if not isinstance(prompt, str):
            prompt = check_messages(prompt, f"{source}: row {i + 1}")
        extra = {k: v for k, v in row.items() if k not in names.values()}
        answer = None if values["answer"] is MISSING else values["answer"]
        out.append(Sample(id=str(i if values["id"] is MISSING else values["id"]), prompt=prompt, answer=answer, fields=extra))
    if not out:
        raise AssayError(f"{source}: no rows")
    return out


def _names(row: dict[str, Any], most: int = 12) -> str:
    """The column names of `row`, and one level into a nested object as `data.fields` would name them (`data.question`
    for rows a JSON file keeps under `data`), for a message."""
    def rows_inside(v: Any) -> bool:  # `{"data": [{...}, ...]}`: rows kept under one key, which read as one row
        return isinstance(v, list) and len(v) > 1 and all(isinstance(x, dict) and "role" not in x for x in v)

    names = [f"{k}.{sub}" if sub is not None else f"{k} (a list of {len(v)} objects; rows kept under one key read as one row: give "
             "them as a JSON array or one per line)" if rows_inside(v) else str(k)
             for k, v in row.items() for sub in (list(v) if isinstance(v, dict) and v else [None])]
    return ", ".join(names[:most]) + (f", ... ({len(names)} in all)" if len(names) > most else "") if names else "none"


def check_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    """`prompt` as a conversation: a non-empty list of messages, each with a string `role` and a `content`."""
    if not isinstance(prompt, list) or not prompt:
        raise AssayError(f"{where}: prompt must be a string or a non-empty list of {{role, content}} messages, got {type(prompt).__name__}")
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise AssayError(f"{where}: message {j + 1} of the prompt is not a {{role, content}} object: {str(m)[:80]!r}")
    return [dict(m) for m in prompt]


def as_chat(samples: list[Sample], data, source: str) -> list[Sample]:
    """Conversations as `data` asks: a plain prompt becomes a user message with `data.chat`; `data.system_prompt`
    goes first where a conversation has no system message; template arguments from `data.chat_template_kwargs`
    and the row's own `chat_template_kwargs` column (which wins)."""
    out = []
    for s in samples:
        prompt = s.prompt
        if isinstance(prompt, str):
            if not data.chat:
                if data.system_prompt is not None:
                    raise AssayError(f"{source}: row id {s.id!r} has a plain-text prompt and data.system_prompt needs a conversation "
                                     "(set data.chat=true to send plain prompts as a user message through the chat template)")
                out.append(s)
                continue
            prompt = [{"role": "user", "content": prompt}]
        if data.system_prompt is not None and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": data.system_prompt}, *prompt]
        row_args = s.fields.get("chat_template_kwargs")
        args = {**data.chat_template_kwargs, **(row_args if isinstance(row_args, dict) else {})}
        out.append(dataclasses.replace(s, prompt=prompt, template_args=args or None))
    return out


def samples_from(path: str, data) -> list[Sample]:
    """The samples of a data file as a `DataConfig` reads it: its format converted, columns mapped, chat applied."""
    rows, fields = read_rows(path), data.fields
    if data.format:

        rows, skipped = convert_rows(rows, data.format, fields, path)
        fields = {}
        if skipped:
            log.warning(f"{path}: {skipped} rows have no tests and are left out (data.format={data.format})")
    return as_chat(resolve_images(rows_to_samples(rows, fields, path), Path(path).parent if Path(path).is_file() else Path(path), path), data, path)


def data_reward(data) -> str | dict[str, Any] | None:
    """The reward a data source brings: its format's (`data.format`), else None."""
    if data.path and data.format:

        return get_format(data.format).reward
    return None


class PromptSource:
    """Training prompts in a seeded order, and a fixed held-out list."""

    def __init__(self, train: list[Sample] | Task, heldout: list[Sample], seed: int, reward: str | None = None):
        self.reward = reward
        self.heldout = heldout
        self.seed = seed
        self.consumed = 0
        self._task = train if isinstance(train, Task) else None
        self._rows = None if isinstance(train, Task) else train
        self._fit: PromptLimit | None = None
        self._restart()

    def _restart(self) -> None:
        if self._task is not None:
            self._it = self._task.stream("train", self.seed)
        else:
            self._order: list[int] = []

    def limit(self, fit: "PromptLimit") -> None:
        """Hold every prompt to `fit`: held-out and training rows now (one error, or dropped or
        truncated with one warning), a task's prompts as they are drawn."""
        self._fit = fit
        self.heldout = fit.apply(self.heldout, "held-out data")
        if self._rows is not None:
            self._rows = fit.apply(self._rows, "training data")
            if not self._rows:
                raise AssayError("data: every training prompt is too long for the model (data.overlong=drop left none)")

    def _next(self) -> Sample:
        if self._task is not None:
            while True:  # a task's prompts are checked as they come (a dropped one is skipped, the same way on resume)
                s = next(self._it)
                if self._fit is None or (s := self._fit.one(s, "task problem")) is not None:
                    return s
        if not self._order:
            epoch = self.consumed // len(self._rows)
            self._order = list(range(len(self._rows)))
            random.Random(f"{self.seed}:{epoch}").shuffle(self._order)
            self._order.reverse()
        return self._rows[self._order.pop()]

    def next_batch(self, n: int) -> list[Sample]:
        out = [self._next() for _ in range(n)]
        self.consumed += n
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = 0
        self._restart()
        target = state["consumed"]
        while self.consumed < target:
            self._next()
            self.consumed += 1


class PromptLimit:
    """Prompts of at most `max_tokens` tokens (the model's context less `rollout.max_new_tokens`).

    `policy` (`data.overlong`): `error` refuses an over-long prompt in one line naming it;
    `drop` leaves it out (one warning counts them); `truncate` keeps its last
    `max_tokens` tokens, cut at a token boundary of the text.
    """

    def __init__(self, tokenizer, max_tokens: int, policy: str, context: int):
        self.tokenizer, self.max_tokens, self.policy, self.context = tokenizer, max_tokens, policy, context

    def _length(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def one(self, s: Sample, where: str) -> Sample | None:
        from assay.rollout.base import encode_prompt

        n = len(encode_prompt(self.tokenizer, s))
        if n <= self.max_tokens:
            return s
        if self.policy == "error":
            raise AssayError(f"{where} id {s.id!r}: the prompt is {n} tokens; the model takes {self.context} positions, so with "
                             f"rollout.max_new_tokens a prompt may have at most {self.max_tokens} (shorten it, or set data.overlong=drop or truncate)")
        if self.policy == "drop":
            return None
        if not isinstance(s.prompt, str) or s.prompt_ids is not None:
            raise AssayError(f"{where} id {s.id!r}: the prompt is {n} tokens (at most {self.max_tokens}) and only a plain-text prompt "
                             "can be truncated (set data.overlong=drop)")
        return dataclasses.replace(s, prompt=self._tail(s.prompt))

    def _tail(self, text: str) -> str:
        """The end of `text` that is at most `max_tokens` tokens, starting on a token boundary."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        cut = len(enc["input_ids"]) - self.max_tokens
        start = enc["offset_mapping"][cut][0]
        while start < len(text) and self._length(text[start:]) > self.max_tokens:
            start += 1
        return text[start:]

    def apply(self, rows: list[Sample], where: str) -> list[Sample]:
        kept = [x for x in (self.one(s, where) for s in rows) if x is not None]
        changed = len(rows) - len(kept) if self.policy == "drop" else sum(a.prompt != b.prompt for a, b in zip(rows, kept))
        if changed:
            log.warning(f"{where}: {changed} prompts longer than {self.max_tokens} tokens were {'dropped' if self.policy == 'drop' else 'truncated from the left'}")
        return kept


def prompt_key(sample: Sample) -> str:
    """What makes two rows the same problem: the prompt (JSON for a list of chat messages, a picture by its pixels' digest)."""
    return sample.prompt if isinstance(sample.prompt, str) else json.dumps(jsonable(sample.prompt), sort_keys=True)


def split_heldout(rows: list[Sample], fraction: float, seed: int, source: str) -> tuple[list[Sample], list[Sample]]:
    """`(train, heldout)`: a seeded `fraction` of the rows held out, every copy of a held-out prompt with it.

    Rows that repeat a prompt land on the same side, so a problem is never both trained
    on and held out; a split that would leave nothing to train on is refused.
    """
    if fraction <= 0:
        return rows, []
    cut = max(1, int(len(rows) * fraction))
    shuffled = rows[:]
    random.Random(f"split:{seed}").shuffle(shuffled)
    held = {prompt_key(s) for s in shuffled[:cut]}
    heldout = [s for s in shuffled if prompt_key(s) in held]
    train = [s for s in shuffled if prompt_key(s) not in held]
    if not train:
        raise AssayError(f"{source}: {len(rows)} rows; holding out data.eval_fraction={fraction:g} of them leaves none to train on "
                         "(lower data.eval_fraction, add rows, or give data.eval_path)")
    return train, heldout


def drop_overlap(train: list[Sample], heldout: list[Sample], source: str) -> list[Sample]:
    """Training rows whose prompt is not also held out (one warning line counts the others)."""
    held = {prompt_key(s) for s in heldout}
    kept = [s for s in train if prompt_key(s) not in held]
    if len(kept) < len(train):
        log.warning(f"{source}: {len(train) - len(kept)} training rows repeat a held-out prompt and are left out of training")
    if not kept:
        raise AssayError(f"{source}: every training row is also in the held-out data (data.eval_path)")
    return kept


def build_source(data, seed: int, eval_n: int) -> PromptSource:
    """A `PromptSource` from a `DataConfig`; training rows never share a prompt with held-out ones."""
    if data.path:
        rows = samples_from(data.path, data)
        if data.eval_path:
            heldout = samples_from(data.eval_path, data)
            rows = drop_overlap(rows, heldout, data.path)
        else:
            rows, heldout = split_heldout(rows, data.eval_fraction, seed, data.path)
        return PromptSource(rows, heldout[:eval_n], seed, reward=data_reward(data))
    if not data.task:
        raise AssayError("data: give a built-in task (data.task=arithmetic) or a file (data.path=FILE)")
    if data.chat or data.system_prompt is not None:
        raise AssayError(f"data.chat and data.system_prompt apply to data files (data.path); the built-in task {data.task!r} has plain-text prompts")
    task = make_task(data.task, **data.task_args)
    return PromptSource(task, task.heldout(eval_n), seed, reward=task.reward)
