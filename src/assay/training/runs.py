"""A run folder owns its configuration: new runs, resumed runs, finished runs.

`output_dir/run_name/` holds `config.yaml` and the checkpoints. Each checkpoint carries
`run.json` (its step, the step whose held-out evaluation is done, and the whole config it
was trained with), which is what `--resume` trusts. On resume only the keys in
`SAFE_ON_RESUME` may change (how long to train, how often to evaluate and save, threads
and worker counts); anything else would silently make a different run in the same folder.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from assay.config import RunConfig, apply_override, explain
from assay.errors import AssayError
from assay.training.checkpoint import latest_checkpoint, load_state

RUN_FILE = "run.json"

#: dotted keys an override may change when a run is resumed
SAFE_ON_RESUME = ("train.steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.threads", "reward_workers",
                  "train.report_to",
                  # where the OpenAI-compatible server is and how it is called (a resumed run may find it elsewhere)
                  "rollout.server_url", "rollout.api_key_env", "rollout.max_concurrency", "rollout.request_timeout", "rollout.max_retries")


def run_record(step: int, evaluated_at: int | None, cfg: RunConfig) -> dict[str, Any]:
    """What `run.json` in a checkpoint holds."""
    return {"step": step, "evaluated_at": evaluated_at, "config": cfg.model_dump(mode="json")}


def read_record(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's `run.json` (older checkpoints: the same fields from the trainer state)."""
    path = ckpt / RUN_FILE
    if path.is_file():
        return json.loads(path.read_text())
    state = load_state(ckpt)
    return {"step": state["step"], "evaluated_at": None, "config": state["config"]}


def check_writable(folder: Path) -> None:
    """One line, not a traceback, when `folder` cannot hold a run (a file in the way, a read-only mount)."""
    for parent in [folder, *folder.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise AssayError(f"output folder {str(folder)!r}: {str(parent)!r} is a file, not a folder (set output_dir or run_name)")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise AssayError(f"output folder {str(folder)!r}: {str(parent)!r} is not writable (set output_dir to a folder you can write)")
            return


def new_run_dir(cfg: Any, folder: str | Path | None = None, default_name: str | None = None) -> Path:
    """Make the folder of a new run (`folder`, or `output_dir/run_name`); refuse one that already holds a run.

    `cfg` is any config with `output_dir` and `run_name` (`assay train`'s, `assay rm train`'s);
    without a run name the folder is `default_name`, or the task (data file) and a time stamp.
    """
    name = cfg.run_name or default_name or f"{cfg.data.task or Path(cfg.data.path or 'data').stem}-{datetime.now():%Y%m%d-%H%M%S}"
    run_dir = Path(folder) if folder is not None else Path(cfg.output_dir) / name
    check_writable(run_dir)
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise AssayError(f"run folder {str(run_dir)!r} already holds a run; continue it with --resume {run_dir}, "
                         "or choose another run_name")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssayError(f"cannot make run folder {str(run_dir)!r}: {e.strerror}") from None
    return run_dir


def write_config(run_dir: Path, cfg: Any) -> None:
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    os.replace(tmp, run_dir / "config.yaml")


def resumed_config(run_dir: str | Path, overrides: list[str] | None, safe: tuple[str, ...]) -> tuple[dict[str, Any], Path]:
    """The config (a plain dict) a run folder's newest finished checkpoint was trained with, plus
    the overrides, and that checkpoint. An override of a key outside `safe` is refused in one
    line naming it; so is a folder without a finished checkpoint."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AssayError(f"--resume: run folder {str(run_dir)!r} does not exist")
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise AssayError(f"--resume: {str(run_dir)!r} has no finished checkpoint to continue from (the run stopped before its "
                         "first save); start it again under another run_name")
    data = read_record(ckpt)["config"]
    for item in overrides or []:
        key = item.partition("=")[0]
        if key not in safe:
            raise AssayError(f"--resume: {key!r} cannot change when a run is resumed (the run folder keeps its own config); "
                             f"allowed: {', '.join(safe)}")
        apply_override(data, item)
    return data, ckpt


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config a run folder was trained with, plus the overrides that may change on resume
    (`SAFE_ON_RESUME`); the newest finished checkpoint's own record is the truth."""
    data, _ = resumed_config(run_dir, overrides, SAFE_ON_RESUME)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data)) from None


def changed_keys(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    out = []
    for k in sorted({*a, *b}):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += changed_keys(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def check_same_run(saved: dict[str, Any], cfg: RunConfig) -> None:
    """Refuse to continue a checkpoint with a config that differs in anything but `SAFE_ON_RESUME`."""
    ignore = {*SAFE_ON_RESUME, "output_dir", "run_name"}
    try:  # keys added to the config since the checkpoint was written take their defaults there
        saved = RunConfig.model_validate(saved).model_dump(mode="json")
    except ValidationError:
        pass
    diff = [k for k in changed_keys(saved, cfg.model_dump(mode="json")) if k not in ignore]
    if diff:
        raise AssayError(f"--resume: the config differs from the one the run was trained with in {', '.join(diff)} "
                         "(resume with the run's own config; only " + ", ".join(SAFE_ON_RESUME) + " may change)")
