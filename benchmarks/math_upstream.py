"""Agreement of assay's math verifier with math-verify's own regression tests, read in place.

Hugging Face's Math-Verify ships pytest files whose cases are `(gold, pred, expected)`
tuples in `@pytest.mark.parametrize` lists, checked through `compare_strings(gold, pred,
...)` or `verify(parse(gold), parse(pred))`. This script reads those files with `ast` (it
never imports or runs them, and nothing of them is copied into this repository), scores
each case with `MathReward` (the gold as the reference answer, the prediction as the
completion), and prints agreement overall and per file.

A case is skipped when its options make it measure something assay does not offer:

* `strict=False` (variable names ignored; assay is always strict),
* `allow_set_relation_comp=False` (assay always lets a relation answer an interval or
  relation reference, like math-verify with the flag on),
* a `precision` other than math-verify's default 6 with `expected == 1` (the case relies
  on a looser float rounding; assay compares decimals digit for digit),
* a value that is not a literal (an f-string computed at import),
* files that test other APIs (`test_string_extraction.py`: multiple-choice letters, no gold).

    python benchmarks/math_upstream.py [--upstream PATH] [--show]

`--upstream` is a checkout, or a bare git directory read at HEAD (default: the mirror at
/work/.mirror/huggingface+Math-Verify/repo); `--show` lists every disagreement.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from assay.rewards.math import MathReward
from assay.types import Sample, Trajectory

DEFAULT_UPSTREAM = "/work/.mirror/huggingface+Math-Verify/repo"
FILES = ("test_all.py", "test_numina_cases.py", "test_open_thoughts.py", "test_boxed.py", "test_yujianll.py",
         "test_strict.py", "test_string_extraction.py")
OTHER_API = {"test_string_extraction.py": "multiple-choice string extraction, no gold"}
OPTIONS = ("precision", "strict", "allow_set_relation_comp")


@dataclass
class Case:
    """One upstream case: where it is, its gold / prediction / expected verdict and the options it runs with."""

    file: str
    test: str
    line: int
    gold: str
    pred: str
    expected: bool
    options: dict  # the options the case passes explicitly


def read_upstream(root: Path, name: str) -> str | None:
    """The text of `tests/<name>` in a checkout or, for a bare git directory, at its HEAD."""
    path = root / "tests" / name
    if path.is_file():
        return path.read_text(encoding="utf-8")
    out = subprocess.run(["git", "-C", str(root), "show", f"HEAD:tests/{name}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def _call_options(fn: ast.FunctionDef) -> dict[str, ast.expr]:
    """The keyword arguments of the `compare_strings(...)` call in a test's body (empty for `verify(parse(...))`)."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "compare_strings":
            return {k.arg: k.value for k in node.keywords if k.arg}
    return {}


def _parametrize(fn: ast.FunctionDef) -> tuple[list[str], list[ast.expr]] | None:
    """`(argument names, case nodes)` of a test's `@pytest.mark.parametrize`, or None."""
    for dec in fn.decorator_list:
        if isinstance(dec, ast.Call) and getattr(dec.func, "attr", None) == "parametrize" and len(dec.args) >= 2:
            names = ast.literal_eval(dec.args[0])
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            cases = dec.args[1]
            if isinstance(cases, (ast.List, ast.Tuple)):
                return names, list(cases.elts)
    return None


def _options(call: dict[str, ast.expr], row: dict) -> dict:
    """The options a case passes: constants of the call, or the case's own value for a parameter name."""
    out = {}
    for key, node in call.items():
        if key in OPTIONS:
            out[key] = row[node.id] if isinstance(node, ast.Name) and node.id in row else ast.literal_eval(node)
    return out


def skip_reason(case: Case) -> str | None:
    """Why a case is not comparable with assay (None when it is); see the module docstring."""
    if case.options.get("strict") is False:
        return "strict=False"
    if case.options.get("allow_set_relation_comp") is False:
        return "allow_set_relation_comp=False"
    if case.options.get("precision", 6) != 6 and case.expected:
        return "looser precision"
    return None


def load_cases(root: Path) -> tuple[list[Case], dict[str, int]]:
    """All comparable cases of the upstream files, and the count skipped per reason."""
    cases, skipped = [], defaultdict(int)
    for name in FILES:
        source = read_upstream(root, name)
        if source is None:
            continue
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, ast.FunctionDef) or not (spec := _parametrize(fn)):
                continue
            names, nodes = spec
            if name in OTHER_API:
                skipped[OTHER_API[name]] += len(nodes)
                continue
            call = _call_options(fn)
            for node in nodes:
                try:
                    row = dict(zip(names, ast.literal_eval(node)))
                except ValueError:
                    skipped["not a literal"] += 1
                    continue
                expected = row.get("expected", row.get("result"))
                case = Case(name, fn.name, node.lineno, row["gold"], row["pred"], bool(expected), _options(call, row))
                if reason := skip_reason(case):
                    skipped[reason] += 1
                else:
                    cases.append(case)
    return cases, dict(skipped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--upstream", default=DEFAULT_UPSTREAM)
    ap.add_argument("--show", action="store_true", help="list every disagreement")
    args = ap.parse_args()
    root = Path(args.upstream)
    if read_upstream(root, "test_all.py") is None:
        sys.exit(f"math_upstream: no Math-Verify tests at {root} (pass --upstream PATH, a checkout or a git directory)")
    cases, skipped = load_cases(root)
    reward = MathReward()
    per_file: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    misses = []
    for c in cases:
        res = reward.score(Trajectory(Sample(f"{c.file}:{c.line}", "", c.gold), c.pred, [], [], [], True))
        agree = (res.score == 1.0) == c.expected
        per_file[c.file][0] += agree
        per_file[c.file][1] += 1
        if not agree:
            misses.append((c, res))
    ok, n = sum(v[0] for v in per_file.values()), len(cases)
    print(f"upstream cases compared: {n}   skipped: {sum(skipped.values())} ({', '.join(f'{k}: {v}' for k, v in sorted(skipped.items()))})")
    print(f"agreement {ok}/{n} = {100 * ok / n:.1f}%")
    for name, (a, m) in per_file.items():
        print(f"  {name:24s} {a:4d}/{m:<4d} {100 * a / m:5.1f}%")
    if args.show:
        for c, res in misses:
            print(f"\n{c.file}:{c.line} [{c.test}] expected {int(c.expected)}, assay {res.score} {res.info}")
            print(f"  gold: {c.gold[-160:]!r}\n  pred: {c.pred[-200:]!r}")


if __name__ == "__main__":
    main()
