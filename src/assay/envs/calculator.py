"""The `calculator` environment: arithmetic problems with a calculator tool.

The model sees the problem (`1234+5678=`, the arithmetic task's prompt); it may call
`[calc EXPR]` (bracket syntax, for the bundled character-level model) or
`<tool_call>{"name": "calc", "arguments": {"expr": "..."}}</tool_call>` (json syntax, for
chat models) and is shown `=VALUE`; a turn without a call is its answer, scored 1 when it
is the right integer (the arithmetic verifier's rule: the first integer in the answer).

    >>> from assay.types import Sample
    >>> env = Calculator()
    >>> env.reset(Sample("q", "12+34=", answer="46"))
    '12+34='
    >>> env.step("[calc 12+34]")[0]
    '=46'
    >>> env.step("46")[1:3]
    (1.0, True)
"""

from __future__ import annotations

import ast
import operator
import re

from assay.envs.base import ENVS, ToolEnv
from assay.types import Sample

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_INT = re.compile(r"-?\d+")


def calc(expr: str) -> int:
    """Evaluate an integer expression with + - * and parentheses."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = value(node.left), value(node.right)
            if max(abs(left), abs(right)) > 10**12:
                raise ValueError("number too large")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError(f"not an integer expression: {expr!r}")

    return value(ast.parse(expr.strip().rstrip("="), mode="eval").body)


@ENVS.register("calculator")
class Calculator(ToolEnv):
    """Arithmetic with a calculator tool (see the module docstring).

    Args:
        syntax: `bracket` (the bundled model) or `json` (chat models).
        timeout_s: deadline of one tool call.
    """

    def __init__(self, syntax: str = "bracket", timeout_s: float = 2.0) -> None:
        super().__init__([calc], syntax, timeout_s)

    def answer(self, text: str) -> float | None:
        assert self.sample is not None
        try:
            gold = int(str(self.sample.answer).strip())
        except ValueError:
            return None
        found = _INT.search(text)
        return float(found is not None and int(found.group()) == gold)

    def prompt(self, sample: Sample) -> str:
        return sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1]["content"])
