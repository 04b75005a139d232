"""What every typed config of assay shares: a section that forbids unknown keys, YAML files and dotted `key=value`
overrides read into plain data, and the one explainer that turns a validation error into a line naming the key, the
value given and what is allowed (`assay train`'s config, and `assay rm`'s, `assay po`'s and `assay bench`'s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from assay.errors import AssayError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set `a.b.c=value` in the nested dict `data` (the value is read as YAML)."""
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise AssayError(f"override {item!r} is not key=value (for example train.steps=100)")
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise AssayError(f"override {item!r}: {p!r} is not a section")
        node = nxt
    node[parts[-1]] = _parse_value(value)


def explain(err: ValidationError, data: dict[str, Any], root: type[BaseModel], what: str = "config") -> str:
    """One line for the first validation error: the dotted key, the value given, what is allowed.

    `root` is the top-level model (`RunConfig`, `RMConfig`, ...); `what` names the kind of config
    in the message ("config", "bench config", ...).
    """
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    value: Any = data
    for p in e["loc"]:
        if isinstance(value, list) and isinstance(p, int):
            value = value[p] if p < len(value) else None
        else:
            value = value.get(p, None) if isinstance(value, dict) else None
    if e["type"] == "extra_forbidden":
        section: type[BaseModel] = root
        for p in e["loc"][:-1]:
            ann = section.model_fields.get(str(p))
            section = ann.annotation if ann and isinstance(ann.annotation, type) and issubclass(ann.annotation, BaseModel) else section
        allowed = ", ".join(section.model_fields)
        return f"unknown {what} key {loc!r}; allowed here: {allowed}"
    if e["type"] == "value_error" and str(e["msg"]).startswith("Value error, invalid config value"):
        return str(e["msg"]).removeprefix("Value error, ")  # a cross-field check, already one full line
    return f"invalid {what} value {loc}={value!r}: {e['msg']}"


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line with where it is: `line 3, column 7: mapping values are not allowed here`."""
    if isinstance(e, yaml.reader.ReaderError) and isinstance(e.character, int) and e.encoding != "unicode":  # bytes, not text
        return f"byte offset {e.position}: 0x{e.character:02x} is not {e.encoding} text ({e.reason}); save it as UTF-8"
    if isinstance(e, yaml.reader.ReaderError):  # a control character in the text
        return f"character {e.position}: {e.reason} (U+{e.character if isinstance(e.character, int) else 0:04X})"
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}" + (f" ({context})" if context else "")


def read_yaml_mapping(path: str) -> dict[str, Any]:
    """The mapping at the top of a YAML config file; one `AssayError` line for anything else."""
    p = Path(path)
    if not p.is_file():
        raise AssayError(f"config file {path!r} does not exist")
    try:
        loaded = yaml.safe_load(p.read_bytes())  # bytes: PyYAML decodes UTF-8 or UTF-16 by their marks, and says where it is neither
    except OSError as e:
        raise AssayError(f"cannot read config file {path!r}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise AssayError(f"config file {path!r} is not valid YAML: {yaml_problem(e)}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise AssayError(f"config file {path!r} must hold a mapping at the top level")
    return loaded or {}
