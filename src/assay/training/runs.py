"""A run folder owns its configuration: new runs, resumed runs, finished runs.

`output_dir/run_name/` holds `config.yaml` and the checkpoints. Each checkpoint carries
`run.json` (its step, the step whose held-out evaluation is done, and the whole config it
was trained with), which is what `--resume` trusts. On resume only the keys in
`SAFE_ON_RESUME` may change (how long to train, how often to evaluate and save, threads
and worker counts); anything else would silently make a different run in the same folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import weakref
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from assay.config import RunConfig, apply_override, explain
from assay.errors import AssayError
from assay.training.checkpoint import latest_checkpoint, load_state, resumable_checkpoint


LOCK_FILE = ".lock"


class RunFolderLock:
    """This process trains in `run_dir`: another process that tries to (a second `--resume` in another terminal, a
    scheduler that requeued a job still running) gets one line, instead of two writers that truncate each other's
    metrics, delete each other's half-written checkpoints and prune each other's finished ones.

    A POSIX record lock (`lockf`) on `run_dir/.lock`, which also holds the holder's pid for the message: the system drops
    it when the process ends however it ends (SIGKILL, a lost host), so there is never a stale lock to delete, and a
    forked worker does not inherit it. Within one process holders share it (a restart's clean-up, then the trainer);
    it is released when the last holder calls `release()` or is garbage-collected. A file system without locks is
    let through.
    """

    _held: dict[str, list[int]] = {}  # resolved folder → [fd, holders in this process]

    def __init__(self, run_dir: str | Path):
        self.key = key = str(Path(run_dir).resolve())
        held = self._held.get(key)
        if held is not None:
            held[1] += 1
        else:
            try:
                fd = os.open(Path(key) / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o666)  # as the umask allows: a shared folder's group
            except OSError as e:
                raise AssayError(f"cannot write in run folder {str(run_dir)!r}: {e.strerror or e}") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise AssayError(f"run folder {str(run_dir)!r} is in use by another process (pid {owner or '?'}) that is "
                                     "training in it; wait for it to end or stop it, then run this again") from None
                fd = -1  # no locks on this file system (ENOLCK, EOPNOTSUPP): nothing to hold
            if fd >= 0:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._held[key] = [fd, 1]
        self._release = weakref.finalize(self, RunFolderLock._drop, key)

    @classmethod
    def _drop(cls, key: str) -> None:
        held = cls._held.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            del cls._held[key]
            if held[0] >= 0:
                os.close(held[0])  # the lock goes with the descriptor

    def release(self) -> None:
        """Let go (once; later calls do nothing)."""
        self._release()


@dataclass
class RunResult:
    """What a run left: its folder and its final figures (`Trainer.summary`)."""

    run_dir: Path
    final: dict[str, Any]

    @property
    def model(self) -> Path:
        """The trained model, a Hugging Face folder (`final/`)."""
        return self.run_dir / "final"

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of `metrics.jsonl`, one per logged step."""
        from assay.report.metrics import read_metrics

        return read_metrics(self.run_dir / "metrics.jsonl")


RUN_FILE = "run.json"

#: dotted keys an override may change when a run is resumed
SAFE_ON_RESUME = ("train.steps", "train.eval_every", "train.save_every", "train.keep_checkpoints", "train.threads", "reward_workers",
                  "train.report_to",
                  # where the OpenAI-compatible server is and how it is called (a resumed run may find it elsewhere)
                  "rollout.server_url", "rollout.api_key_env", "rollout.max_concurrency", "rollout.request_timeout", "rollout.max_retries",
                  # where the Ray workers run and how many (more rollout or learner workers split the prompts differently: docs/scaling.md)
                  "cluster.address", "cluster.rollout_workers", "cluster.reward_workers", "cluster.learner_workers", "cluster.cpus_per_worker",
                  "cluster.gpus_per_learner", "cluster.gpus_per_rollout")


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


def stamped(name: str, parent: str | Path | None = None) -> str:
    """`name` and the time: the folder name of a run without a `run_name` (with `-2`, `-3`, ... when a run
    started in the same second already has that folder under `parent`)."""
    base = f"{name}-{datetime.now():%Y%m%d-%H%M%S}"
    out, n = base, 1
    while parent is not None and (Path(parent) / out).exists():
        n += 1
        out = f"{base}-{n}"
    return out


def check_run_dir(cfg: Any, folder: str | Path | None = None, default_name: str | None = None) -> Path:
    """The folder a new run would get (`folder`, or `output_dir/run_name`), refused in one line where it cannot hold
    one or already holds a run; nothing is made (`new_run_dir` makes it).

    `cfg` is any config with `output_dir` and `run_name` (`assay train`'s, `assay rm train`'s);
    without a run name the folder is `default_name`, or the task (data file) and a time stamp.
    A folder holding only a config is a run to start.
    """
    name = cfg.run_name or default_name or stamped(cfg.data.task or Path(cfg.data.path or "data").stem, cfg.output_dir)
    run_dir = Path(folder) if folder is not None else Path(cfg.output_dir) / name
    check_writable(run_dir)
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        if latest_checkpoint(run_dir / "checkpoints") is None:
            raise AssayError(f"run folder {str(run_dir)!r} holds a run that stopped before its first checkpoint; start it again from "
                             f"the beginning with --restart {run_dir}, or choose another run_name")
        raise AssayError(f"run folder {str(run_dir)!r} already holds a run; continue it with --resume {run_dir}, "
                         "or choose another run_name")
    return run_dir


def new_run_dir(cfg: Any, folder: str | Path | None = None, default_name: str | None = None) -> Path:
    """Make the folder of a new run, as `check_run_dir` names and checks it."""
    run_dir = check_run_dir(cfg, folder, default_name)
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
    if not is_run_folder(run_dir):
        raise AssayError(f"--resume: {str(run_dir)!r} is not a run folder (no config.yaml, metrics.jsonl or checkpoints/ in it); "
                         "give the folder a run wrote, output_dir/run_name")
    ckpt = resumable_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        raise AssayError(f"--resume: the run in {str(run_dir)!r} stopped before its first checkpoint, so there is nothing to continue; "
                         f"start it again from the beginning with --restart {run_dir}")
    data = read_record(ckpt)["config"]
    for item in overrides or []:
        key = item.partition("=")[0]
        if key not in safe:
            raise AssayError(f"--resume: {key!r} cannot change when a run is resumed (the run folder keeps its own config); "
                             f"allowed: {', '.join(safe)}")
        apply_override(data, item)
    return data, ckpt


#: what a run writes in its folder besides `config.yaml` and its plots: all that a restart removes
RUN_OUTPUTS = ("metrics.jsonl", "samples.jsonl", "report.html", ".report.html.tmp", "checkpoints", "tensorboard")
#: the plots of `assay rm train`'s report (`assay.rm.train.report_plots`), besides `assay train`'s
RM_PLOTS = ("rm_loss.png", "heldout_pair_accuracy.png", "heldout_step_accuracy.png")
#: what `assay po train` writes besides: its plots and the cached reference log-probabilities (`assay.po.train`)
PO_OUTPUTS = ("po_loss.png", "po_heldout.png", "reference.safetensors")


def is_run_folder(run_dir: Path) -> bool:
    """A folder a run wrote: its config, metrics or checkpoints are there."""
    return any((run_dir / f).exists() for f in ("config.yaml", "metrics.jsonl", "checkpoints"))


def restart_data(run_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """The config (a plain dict) of a run that stopped before its first checkpoint, from its `config.yaml`, plus
    `overrides`. A folder that is not a run, or whose run has a checkpoint to continue from, is refused in one
    line. `clear_outputs` then empties the folder for the run to start again in it."""
    from assay.config import read_yaml_mapping

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        what = "does not exist" if not run_dir.is_dir() else "is not a run folder (no config.yaml in it)"
        raise AssayError(f"--restart: {str(run_dir)!r} {what}; give the folder a run wrote, output_dir/run_name")
    try:
        whole = resumable_checkpoint(run_dir / "checkpoints")
    except AssayError:  # every checkpoint is damaged: starting again is what is left
        whole = None
    if whole is not None:
        raise AssayError(f"--restart: the run in {str(run_dir)!r} has a checkpoint; continue it with --resume {run_dir} "
                         "(a restart would throw its training away)")
    data = read_yaml_mapping(str(run_dir / "config.yaml"))
    for item in overrides or []:
        apply_override(data, item)
    return data


def clear_outputs(run_dir: str | Path) -> None:
    """Remove what a run wrote in its folder (`RUN_OUTPUTS` and its report's plots), leaving `config.yaml` and anything else."""
    from assay.report.run_report import AGENT_PLOTS, PLOTS

    run_dir = Path(run_dir)
    for name in [*RUN_OUTPUTS, *PLOTS, *AGENT_PLOTS, *RM_PLOTS, *PO_OUTPUTS]:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def resume_config(run_dir: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """The config a run folder was trained with, plus the overrides that may change on resume
    (`SAFE_ON_RESUME`); the newest finished checkpoint's own record is the truth."""
    data, _ = resumed_config(run_dir, overrides, SAFE_ON_RESUME)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise AssayError(explain(e, data, RunConfig)) from None


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
