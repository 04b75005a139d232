"""Building a reward from a reward block: a name, a `module:attr` path, a YAML file or a dict.

The block (docs/rewards.md has the full reference):

    name: weighted                 # registered name or module:attr (required)
    args:                          # constructor arguments (optional)
      components:                  # an argument that takes rewards takes blocks
        correct: {name: math}
        fmt: {name: format}
      weights: {correct: 1.0, fmt: 0.1}
    transforms:                    # applied in order, like optax.chain (optional)
      - {name: overlong_penalty, args: {max_len: 512, cache: 128}}
      - clip                       # a bare name: no arguments

A string anywhere a block is expected is shorthand for `{name: <string>}`. A YAML file may
hold the block itself or a run config with the block under `reward:`.

    >>> r = build_reward({"name": "weighted", "args": {"components": {"a": "format_only", "b": {"name": "length", "args": {"max_len": 9}}}}})
    >>> type(r).__name__, sorted(r.components)
    ('Weighted', ['a', 'b'])
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from assay.errors import AssayError
from assay.registry import load_path
from assay.rewards.base import REWARDS, Reward

BLOCK_KEYS = ("name", "args", "transforms")


def load_builtins() -> None:
    """Import every module that registers rewards, so names resolve."""
    import importlib

    for mod in ("assay.rewards.math", "assay.rewards.text", "assay.rewards.transforms", "assay.rewards.monitors", "assay.data.tasks", "assay.rewards.code", "assay.rewards.sql", "assay.rm.reward",
                "assay.rewards.judge", "assay.rewards.rubric"):
        try:
            importlib.import_module(mod)
        except ImportError as e:
            if getattr(e, "name", None) != mod:  # a module that exists but fails to import is a bug
                raise


def build_reward(spec: str | dict[str, Any] | Reward, where: str = "reward") -> Reward:
    """A `Reward` from a registered name, a `module:attr` path, a YAML file path, an inline YAML block or a block dict;
    `where` names the setting in error messages (`monitor.canary`)."""
    load_builtins()
    return _build(spec, where)


def _build(spec: Any, where: str) -> Reward:
    if isinstance(spec, Reward):
        return spec
    if isinstance(spec, str):
        if spec.lstrip().startswith("{"):  # an inline YAML block: --reward '{name: code, args: {...}}'
            return _build(_inline_block(spec, where), where)
        if spec not in REWARDS and ":" not in spec and (spec.endswith((".yaml", ".yml")) or os.path.isfile(spec)):
            return _build(load_block(spec), f"{where} ({spec})")
        spec = {"name": spec}
    if not isinstance(spec, dict):
        raise AssayError(f"{where}: expected a reward name or a block {{name, args, transforms}}, got {type(spec).__name__} {spec!r}")
    unknown = sorted(set(spec) - set(BLOCK_KEYS))
    if unknown:
        raise AssayError(f"{where}: unknown key {unknown[0]!r} (value {spec[unknown[0]]!r}); allowed keys: {', '.join(BLOCK_KEYS)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise AssayError(f"{where}.name: expected a registered reward name or module:attr, got {name!r}; known: {', '.join(REWARDS.names())}")
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise AssayError(f"{where}.args: expected a mapping of argument names to values, got {args!r}")
    reward = _instantiate(_resolve(name, where), name, args, f"{where}[{name}]")
    transforms = spec.get("transforms") or []
    if not isinstance(transforms, list):
        raise AssayError(f"{where}.transforms: expected a list of transform blocks, got {transforms!r}")
    if transforms:
        from assay.rewards.transforms import Chain

        reward = Chain(reward, [_build_transform(t, f"{where}.transforms[{i}]") for i, t in enumerate(transforms)])
    return reward


def _resolve(name: str, where: str) -> Any:
    try:
        obj = REWARDS.get(name)
    except AssayError as e:
        raise AssayError(f"{where}.name: {e}") from None
    if isinstance(obj, Reward):
        return obj
    if not (isinstance(obj, type) and issubclass(obj, Reward)):
        raise AssayError(f"{where}.name: {name!r} is a {type(obj).__name__}, not a Reward class or instance")
    return obj


def _instantiate(cls: Any, name: str, args: dict[str, Any], where: str) -> Reward:
    if isinstance(cls, Reward):
        if args:
            raise AssayError(f"{where}.args: {name!r} is a ready-made reward instance and takes no args, got {sorted(args)}")
        return cls
    params = inspect.signature(cls.__init__).parameters
    allowed = [p for p in params if p != "self" and params[p].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    for k in args:
        if k not in allowed and not takes_any:
            raise AssayError(f"{where}.args: unknown argument {k!r} (value {args[k]!r}); allowed: {', '.join(allowed) or '(none)'}")
    built = dict(args)
    for k in getattr(cls, "reward_args", ()):
        if k in built:
            built[k] = _build_children(built[k], f"{where}.args.{k}")
    for k in getattr(cls, "transform_args", ()):  # `chain`'s own `transforms:` argument, built as a block's would be
        if isinstance(built.get(k), list):
            built[k] = [_build_transform(t, f"{where}.args.{k}[{i}]") for i, t in enumerate(built[k])]
    try:
        return cls(**built)
    except TypeError as e:
        raise AssayError(f"{where}: {e}; allowed arguments: {', '.join(allowed) or '(none)'}") from None
    except ValueError as e:
        raise AssayError(f"{where}: {e}") from None


def _build_children(value: Any, where: str) -> Any:
    """A reward-valued argument: one block, a {name: block} mapping of components, or a list of blocks."""
    if isinstance(value, dict) and set(value) - set(BLOCK_KEYS):
        return {k: _build(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_build(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return _build(value, where)


def _build_transform(spec: Any, where: str) -> Any:
    from assay.rewards.transforms import TRANSFORMS, Transform

    if isinstance(spec, Transform):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise AssayError(f"{where}: expected a transform name or {{name, args}}, got {spec!r}; known: {', '.join(TRANSFORMS.names())}")
    unknown = sorted(set(spec) - {"name", "args"})
    if unknown:
        raise AssayError(f"{where}: unknown key {unknown[0]!r} (value {spec[unknown[0]]!r}); allowed keys: name, args")
    try:
        cls = TRANSFORMS.get(spec["name"])
    except AssayError as e:
        raise AssayError(f"{where}.name: {e}") from None
    args = spec.get("args") or {}
    if not isinstance(args, dict):
        raise AssayError(f"{where}.args: expected a mapping, got {args!r}")
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for k in args:
        if k not in params:
            raise AssayError(f"{where}.args: unknown argument {k!r} (value {args[k]!r}) for transform {spec['name']!r}; allowed: {', '.join(params) or '(none)'}")
    try:
        return cls(**args)
    except (TypeError, ValueError) as e:
        raise AssayError(f"{where} [{spec['name']}]: {e}") from None


def _inline_block(text: str, where: str) -> Any:
    import yaml

    from assay.config import yaml_problem

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise AssayError(f"{where}: {text!r} is not a valid YAML block: {yaml_problem(e)}") from None


def load_block(path: str) -> Any:
    """The reward block in a YAML file: the file itself, or its `reward:` entry."""
    import yaml

    from assay.config import yaml_problem

    try:
        with open(path, "rb") as f:  # bytes: PyYAML decodes UTF-8 or UTF-16 by their marks, and says where it is neither
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise AssayError(f"reward file not found: {path}") from None
    except OSError as e:
        raise AssayError(f"cannot read reward file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise AssayError(f"{path}: invalid YAML: {yaml_problem(e)}") from None
    if isinstance(data, dict) and "reward" in data and "name" not in data:
        data = data["reward"]
    if data is None:
        raise AssayError(f"{path}: no reward block (expected {{name, args, transforms}} or a `reward:` entry)")
    return data


def describe(reward: Reward) -> dict[str, Any]:
    """The reward's class and hyperparameters, for logging."""
    return {"name": type(reward).__name__, **reward.hparams()}


__all__ = ["build_reward", "load_block", "load_builtins", "describe", "load_path"]
