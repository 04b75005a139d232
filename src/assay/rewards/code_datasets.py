"""Mechanical conversion of public code benchmarks into `code` reward tests.

- **HumanEval** (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
  arXiv:2107.03374): the row's `test` defines `check(candidate)`; it becomes a check test
  whose `setup` is the problem's trusted reference program (prompt + canonical solution),
  so every name the test uses besides `candidate` resolves to the dataset's own code and
  never to the program's. Upstream runs the test inside the program's namespace, where a
  program can redefine them: HumanEval/32's test asserts `poly(coeffs, candidate(coeffs))`
  is 0, with `poly` taken from the program, so `def poly(xs, x): return 0` passes with any
  answer; HumanEval/38 and /50 build their inputs with the program's `encode_cyclic` /
  `encode_shift`; HumanEval/33 compares the candidate with `sort_third`, the program itself.
- **MBPP** (Austin et al. 2021, "Program Synthesis with Large Language Models",
  arXiv:2108.07732): the assert list becomes the body of a check function in which the
  function's name is bound to `candidate`; modules the asserts use (`math.isclose`) are
  imported in the setup with the row's `test_setup_code`.
- **APPS** (Hendrycks et al. 2021, "Measuring Coding Challenge Competence With APPS",
  arXiv:2105.09938): standard-input problems become a stdio group; call-based problems
  (`fn_name`) one check test per case, accepting the output or, when it is a one-element
  list, its element, with tuples read as lists (APPS's own comparison).

    >>> mbpp_tests({"test_list": ["assert add(1, 2) == 3"]})["entry_point"]
    'add'
"""

from __future__ import annotations

import ast
import builtins
import json
import sys
import textwrap
from collections import Counter
from typing import Any

from assay.errors import AssayError


def humaneval_tests(problem: dict[str, Any]) -> dict[str, Any]:
    """A HumanEval problem's test as a check test group (setup: its reference program)."""
    prompt, entry = problem["prompt"], problem["entry_point"]
    reference = problem.get("canonical_solution")
    setup = prompt + reference if reference else _without_function(prompt, entry)
    return {"kind": "check", "entry_point": entry, "test": problem["test"], "setup": setup, "check": "check"}


def humaneval_program(problem: dict[str, Any], completion: str | None = None) -> str:
    """The program HumanEval scores: the prompt followed by the completion (canonical if None)."""
    return problem["prompt"] + (problem["canonical_solution"] if completion is None else completion)


def _without_function(source: str, name: str) -> str:
    """`source` with its top-level function `name` removed (a prompt's stub)."""
    tree = ast.parse(source)
    tree.body = [n for n in tree.body if not (isinstance(n, ast.FunctionDef) and n.name == name)]
    return ast.unparse(tree)


def mbpp_tests(row: dict[str, Any], challenge: bool = False) -> dict[str, Any]:
    """An MBPP row's asserts as one check test group.

    Args:
        row: with `test_list`, optional `challenge_test_list`, `test_setup_code`, `entry_point`.
        challenge: also run the challenge asserts.
    """
    asserts = list(row["test_list"]) + (list(row.get("challenge_test_list") or []) if challenge else [])
    entry = row.get("entry_point") or called_function(asserts)
    body = "\n".join(textwrap.indent(a.strip(), "    ") for a in asserts)
    test = f"def check(candidate):\n    {entry} = candidate\n{body}\n"
    imports = [f"import {m}" for m in sorted(_free_modules(asserts, entry))]
    setup = "\n".join(imports + [row.get("test_setup_code") or ""]).strip() + "\n"
    return {"kind": "check", "entry_point": entry, "test": test, "setup": setup, "check": "check"}


def called_function(asserts: list[str]) -> str:
    """The one non-builtin function the asserts call by name; AssayError when it is not one."""
    names: Counter[str] = Counter()
    for a in asserts:
        for node in ast.walk(ast.parse(a.strip())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not hasattr(builtins, node.func.id):
                names[node.func.id] += 1
    if len(names) != 1:
        raise AssayError(f"cannot tell which function the asserts test (calls {sorted(names)}); set 'entry_point'")
    return next(iter(names))


def _free_modules(asserts: list[str], entry: str) -> set[str]:
    used = {n.id for a in asserts for n in ast.walk(ast.parse(a.strip())) if isinstance(n, ast.Name)}
    return {u for u in used - {entry} if u in sys.stdlib_module_names and not hasattr(builtins, u)}


def apps_tests(row: dict[str, Any]) -> list[dict[str, Any]]:
    """An APPS row's `input_output` as test groups: one stdio group, or one check test per case."""
    io = row["input_output"]
    io = json.loads(io) if isinstance(io, str) else io
    inputs, outputs = io.get("inputs") or [], io.get("outputs") or []
    if len(inputs) != len(outputs) or not inputs:
        raise AssayError("APPS input_output needs as many inputs as outputs, at least one")
    fn = io.get("fn_name")
    if not fn:
        cases = [{"input": _text(i), "output": _text(o)} for i, o in zip(inputs, outputs)]
        return [{"kind": "stdio", "cases": cases}]
    return [_apps_call(fn, args, out) for args, out in zip(inputs, outputs)]


_APPS_CHECK = """def check(candidate):
    got = candidate(*ARGS)
    if isinstance(got, tuple):
        got = list(got)
    one = isinstance(EXPECTED, list) and len(EXPECTED) == 1
    assert got == EXPECTED or (one and got == EXPECTED[0])
"""


def _apps_call(fn: str, args: Any, expected: Any) -> dict[str, Any]:
    args = args if isinstance(args, list) else [args]
    setup = f"import json\nARGS = json.loads({json.dumps(args)!r})\nEXPECTED = json.loads({json.dumps(expected)!r})\n"
    return {"kind": "check", "entry_point": fn, "test": _APPS_CHECK, "setup": setup, "check": "check"}


def _text(v: Any) -> str:
    return "\n".join(map(str, v)) + "\n" if isinstance(v, list) else str(v)
