"""Experiment trackers (`train.report_to`): TensorBoard, Weights & Biases, MLflow, trackio.

Each gets what `metrics.jsonl` gets, under the same keys and steps: numbers as scalars,
text rows (`warning`) as text where the tracker has text (TensorBoard, W&B, MLflow); the
run's config as hyperparameters when the run starts; the report's plots as images when it
ends. Each tracker is an optional extra (`pip install 'assay[tensorboard]'`); a missing
one is one line naming the install, before anything runs. Where the data goes is each
tracker's own setting:

| tracker | writes to | offline |
|---|---|---|
| `tensorboard` | `RUN_DIR/tensorboard/` | always |
| `wandb` | project `$WANDB_PROJECT` (default `assay`), run named after the run folder | `WANDB_MODE=offline` |
| `mlflow` | `$MLFLOW_TRACKING_URI`, experiment `$MLFLOW_EXPERIMENT_NAME` (default `assay`) | a `file:` or `sqlite:` URI |
| `trackio` | project `$TRACKIO_PROJECT` (default `assay`) in `$TRACKIO_DIR` | always local unless a Space is set |

A resumed run continues the same tracker run (its id is kept in `RUN_DIR/trackers.json`);
TensorBoard drops the events after the checkpoint's step, which the run recomputes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any

from assay.errors import AssayError

#: tracker → (module it imports, extra that installs it)
EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"),
          "trackio": ("trackio", "trackio")}
IDS_FILE = "trackers.json"


def check_trackers(names: list[str]) -> None:
    """One `AssayError` line for the first tracker whose package is not installed."""
    for name in names:
        module, extra = EXTRAS[name]
        if importlib.util.find_spec(module) is None:
            raise AssayError(f"train.report_to={name} needs the {module} package, which is not installed: pip install 'assay[{extra}]'")


def split_row(metrics: dict[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """`(numbers, texts)` of one metric row (booleans and None are left out)."""
    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return numbers, {k: v for k, v in metrics.items() if isinstance(v, str)}


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"algo.loss": "ppo_clip", ...}`: nested config as dotted keys; lists and None as text."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) and v:
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else json.dumps(v)
    return out


class TensorBoard:
    """Event files under `RUN_DIR/tensorboard` (torch's `SummaryWriter`)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None, ids: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        purge = None if resume_step is None else resume_step + 1  # the run recomputes the steps after its checkpoint
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)
        if resume_step is None:
            for summary in hparams(flat_config(config), {}):
                self.writer.file_writer.add_summary(summary)
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        for k, v in numbers.items():
            self.writer.add_scalar(k, v, step)
        for k, v in texts.items():
            self.writer.add_text(k, v, step)

    def images(self, step: int, paths: list[Path]) -> None:
        import matplotlib.image

        for p in paths:
            self.writer.add_image(f"report/{p.stem}", matplotlib.image.imread(p)[:, :, :3], step, dataformats="HWC")

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A Weights & Biases run (`WANDB_MODE=offline` keeps it on disk, under `RUN_DIR/wandb`)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None, ids: dict[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "assay"), name=run_dir.name, id=ids.get("wandb"), resume="allow",
                              dir=str(run_dir), config=config, reinit="create_new")
        ids["wandb"] = self.run.id

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        self.run.log({**numbers, **texts}, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self.wandb.Image(str(p)) for p in paths}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class MLflow:
    """An MLflow run through `MlflowClient` (no global active run), in `$MLFLOW_TRACKING_URI`."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None, ids: dict[str, Any]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient()
        if ids.get("mlflow"):
            self.run_id = ids["mlflow"]
            return
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "assay")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.run_id = ids["mlflow"] = self.client.create_run(exp_id, run_name=run_dir.name).info.run_id
        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(k), v, now, step) for k, v in numbers.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])
        for k, v in texts.items():
            self.client.log_text(self.run_id, v, f"{_mlflow_key(k)}/step_{step:06d}.txt")

    def images(self, step: int, paths: list[Path]) -> None:
        for p in paths:
            self.client.log_artifact(self.run_id, str(p), "report")

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _mlflow_key(key: str) -> str:
    """MLflow's allowed characters (letters, digits, `_ - . / space`); anything else becomes `_`."""
    return re.sub(r"[^\w\-./ ]", "_", key)


class Trackio:
    """A trackio run (local SQLite in `$TRACKIO_DIR` unless a Space is configured)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume_step: int | None, ids: dict[str, Any]):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "assay"), name=run_dir.name, config=flat_config(config),
                                resume="allow", embed=False, auto_log_gpu=False, auto_log_cpu=False)

    def log(self, step: int, numbers: dict[str, float], texts: dict[str, str]) -> None:
        finite = {k: v for k, v in numbers.items() if math.isfinite(v)}  # trackio stores JSON
        if finite:
            self.run.log(finite, step=step)

    def images(self, step: int, paths: list[Path]) -> None:
        self.run.log({f"report/{p.stem}": self.trackio.Image(p) for p in paths}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow, "trackio": Trackio}


class Trackers:
    """The run's trackers behind one `log`/`images`/`flush`/`close` (nothing at all when none is chosen).

    Args:
        names: `train.report_to`.
        run_dir: the run folder (tracker ids are kept in it for `--resume`).
        config: the run's config, logged as hyperparameters.
        resume_step: the checkpoint's step when the run is resumed, else None.
    """

    def __init__(self, names: list[str], run_dir: Path, config: dict[str, Any], resume_step: int | None = None):
        check_trackers(names)
        self.path = Path(run_dir) / IDS_FILE
        ids = json.loads(self.path.read_text()) if self.path.is_file() else {}
        self.open: list[Any] = []
        for name in names:
            try:
                self.open.append(TRACKERS[name](Path(run_dir), config, resume_step, ids))
            except Exception as e:  # a tracker's own settings (URI, login, project) are the user's to fix
                self.close()
                first = (str(e).strip().splitlines() or [""])[0][:1000]
                raise AssayError(f"train.report_to={name}: the tracker could not start: {type(e).__name__}: {first}") from None
        if ids:
            self.path.write_text(json.dumps(ids))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        numbers, texts = split_row(metrics)
        for t in self.open:
            t.log(step, numbers, texts)

    def images(self, step: int, paths: list[Path]) -> None:
        for t in self.open:
            t.images(step, [p for p in paths if p.is_file()])

    def flush(self) -> None:
        for t in self.open:
            t.flush()

    def close(self) -> None:
        while self.open:
            self.open.pop().close()
