"""Standard dataset layouts (`data.format=NAME`): their columns and answer conventions as assay rows, with their reward.

Each format turns one row of the dataset as it is published into assay's row — `prompt`,
`answer`, `id` and the fields its reward reads — and names the reward that checks it, so
a file on disk trains and evaluates with `data.format` alone:

| format | columns read | prompt | reference | reward |
|---|---|---|---|---|
| `gsm8k` | `question`, `answer` | the question | the number after the solution's final `#### ` | `math` |
| `math` | `problem`, `solution` (or `answer`) | the problem | `answer`, else the content of the solution's last `\\boxed{}` | `math` |
| `mbpp` | `text` (or `prompt`), `test_list`, `code`, `task_id` | the task and its asserts | the reference program | `code` (the asserts as one check test) |
| `humaneval` | `prompt`, `test`, `entry_point`, `canonical_solution`, `task_id` | the function's signature and docstring | the canonical body | `code`, program = prompt + completion |
| `apps` | `question`, `input_output`, `starter_code`, `solutions`, `problem_id` | APPS's own prompt | the first solution | `code` (stdio or call tests) |

Sources: GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems",
arXiv:2110.14168); MATH (Hendrycks et al. 2021, "Measuring Mathematical Problem Solving With
the MATH Dataset", arXiv:2103.03874); MBPP, HumanEval and APPS as in
`assay.rewards.code_datasets`. Every other column stays a field of the row. A format is a
`Format` registered in `FORMATS`, or a `module:attr` path to one.

    >>> FORMATS.get("gsm8k").convert({"question": "2+3?", "answer": "2+3=5\\n#### 5"})["answer"]
    '5'
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from assay.errors import AssayError
from assay.registry import Registry


@dataclass(frozen=True)
class Format:
    """A dataset layout.

    Attributes:
        needs: columns every row must have (`a|b`: either).
        convert: one published row → assay's row (`prompt`, `answer`, `id`, fields), or None
            to leave the row out (one warning counts them).
        reward: the reward block that checks its rows.
    """

    needs: tuple[str, ...]
    convert: Callable[[dict[str, Any]], dict[str, Any] | None]
    reward: str | dict[str, Any]


FORMATS: Registry[Format] = Registry("data format")


def _rest(row: dict[str, Any], *used: str) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in used}


def gsm8k_answer(solution: str) -> str:
    """The final answer of a GSM8K solution: what follows its last `####`, thousands commas removed."""
    if "####" not in solution:
        raise AssayError("the answer has no final '#### N' line (GSM8K's convention)")
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _gsm8k(row: dict[str, Any]) -> dict[str, Any]:
    return {**_rest(row, "question", "answer"), "prompt": row["question"], "answer": gsm8k_answer(str(row["answer"])), "solution": row["answer"]}


def last_boxed(solution: str) -> str:
    """The content of the last `\\boxed{…}` (or `\\fbox{…}`) of a MATH solution."""
    from assay.rewards.math.extract import find_boxes

    boxes = find_boxes(solution)
    if not boxes:
        raise AssayError("the solution has no \\boxed{} answer (MATH's convention); give an 'answer' column instead")
    return boxes[-1][2].strip()


def _math(row: dict[str, Any]) -> dict[str, Any]:
    answer = row.get("answer")
    if answer in (None, ""):
        if "solution" not in row:
            raise AssayError("needs an 'answer' or a 'solution' column")
        answer = last_boxed(str(row["solution"]))
    out = {**_rest(row, "problem", "answer", "unique_id"), "prompt": row["problem"], "answer": str(answer)}
    if row.get("unique_id") is not None:
        out["id"] = row["unique_id"]
    return out


def fenced(code: str) -> str:
    """`code` in a Python fence: a completion the `code` reward reads (a reference solution as a completion)."""
    return f"```python\n{code.rstrip()}\n```"


def _mbpp(row: dict[str, Any]) -> dict[str, Any]:
    from assay.rewards.code_datasets import mbpp_tests

    text = row.get("text") or row.get("prompt")
    asserts = list(row["test_list"])
    setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
    tests = mbpp_tests({"test_list": asserts, "test_setup_code": setup, "entry_point": row.get("entry_point")})
    prompt = f"{text}\nYour code should pass these tests:\n" + "\n".join(a.strip() for a in asserts) + "\n"
    out = {**_rest(row, "text", "prompt", "code", "task_id", "test_list"), "prompt": prompt, "tests": tests, "test_list": asserts}
    if row.get("code"):
        out["answer"] = fenced(row["code"])
    if row.get("task_id") is not None:
        out["id"] = row["task_id"]
    return out


def _humaneval(row: dict[str, Any]) -> dict[str, Any]:
    from assay.rewards.code_datasets import humaneval_tests

    out = {**_rest(row, "prompt", "canonical_solution", "task_id", "test"), "prompt": row["prompt"], "code_prompt": row["prompt"],
           "tests": humaneval_tests(row)}
    if row.get("canonical_solution"):
        out["answer"] = row["canonical_solution"]
    if row.get("task_id") is not None:
        out["id"] = row["task_id"]
    return out


def apps_prompt(question: str, starter: str, call_based: bool) -> str:
    """APPS's prompt (Hendrycks et al. 2021): question, starter code, and which I/O format to use."""
    how = "Use Call-Based format" if call_based else "Use Standard Input format"
    return f"\nQUESTION:\n{question}\n{starter or ''}\n{how}\nANSWER:\n"


