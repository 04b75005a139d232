"""Hyperparameters belong to their function: read them off its signature, check what a config gives.

An estimator's or a loss's hyperparameters are the keyword parameters of the function
after its data arguments and the extras it declares; `algo.advantage_args` and
`algo.loss_args` are checked against them, so a misspelled or ill-typed argument is one
line naming it and listing the accepted ones, never silently ignored.

    >>> def est(rewards, group, mask, values, gamma: float = 1.0, **_): ...
    >>> est.needs = frozenset({"values"})
    >>> hyperparameters(est, ("rewards", "group", "mask"))
    {'gamma': 1.0}
    >>> bind_args(est, {"gamma": 0.99}, ("rewards", "group", "mask"), "algo.advantage_args")
    {'gamma': 0.99}
"""

from __future__ import annotations

import inspect
import typing
from typing import Any, Callable, Iterable

from pydantic import TypeAdapter, ValidationError

from assay.errors import AssayError

_NO_DEFAULT = inspect.Parameter.empty


def _params(fn: Callable, reserved: Iterable[str]) -> dict[str, inspect.Parameter]:
    skip = {*reserved, *getattr(fn, "needs", ())}
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n: p for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds and n not in skip}


def hyperparameters(fn: Callable, reserved: Iterable[str]) -> dict[str, Any]:
    """The hyperparameters of `fn` with their defaults (`inspect.Parameter.empty` when required)."""
    return {n: p.default for n, p in _params(fn, reserved).items()}


def _hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn, include_extras=True)  # with `Annotated` bounds, which the check enforces
    except Exception:  # an annotation that cannot be resolved: skip type checks
        return {}


def bind_args(fn: Callable, given: dict[str, Any], reserved: Iterable[str], where: str) -> dict[str, Any]:
    """`given`, checked against `fn`'s hyperparameters and converted to their annotated types.

    Args:
        fn: the estimator or loss.
        given: the arguments from the config.
        reserved: parameter names the caller supplies itself (data arguments, config fields).
        where: the config key, for messages (`algo.advantage_args`).
    Raises:
        AssayError: an unknown argument, one that the caller supplies, or one of the wrong type.
    """
    reserved = tuple(reserved)
    params = _params(fn, reserved)
    accepted = ", ".join(params) or "(none)"
    name = getattr(fn, "__name__", str(fn))
    for key in given:
        if key in reserved or key in getattr(fn, "needs", ()):
            raise AssayError(f"{where}: {key!r} is not a hyperparameter of {name} (the trainer supplies it); accepted: {accepted}")
        if key not in params:
            raise AssayError(f"{where}: unknown argument {key!r} for {name}; accepted: {accepted}")
    hints, out = _hints(fn), {}
    for key, value in given.items():
        hint = hints.get(key)
        if hint is None:
            out[key] = value
            continue
        try:
            out[key] = TypeAdapter(hint).validate_python(value)
        except ValidationError:
            raise AssayError(f"{where}: {key}={value!r} is not {_article(_type_name(hint))} for {name}") from None
    missing = [n for n, p in params.items() if p.default is _NO_DEFAULT and n not in out]
    if missing:
        raise AssayError(f"{where}: {name} needs {', '.join(missing)}")
    return out


def _article(kind: str) -> str:
    return kind if kind.startswith("one of") else f"a valid {kind}"


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(hint)))
    if typing.get_origin(hint) is typing.Annotated:  # `Annotated[float, Gt(0)]`: "float > 0"
        base, *marks = typing.get_args(hint)
        bounds = [f"{sign} {getattr(m, key)}" for m in marks for key, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
                  if getattr(m, key, None) is not None]
        return " and ".join([f"{_type_name(base)} {bounds[0]}" if bounds else _type_name(base), *bounds[1:]])
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
