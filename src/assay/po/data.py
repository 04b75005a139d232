"""Preference files in the layouts TRL and the Hub use, read and tokenised for training.

Read from JSONL, JSON or CSV (gzipped too), Parquet or a `datasets` folder (`assay.data.datasets.read_rows`);
columns are renamed with a field mapping (`{prompt: question, chosen: good}`; a dotted name
reads a nested column). The layout is that of the first row:

| layout | columns | as TRL calls it |
|---|---|---|
| explicit prompt | `prompt`, `chosen`, `rejected` as text (`assay rm pairs` output, RewardBench) | standard preference |
| conversational | `prompt` a list of `{role, content}` messages; `chosen`/`rejected` lists of assistant messages | conversational preference |
| whole conversations | `chosen`/`rejected` whole conversations sharing their first messages, with or without a `prompt` column (HuggingFaceH4/ultrafeedback_binarized, trl-lib/ultrafeedback_binarized) | implicit prompt |
| implicit text prompt | `chosen`/`rejected` text sharing a prefix, no `prompt` (Anthropic/hh-rlhf) | implicit prompt |
| several responses | `chosen`/`rejected` lists of strings: every chosen × rejected pair (RewardBench 2) | — |
| unpaired | `prompt`, `completion`, `label` (true: desirable), for `kto` | unpaired preference |

An implicit prompt is the longest shared prefix of chosen and rejected: whole messages for
conversations, characters for text (a space just before the split stays with the responses),
as TRL's `extract_prompt`. Tokens: a text prompt is encoded as every sampler encodes it
(`assay.rollout.base.encode_prompt`, no special tokens) and a text response separately with
EOS appended, so training sees the tokens generation produces; a conversation's response is
what the chat template adds after the prompt's rendering with the generation prompt (as TRL:
where the two renderings differ, the response starts at the first token they differ in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from assay.data.datasets import MISSING, check_messages, column, read_rows
from assay.errors import AssayError
from assay.log import log
from assay.types import Sample, Trajectory

FIELDS = ("prompt", "chosen", "rejected", "completion", "label", "id")

Text = str | list[dict[str, Any]]


@dataclass
class PairText:
    """One preference pair before tokenising: `prompt`, the `chosen` response above the `rejected` one."""

    id: str
    prompt: Text
    chosen: Text
    rejected: Text
    subset: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class SingleText:
    """One unpaired response with its label (`desirable`)."""

    id: str
    prompt: Text
    completion: Text
    desirable: bool
    subset: str = ""
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class PairRow:
    """A tokenised pair: two trajectories of one prompt (the loss mask says which tokens are the model's)."""

    chosen: Trajectory
    rejected: Trajectory
    subset: str = ""


@dataclass
class SingleRow:
    """A tokenised unpaired response."""

    traj: Trajectory
    desirable: bool
    subset: str = ""


def common_prefix(a: list, b: list) -> int:
    """How many leading items `a` and `b` share.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """`(prompt, chosen, rejected)` with the prompt the longest shared prefix, as TRL's `extract_prompt`.

    >>> extract_prompt("Q: 2+2? A: 4", "Q: 2+2? A: 5")
    ('Q: 2+2? A:', ' 4', ' 5')
    """
    n = common_prefix(chosen, rejected)  # type: ignore[arg-type]
    if isinstance(chosen, str) and 0 < n < min(len(chosen), len(rejected)) and chosen[n - 1] == " ":
        n -= 1  # the space before the split belongs to the responses
    return chosen[:n], chosen[n:], rejected[n:]


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)


def _responses(value: Any, where: str, name: str) -> list[Text]:
    """A response column as a list of responses: text, a message list, or several texts (RewardBench 2)."""
    if isinstance(value, str):
        return [value]
    if _is_messages(value):
        return [check_messages(value, f"{where} ({name})")]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise AssayError(f"{where}: column {name!r} must be text, a list of {{role, content}} messages or a list of texts, "
                     f"got {str(value)[:60]!r}")


def _split_conversation(prompt: Any, chosen: Text, rejected: Text, where: str) -> tuple[Text, Text, Text]:
    """Whole conversations → (prompt messages, chosen remainder, rejected remainder); a text prompt with message responses
    and no shared messages becomes one user message."""
    if isinstance(chosen, list) and isinstance(rejected, list):
        shared, c, r = extract_prompt(chosen, rejected)
        if shared:
            if not c or not r:
                raise AssayError(f"{where}: chosen and rejected are the same conversation (nothing follows their shared messages)")
            return shared, c, r
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
    if prompt is MISSING:
        if isinstance(chosen, list) != isinstance(rejected, list):
            raise AssayError(f"{where}: chosen and rejected must both be text or both be conversations")
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
        if not prompt:
            raise AssayError(f"{where}: no prompt column and chosen and rejected share no prefix to take it from (map it with fields.prompt=COLUMN)")
    elif not isinstance(prompt, str):
        prompt = check_messages(prompt, where)
    if isinstance(prompt, str) and isinstance(chosen, list):
        raise AssayError(f"{where}: a text prompt with message-list responses that share no first messages; give the prompt as messages")
    return prompt, chosen, rejected


def rows_to_preferences(rows: list[dict[str, Any]], fields: dict[str, str], source: str) -> list[PairText] | list[SingleText]:
    """Rows → pairs (or unpaired responses), the layout read off the first row; one `AssayError` line for a bad row."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise AssayError(f"{source}: unknown field mapping key {unknown[0]!r}; allowed: {', '.join(FIELDS)}")
    if not rows:
        raise AssayError(f"{source}: no rows (a preference file needs chosen and rejected columns, or completion and label)")
    names = {k: fields.get(k, k) for k in FIELDS}
    first = {k: column(rows[0], n) for k, n in names.items()}
    paired = first["chosen"] is not MISSING or first["rejected"] is not MISSING
    if not paired and (first["completion"] is MISSING or first["label"] is MISSING):
        raise AssayError(f"{source}: row 1 has neither chosen and rejected columns nor completion and label "
                         "(map them with fields.chosen=COLUMN ...; docs/preference.md lists the layouts)")
    out: list = []
    for i, row in enumerate(rows):
        where = f"{source}: row {i + 1}"
        v = {k: column(row, n) for k, n in names.items()}
        need = ("chosen", "rejected") if paired else ("prompt", "completion", "label")
        for key in need:
            if v[key] is MISSING:
                raise AssayError(f"{where} has no {key} column {names[key]!r} (map it with fields.{key}=COLUMN)")
        rid = str(i if v["id"] is MISSING else v["id"])
        subset = str(row.get("subset", row.get("kind", "")) or "")
        extra = {k: x for k, x in row.items() if k not in names.values()}
        if not paired:
            label = v["label"]
            if not isinstance(label, bool) and label not in (0, 1):
                raise AssayError(f"{where}: label must be true/false (desirable or not), got {label!r}")
            prompt = v["prompt"] if isinstance(v["prompt"], str) else check_messages(v["prompt"], where)
            completion = _responses(v["completion"], where, names["completion"])
            if len(completion) != 1:
                raise AssayError(f"{where}: completion must be one response")
            out.append(SingleText(rid, prompt, completion[0], bool(label), subset, extra))
            continue
        for c in _responses(v["chosen"], where, names["chosen"]):
            for r in _responses(v["rejected"], where, names["rejected"]):
                prompt, ch, rj = _split_conversation(v["prompt"], c, r, where)
                out.append(PairText(rid, prompt, ch, rj, subset, extra))
    return out


def read_preferences(path: str, fields: dict[str, str] | None = None) -> list[PairText] | list[SingleText]:
    """The pairs (or unpaired responses) of a JSONL/Parquet file or `datasets` folder (see the module doc)."""
    return rows_to_preferences(read_rows(path), fields or {}, path)


# ---------------------------------------------------------------- tokenising


def _prompt_ids(tokenizer: Any, prompt: Text, sid: str) -> list[int]:
    from assay.rollout.base import encode_prompt

    return encode_prompt(tokenizer, Sample(sid, prompt))


def _full_chat(tokenizer: Any, prompt: Text, response: list[dict[str, Any]], sid: str) -> list[int]:
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    try:
        return list(tokenizer.apply_chat_template(msgs + response, tokenize=True, return_dict=True)["input_ids"])
    except Exception as e:  # jinja's own errors
        raise AssayError(f"row {sid!r}: the chat template failed on this conversation: {type(e).__name__}: {e}".splitlines()[0]) from None


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return ids if ids and ids[-1] == eos else ids + [eos]


def encode_responses(tokenizer: Any, prompt: Text, responses: list[Text], sid: str) -> tuple[list[int], list[list[int]]]:
    """`(prompt ids, each response's ids)` of one prompt (see the module doc)."""
    p = _prompt_ids(tokenizer, prompt, sid)
    if all(isinstance(r, str) for r in responses):
        return p, [_text_ids(tokenizer, r) for r in responses]  # type: ignore[arg-type]
    fulls = [_full_chat(tokenizer, prompt, r if isinstance(r, list) else [{"role": "assistant", "content": r}], sid) for r in responses]
    n = min(common_prefix(p, f) for f in fulls)
    if n < len(p):
        log.warning(f"row {sid!r}: the chat template renders the prompt alone differently from the prompt followed by a reply; "
                    "the responses start where the two renderings differ (as TRL does)")
    return p[:n], [f[n:] for f in fulls]


def _text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def as_trajectory(sample: Sample, prompt_ids: list[int], ids: list[int], tokenizer: Any) -> Trajectory:
    """A response as the learner's unit: every token the model's (loss mask all ones)."""
    return Trajectory(sample, _text(tokenizer, ids), list(prompt_ids), list(ids), [0.0] * len(ids), True)


def encode(items: list[PairText] | list[SingleText], tokenizer: Any, max_length: int, source: str) -> list[PairRow] | list[SingleRow]:
    """Tokenised rows; a row longer than `max_length` tokens (prompt and its longest response) is left out, with a count."""
    out: list = []
    dropped = 0
    for it in items:
        sample = Sample(it.id, it.prompt, it.fields.get("answer"), dict(it.fields))
        if isinstance(it, PairText):
            p, (c, r) = encode_responses(tokenizer, it.prompt, [it.chosen, it.rejected], it.id)
            if not c or not r:
                raise AssayError(f"{source}: row {it.id!r} has an empty response after tokenising")
            if len(p) + max(len(c), len(r)) > max_length:
                dropped += 1
                continue
            out.append(PairRow(as_trajectory(sample, p, c, tokenizer), as_trajectory(sample, p, r, tokenizer), it.subset))
        else:
            p, (c,) = encode_responses(tokenizer, it.prompt, [it.completion], it.id)
            if len(p) + len(c) > max_length:
                dropped += 1
                continue
            out.append(SingleRow(as_trajectory(sample, p, c, tokenizer), it.desirable, it.subset))
    if dropped:
        log.warning(f"{source}: {dropped} of {len(items)} rows are longer than {max_length} tokens and are left out")
    if not out:
        raise AssayError(f"{source}: every row is longer than {max_length} tokens (data.max_length)")
    return out


def mismatched(prompt_of: Trajectory, response_of: Trajectory) -> Trajectory:
    """One row's prompt with another row's response: the KL reference point of KTO."""
    return Trajectory(prompt_of.sample, response_of.completion, list(prompt_of.prompt_ids), list(response_of.completion_ids),
                      [0.0] * len(response_of.completion_ids), True, loss_mask=response_of.loss_mask)
