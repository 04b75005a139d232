"""Tools: plain typed Python functions, the calls a model writes to them, and running them safely.

A tool is any function with annotated parameters and a docstring; `Tool.from_function`
derives its JSON schema (the OpenAI / Hugging Face function format that chat templates
render). A model calls tools in one of two syntaxes:

- `json`: `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`, the
  format of Qwen2.5/Qwen3 and Hermes chat templates;
- `bracket`: `[add 1 2]` or `[calc 123+456]`, for the bundled character-level model: an
  opening `[`, the tool name, one space (or `:`, which the bundled tokenizer can encode:
  it drops spaces), then the arguments up to the closing `]`. A tool
  with one parameter gets the whole text after the name; a tool with several gets the
  text split on spaces (each converted to its annotated type). The observation is `=` and
  the result: `[calc 123+456]` → `=579`.

`ToolBox.run` turns every call into an observation and an outcome, never an exception:
`ok`, `parse_error` (malformed call, wrong arguments), `unknown_tool`, `tool_error` (the
tool raised) or `timeout` (the tool ran past its deadline, or raised `TimeoutError` for a
deadline of its own). Tools run in a daemon thread
with a deadline; a thread cannot be killed, so a tool that never returns keeps its thread
(it is abandoned and counted as a timeout). With `isolate=True` each call runs in an
`assay.workers.WorkerPool` process instead, killed and replaced at the deadline (a crash is a
`tool_error`); its tools must then be picklable module-level functions. The SQL agent's
probes do their query work in such workers themselves.

    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> box = ToolBox([add], syntax="bracket")
    >>> box.run("[add 2 3]")
    [ToolCall(name='add', outcome='ok', observation='=5')]
    >>> box.run('[nope 1]')[0].outcome
    'unknown_tool'
"""

from __future__ import annotations

import inspect
import json
import re
import threading
import typing
from dataclasses import dataclass
from typing import Any, Callable

OUTCOMES = ("ok", "parse_error", "unknown_tool", "tool_error", "timeout")
SYNTAXES = ("json", "bracket")
_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_BRACKET_CALL = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)(?:[ :]([^\]]*))?\]")


@dataclass
class ToolCall:
    """One call the model made and what came of it."""

    name: str
    outcome: str
    observation: str


class Tool:
    """A typed Python function exposed to a model, with the JSON schema of its parameters.

    Args:
        fn: the function; every parameter annotated (int, float, str, bool, list, dict).
        name: the name the model calls it by (default: the function's name).
        description: what it does (default: the first line of its docstring).
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, description: str | None = None):
        self.fn, self.name = fn, name or fn.__name__
        self.description = description or (inspect.getdoc(fn) or "").split("\n")[0]
        hints = typing.get_type_hints(fn)
        self.params = [p for p in inspect.signature(fn).parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        self.types = {p.name: hints.get(p.name, str) for p in self.params}

    @classmethod
    def from_function(cls, fn: Callable[..., Any] | Tool) -> Tool:
        return fn if isinstance(fn, Tool) else cls(fn)

    @property
    def schema(self) -> dict[str, Any]:
        """The function's JSON schema, as chat templates take it (`tokenizer.apply_chat_template(tools=[...])`)."""
        props = {p.name: {"type": _JSON_TYPES.get(self.types[p.name], "string")} for p in self.params}
        required = [p.name for p in self.params if p.default is inspect.Parameter.empty]
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": props, "required": required}}}

    def bind(self, text: str) -> dict[str, Any]:
        """Arguments from the bracket syntax's text; ValueError when they do not fit the signature."""
        if len(self.params) == 1:
            parts = [text]
        else:
            parts = text.split() if text else []
        if len(parts) > len(self.params):
            raise ValueError(f"{self.name} takes {len(self.params)} arguments, got {len(parts)}")
        return {p.name: parts[i] for i, p in enumerate(self.params) if i < len(parts)}

    def convert(self, args: dict[str, Any]) -> dict[str, Any]:
        """Arguments converted to the annotated types; ValueError for an unknown, missing or unconvertible one."""
        names = {p.name for p in self.params}
        unknown = set(args) - names
        if unknown:
            raise ValueError(f"{self.name} has no argument {sorted(unknown)[0]!r}")
        missing = [p.name for p in self.params if p.default is inspect.Parameter.empty and p.name not in args]
        if missing:
            raise ValueError(f"{self.name} needs argument {missing[0]!r}")
        out = {}
        for k, v in args.items():
            want = self.types[k]
            if want in (int, float) and isinstance(v, str):
                v = want(v.strip())
            elif want is int and isinstance(v, float) and v.is_integer():
                v = int(v)
            elif want is str and not isinstance(v, str):
                v = json.dumps(v)
            out[k] = v
        return out


