"""Languages are data: how to compile a program and how to run it, inside the sandbox.

Each entry is a plain dict read by the in-sandbox harness:

- `kind`: "python" runs the source in a child forked from the harness (fast: no interpreter
  start-up per test, and the only kind that supports "call", "assert" and "check" tests;
  such programs run in the worker's fork server); "exec" runs the argv in `run` once per
  test, after `compile` succeeded, in a fresh sandbox per program.
- `source`: the file name the program is written to, under `/box` (read-only).
- `compile`: argv of the compiler or None; it writes into `/tmp`, the scratch tmpfs.
- `run`: argv that runs the compiled program (kind "exec").
- `fence`: names a fenced code block may carry for this language (for extraction).

Adding a language is one entry, for example Rust:

    LANGUAGES["rust"] = {"kind": "exec", "source": "main.rs", "fence": ["rust", "rs"],
                         "compile": ["/usr/bin/rustc", "-O", "-o", "/tmp/prog", "/box/main.rs"],
                         "run": ["/tmp/prog"]}
"""

from __future__ import annotations

from typing import Any

from assay.errors import AssayError

LANGUAGES: dict[str, dict[str, Any]] = {
    "python": {"kind": "python", "source": "main.py", "compile": None, "run": None,
               "fence": ["python", "py", "python3"]},
    "cpp": {"kind": "exec", "source": "main.cpp", "fence": ["cpp", "c++", "cc", "cxx"],
            "compile": ["/usr/bin/g++", "-std=c++17", "-O2", "-pipe", "-o", "/tmp/prog", "/box/main.cpp"],
            "run": ["/tmp/prog"]},
}


def language(name: str) -> dict[str, Any]:
    """The language entry called `name`; an `AssayError` names the known ones otherwise."""
    try:
        return LANGUAGES[name]
    except KeyError:
        raise AssayError(f"unknown language {name!r}; known: {', '.join(sorted(LANGUAGES))}") from None
