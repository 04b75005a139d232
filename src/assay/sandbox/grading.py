"""The trusted parent's side of grading: decode results, compare, and split asserts.

Nothing here runs untrusted code. Values come back from the sandbox as JSON in the tagged
encoding of `harness.py` and are decoded into exact plain types, so a rigged `__eq__`
cannot exist on this side. Assert tests are split so that the sandbox only evaluates the
sub-expressions that need the program (`f(1)` in `assert f(1) == 2`); the expected side and
the comparison itself are evaluated here, on the decoded values.

    >>> check = split_assert("assert f(1) == 2")
    >>> check.exprs
    ['f(1)']
    >>> check.passes([2]), check.passes([3])
    (True, False)
    >>> stdout_matches(b"3 \\n\\n", "3\\n", "lines")
    True
"""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from typing import Any

from assay.errors import AssayError

SAFE_FUNCS: dict[str, Any] = {f.__name__: f for f in (
    abs, all, any, bool, dict, divmod, enumerate, float, frozenset, int, isinstance, len, list, max,
    min, pow, range, reversed, round, set, sorted, str, sum, tuple, zip, type, repr, chr, ord, map, filter)}
SAFE_MODULES: dict[str, Any] = {"math": math}
_MAX_DEPTH = 200


def decode(text: str) -> Any:
    """A result sent by the harness, as exact plain Python values; ValueError if malformed."""
    try:
        parsed = json.loads(text)
    except RecursionError:
        raise ValueError("malformed result: RecursionError") from None
    return decode_value(parsed)


def decode_value(parsed: Any) -> Any:
    """An already JSON-parsed result in the tagged encoding, as exact plain values; ValueError if malformed."""
    try:
        return _decode(parsed, 0)
    except (TypeError, RecursionError, KeyError) as e:
        raise ValueError(f"malformed result: {type(e).__name__}") from None