def parse_calls(text: str, syntax: str) -> list[tuple[str | None, dict[str, Any] | str | None, str]]:
    """The calls in `text`: `(name, arguments, raw)`; name None for a malformed call (arguments hold why).

    json: each `<tool_call>` block; arguments a dict. bracket: each `[name args]`; arguments
    the text after the name (the tool binds it to its parameters).
    """
    if syntax == "json":
        calls: list[tuple[str | None, Any, str]] = []
        for raw in _JSON_CALL.findall(text):
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as e:
                calls.append((None, f"malformed JSON: {e.msg}", raw))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(obj.get("arguments", {}), dict):
                calls.append((None, 'a call is {"name": str, "arguments": {...}}', raw))
                continue
            calls.append((obj["name"], obj.get("arguments", {}), raw))
        if not calls and "<tool_call>" in text:  # opened, never closed
            calls.append((None, "unterminated <tool_call>", text[text.index("<tool_call>"):]))
        return calls
    if syntax == "bracket":
        found = [(m.group(1), m.group(2) or "", m.group(0)) for m in _BRACKET_CALL.finditer(text)]
        if not found and "[" in text:
            return [(None, "a call is [name arguments]", text[text.index("["):])]
        return found  # type: ignore[return-value]
    raise ValueError(f"unknown tool-call syntax {syntax!r}; known: {', '.join(SYNTAXES)}")


class ToolBox:
    """The tools of an environment, the syntax the model calls them in, and a deadline per call.

    Args:
        tools: functions or `Tool`s.
        syntax: `json` or `bracket` (see the module docstring).
        timeout_s: seconds one call may run before it is abandoned as a `timeout`.
        max_chars: an observation is cut to this many characters.
    """

    def __init__(self, tools: list[Callable[..., Any] | Tool], syntax: str = "json", timeout_s: float = 5.0, max_chars: int = 2000,
                 isolate: bool = False, workers: int = 2):
        if syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}; known: {', '.join(SYNTAXES)}")
        self.tools = {t.name: t for t in map(Tool.from_function, tools)}
        self.syntax, self.timeout_s, self.max_chars = syntax, timeout_s, max_chars
        self.isolate, self.workers = isolate, workers

    @property
    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools.values()]

    def has_call(self, text: str) -> bool:
        """True when `text` holds a tool call, well formed or not."""
        return bool(parse_calls(text, self.syntax))

    def run(self, text: str) -> list[ToolCall]:
        """Every call in `text`, run in order; each gives an observation and an outcome, never an exception."""
        return [self._one(name, args, raw) for name, args, raw in parse_calls(text, self.syntax)]

    def _one(self, name: str | None, args: Any, raw: str) -> ToolCall:
        if name is None:
            return self._done("?", "parse_error", f"error: {args}")
        tool = self.tools.get(name)
        if tool is None:
            return self._done(name, "unknown_tool", f"error: unknown tool {name!r}; tools: {', '.join(self.tools)}")
        try:
            kwargs = tool.convert(tool.bind(args) if isinstance(args, str) else args)
        except (ValueError, TypeError) as e:
            return self._done(name, "parse_error", f"error: {e}")
        box = self._in_process(tool.fn, kwargs) if self.isolate else self._in_thread(name, tool.fn, kwargs)
        if box is None:
            return self._done(name, "timeout", f"error: {name} ran past {self.timeout_s:g}s")
        if "timeout" in box:
            return self._done(name, "timeout", f"error: {name} timed out: {box['timeout']}")
        if "error" in box:
            return self._done(name, "tool_error", f"error: {box['error']}")
        return self._done(name, "ok", self.format(box["value"]))

    def _in_thread(self, name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """`{"value"}`, `{"error"}` or `{"timeout"}` from a daemon thread; None when it is still running at the deadline."""
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["value"] = fn(**kwargs)
            except TimeoutError as e:  # the tool's own deadline (a query's progress handler, a subprocess timeout)
                box["timeout"] = str(e)
            except Exception as e:  # the tool's own failure: an observation for the model
                box["error"] = f"{type(e).__name__}: {e}"

        worker = threading.Thread(target=call, daemon=True, name=f"assay-tool-{name}")
        worker.start()
        worker.join(self.timeout_s)
        return None if worker.is_alive() else box

    def _in_process(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """The same from a worker process, killed and replaced at the deadline."""
        from assay.workers import WorkerFailure

        out = _tool_pool(self.workers).map([(fn, kwargs)], [self.timeout_s])[0]
        if isinstance(out, WorkerFailure):
            return None if out.reason == "timeout" else {"error": out.error}
        return out

    def format(self, value: Any) -> str:
        """A tool's return value as the model reads it (`=579` in the bracket syntax, JSON or text otherwise)."""
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        return f"={text}" if self.syntax == "bracket" else text

    def _done(self, name: str, outcome: str, text: str) -> ToolCall:
        return ToolCall(name, outcome, text[: self.max_chars])


def call_tool(job: tuple[Callable[..., Any], dict[str, Any]]) -> dict[str, Any]:
    """In a tool worker process: run one call; `{"value"}`, `{"error"}` or `{"timeout"}` (the tool's own deadline)."""
    fn, kwargs = job
    try:
        return {"value": fn(**kwargs)}
    except TimeoutError as e:
        return {"timeout": str(e)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


_POOLS: dict[int, Any] = {}
_POOLS_LOCK = threading.Lock()


def _tool_pool(workers: int) -> Any:
    """The tool worker pool of that size, started on first use and shared by every `ToolBox(isolate=True)`."""
    from assay.workers import WorkerPool

    with _POOLS_LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = WorkerPool("assay.envs.tools:call_tool", workers, name="tool worker")
        return _POOLS[workers]