def _apps(row: dict[str, Any]) -> dict[str, Any] | None:
    from assay.rewards.code_datasets import apps_tests

    io = row["input_output"]
    io = json.loads(io) if isinstance(io, str) and io.strip() else (io or {})
    if not io.get("inputs"):
        return None  # no tests: nothing can score it
    tests = apps_tests({"input_output": io})
    out = {**_rest(row, "question", "solutions", "problem_id", "input_output"), "prompt": apps_prompt(row["question"], row.get("starter_code"), bool(io.get("fn_name"))),
           "tests": tests}
    solutions = json.loads(row["solutions"]) if isinstance(row.get("solutions"), str) and row["solutions"].strip() else row.get("solutions")
    if solutions:
        out["answer"] = fenced(solutions[0])
    if row.get("problem_id") is not None:
        out["id"] = row["problem_id"]
    return out


FORMATS.register("gsm8k")(Format(("question", "answer"), _gsm8k, "math"))
FORMATS.register("math")(Format(("problem",), _math, "math"))
FORMATS.register("mbpp")(Format(("text|prompt", "test_list"), _mbpp, "code"))
FORMATS.register("humaneval")(Format(("prompt", "test", "entry_point"), _humaneval, {"name": "code", "args": {"extract": "continuation"}}))
FORMATS.register("apps")(Format(("question", "input_output"), _apps, "code"))


#: what `column` returns for a column a row does not have
MISSING = object()


def column(row: dict[str, Any], name: str) -> Any:
    """The value of column `name` in `row`, or `MISSING`. A name with dots that is not itself a column is a
    path into nested objects (and lists, by index): verl's `reward_model.ground_truth`, `extra_info.index`.

        >>> column({"reward_model": {"ground_truth": "72"}}, "reward_model.ground_truth")
        '72'
    """
    if name in row:
        return row[name]
    if "." not in name:
        return MISSING
    node: Any = row
    for part in name.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return MISSING
    return node


def get_format(name: str) -> Format:
    """The format called `name` (or a `module:attr` path); one line naming the known ones otherwise."""
    fmt = FORMATS.get(name)
    if not isinstance(fmt, Format):
        raise AssayError(f"data.format={name!r} is a {type(fmt).__name__}, not an assay.data.formats.Format")
    return fmt


def convert_rows(rows: list[dict[str, Any]], name: str, rename: dict[str, str], source: str) -> tuple[list[dict[str, Any]], int]:
    """`(assay rows, rows left out)`: each row read with `rename` ({format column: file column, dotted for a nested
    one}), then converted."""
    fmt = get_format(name)
    out, skipped = [], 0
    for i, raw in enumerate(rows):
        row = {**raw, **{col: v for col, src in rename.items() if (v := column(raw, src)) is not MISSING}}
        for need in fmt.needs:
            if not any(c in row for c in need.split("|")):
                raise AssayError(f"{source}: row {i + 1} has no {need.replace('|', ' or ')!r} column, which data.format={name} reads "
                                 f"(map it with data.fields.{need.split('|')[0]}=COLUMN)")
        try:
            converted = fmt.convert(row)
        except AssayError as e:
            raise AssayError(f"{source}: row {i + 1} (data.format={name}): {e}") from None
        except (KeyError, TypeError, ValueError) as e:
            raise AssayError(f"{source}: row {i + 1} does not fit data.format={name}: {type(e).__name__}: {e}") from None
        if converted is None:
            skipped += 1
        else:
            out.append(converted)
    return out, skipped