def _decode(v: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise ValueError("result nested too deeply")
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [_decode(x, depth + 1) for x in v]
    if type(v) is dict and len(v) in (1, 2):
        if "T" in v:
            return tuple(_decode(x, depth + 1) for x in v["T"])
        if "S" in v:
            items = [_decode(x, depth + 1) for x in v["S"]]
            return frozenset(items) if v.get("f") is True else set(items)
        if "D" in v:
            return {_decode(k, depth + 1): _decode(x, depth + 1) for k, x in v["D"]}
        if "B" in v:
            return bytes.fromhex(v["B"])
    raise ValueError("malformed result")


# --- stdio -------------------------------------------------------------------------------

WHITESPACE_MODES = ("exact", "lines", "tokens")


def stdout_matches(actual: bytes, expected: str, whitespace: str = "lines") -> bool:
    """Compare a program's output with the expected text.

    Modes: "exact" (bytes equal), "lines" (trailing spaces of each line and trailing blank
    lines ignored; same number of lines), "tokens" (whitespace-separated tokens equal).
    """
    if whitespace == "exact":
        return actual == expected.encode()
    text = actual.decode("utf-8", "replace")
    if whitespace == "tokens":
        return text.split() == expected.split()
    return _lines(text) == _lines(expected)


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


# --- call --------------------------------------------------------------------------------


def json_view(v: Any) -> Any:
    """A decoded result as JSON would carry it: tuples become lists, dict keys strings."""
    if type(v) in (list, tuple):
        return [json_view(x) for x in v]
    if type(v) is dict:
        return {k if type(k) is str else json.dumps(k): json_view(x) for k, x in v.items()}
    return v


def values_equal(actual: Any, expected: Any, float_tol: float = 1e-6) -> bool:
    """Type-strict equality of plain JSON values; numbers within `float_tol` when a float is involved.

    A bool only equals a bool, a set result equals a list of the same distinct elements,
    lists must have the same length.
    """
    a, e = actual, expected
    if type(a) in (set, frozenset):
        return type(e) is list and _set_equal(a, e)
    if type(a) is bool or type(e) is bool:
        return type(a) is bool and type(e) is bool and a == e
    if type(a) in (int, float) and type(e) in (int, float):
        if type(a) is int and type(e) is int:
            return a == e
        return math.isclose(a, e, rel_tol=float_tol, abs_tol=float_tol) or a == e
    if type(a) is list and type(e) is list:
        return len(a) == len(e) and all(values_equal(x, y, float_tol) for x, y in zip(a, e))
    if type(a) is dict and type(e) is dict:
        return a.keys() == e.keys() and all(values_equal(a[k], e[k], float_tol) for k in a)
    return type(a) is type(e) and a == e


def _set_equal(a: set | frozenset, e: list) -> bool:
    try:
        return set(a) == {tuple(x) if type(x) is list else x for x in e}
    except TypeError:
        return False


# --- assert ------------------------------------------------------------------------------


@dataclass
class AssertCheck:
    """An assert split between sandbox and parent.

    Attributes:
        source: the assert as written in the dataset.
        exprs: sub-expressions the sandbox evaluates, in order `[K]`.
        template: the assert's test with each of those replaced by `__r[k]`, compiled.
    """

    source: str
    exprs: list[str]
    template: Any

    def passes(self, values: list[Any]) -> bool:
        """Evaluate the test here on the decoded sandbox values; any exception fails."""
        if len(values) != len(self.exprs):
            return False
        env = {"__builtins__": {}, **SAFE_FUNCS, **SAFE_MODULES, "__r": values}
        try:
            return bool(eval(self.template, env))
        except Exception:
            return False


def split_assert(source: str) -> AssertCheck:
    """Split `assert <test>` into sandbox sub-expressions and a parent-side template.

    Raises AssayError when the case is not a single assert, or when the program's names
    appear inside a lambda or comprehension (the comparison could not be kept out of the
    sandbox, so the case cannot be verified safely).
    """
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as e:
        raise AssayError(f"assert case does not parse: {e.msg}") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise AssayError(f"assert case must be one assert statement: {source[:80]!r}")
    splitter = _Splitter()
    test = splitter.visit(tree.body[0].test)
    template = compile(ast.fix_missing_locations(ast.Expression(test)), "<assert>", "eval")
    return AssertCheck(source, splitter.exprs, template)


_STRUCTURAL = (ast.Compare, ast.BoolOp, ast.UnaryOp, ast.BinOp, ast.IfExp, ast.Tuple, ast.List, ast.Set,
               ast.Dict, ast.Subscript, ast.Slice, ast.Starred, ast.JoinedStr, ast.FormattedValue, ast.keyword)
_SCOPED = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class _Splitter(ast.NodeTransformer):
    def __init__(self) -> None:
        self.exprs: list[str] = []

    def generic_visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, (ast.Constant, ast.Load)) or isinstance(node, ast.expr_context):
            return node
        if isinstance(node, ast.Name):
            return node if node.id in SAFE_FUNCS or node.id in SAFE_MODULES else self._remote(node)
        if isinstance(node, ast.Attribute):
            return node if _is_module_attr(node) else self._remote(node)
        if isinstance(node, ast.Call):
            return self._call(node)
        if isinstance(node, _SCOPED):
            if _free_names(node) - set(SAFE_FUNCS) - set(SAFE_MODULES):
                raise AssayError("assert case uses the program inside a lambda or comprehension; "
                                 "it cannot be checked outside the sandbox")
            return node
        if isinstance(node, _STRUCTURAL) or isinstance(node, (ast.operator, ast.cmpop, ast.boolop, ast.unaryop)):
            return super().generic_visit(node)
        raise AssayError(f"assert case uses unsupported syntax {type(node).__name__}")

    def _call(self, node: ast.Call) -> ast.expr:
        func = node.func
        if isinstance(func, ast.Name) and func.id in SAFE_FUNCS or isinstance(func, ast.Attribute) and _is_module_attr(func):
            return self._args(node)
        if isinstance(func, ast.Attribute) and func.attr in PLAIN_METHODS:
            func.value = self.visit(func.value)  # `f(x).lower()`: the method runs here on the value
            return self._args(node)
        return self._remote(node)

    def _args(self, node: ast.Call) -> ast.Call:
        node.args = [self.visit(a) for a in node.args]
        node.keywords = [self.visit(k) for k in node.keywords]
        return node

    def _remote(self, node: ast.expr) -> ast.expr:
        self.exprs.append(ast.unparse(node))
        index = ast.Constant(len(self.exprs) - 1)
        return ast.copy_location(ast.Subscript(ast.Name("__r", ast.Load()), index, ast.Load()), node)


PLAIN_METHODS = {m for t in (str, list, dict, set, frozenset, tuple, int, float, bytes) for m in dir(t)
                 if not m.startswith("_")}


def _is_module_attr(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in SAFE_MODULES and not node.attr.startswith("_")


def _free_names(node: ast.AST) -> set[str]:
    used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    bound = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    if isinstance(node, ast.Lambda):
        bound |= {a.arg for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs}
    return used - bound
