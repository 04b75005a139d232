"""Experiment trackers (`train.report_to`): every row of `metrics.jsonl` reaches each tracker, read back from what it wrote.

TensorBoard's event files are read with TensorBoard's own reader. W&B (offline), MLflow (a
local file store) and trackio (local SQLite) run in their offline modes in a subprocess and
are `slow` tests (CI installs their extras first); a missing extra is one line.
"""

from __future__ import annotations

import glob
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from _train_helpers import LEARNING_SIGNAL
from assay.config import load_config
from assay.report.metrics import read_metrics
from assay.training.rl import Trainer

SRC = str(Path(__import__("assay").__file__).resolve().parents[1])

ARGS = ["train.steps=3", "train.eval_every=2", "train.eval_n=8", "train.save_every=0", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "reward_workers=0", "train.threads=1", "train.zero_var_warn=0.01", "train.zero_var_steps=1", LEARNING_SIGNAL]


def expected(run_dir: Path) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], str]]:
    """`metrics.jsonl` as `{(key, step): number}` (null: NaN) and `{(key, step): text}`."""
    numbers, texts = {}, {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        for k, v in row.items():
            if k == "step":
                continue
            if isinstance(v, str):
                texts[(k, row["step"])] = v
            else:
                numbers[(k, row["step"])] = math.nan if v is None else float(v)
    return numbers, texts


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)  # float32 in the tracker


def test_tensorboard_event_files_hold_every_metric_the_config_and_the_plots(tiny_model_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'assay[tensorboard]' (scripts/setup.sh installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=tb", "train.report_to=[tensorboard]", *ARGS])
    run = Trainer(cfg).fit(progress=False).run_dir
    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0, "images": 0})
    acc.Reload()
    numbers, texts = expected(run)
    assert len({k for k, _ in numbers}) > 30 and texts  # the run logged its metrics and at least one warning row
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert set(got) == set(numbers)
    assert all(same(got[k], v) for k, v in numbers.items()), [(k, got[k], v) for k, v in numbers.items() if not same(got[k], v)][:5]
    for (key, step), text in texts.items():
        events = [e for e in acc.Tensors(f"{key}/text_summary") if e.step == step]
        assert events and events[0].tensor_proto.string_val[0].decode() == text
    config = acc.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config.strip("`\n")) == json.loads(json.dumps(cfg.model_dump(mode="json")))
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["algo.advantage"].string_value == "grpo" and hparams["rollout.group_size"].number_value == 2
    assert sorted(acc.Tags()["images"]) == ["report/heldout_accuracy", "report/reward"]


def test_a_missing_extra_is_one_line_naming_the_install(tiny_model_dir, tmp_path):
    code = ("import sys; sys.modules['wandb'] = None\nfrom assay.cli import main\n"
            f"sys.exit(main(['train', 'model.path={tiny_model_dir}', 'output_dir={tmp_path}', 'run_name=x', 'train.report_to=[wandb]']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "assay: error: train.report_to=wandb needs the wandb package, which is not installed: pip install 'assay[wandb]'"]
    assert not (tmp_path / "x").exists()


def run_offline(tiny_model_dir: Path, tmp_path: Path, tracker: str) -> Path:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path), "WANDB_CONFIG_DIR": str(tmp_path / "wb"),
           "WANDB_CACHE_DIR": str(tmp_path / "wb"), "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(), "MLFLOW_ALLOW_FILE_STORE": "true",
           "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": SRC}  # run from tmp_path: this checkout's assay, wherever it is
    p = subprocess.run([sys.executable, "-m", "assay.cli", "train", "--no-progress", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                        f"run_name={tracker}", f"train.report_to=[{tracker}]", *ARGS], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp_path / tracker


def wandb_records(path: str) -> list:
    """The records of an offline W&B run file (LevelDB's log format: 32 KiB blocks of CRC, length, type, data)."""
    from wandb.proto import wandb_internal_pb2

    data, pos, out, part = Path(path).read_bytes(), 7, [], b""  # a 7-byte file header first
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768  # a block's tail too short for a header is padding
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        part, pos = part + data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(part)
            out.append(rec)
            part = b""
    return out


@pytest.mark.slow
def test_wandb_offline_run_holds_every_metric(tiny_model_dir, tmp_path):
    pytest.importorskip("wandb", reason="pip install 'assay[wandb]'")
    run = run_offline(tiny_model_dir, tmp_path, "wandb")
    records = wandb_records(glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))[0])
    got = {}
    for r in (r for r in records if r.WhichOneof("record_type") == "history"):
        row = {it.key or "/".join(it.nested_key): json.loads(it.value_json) for it in r.history.item}
        got.update({(k, row["_step"]): v for k, v in row.items() if not k.startswith("_")})
    numbers, texts = expected(run)
    assert all(same(float(got[k]), v) for k, v in numbers.items()) and all(got[k] == v for k, v in texts.items())
    config = next(r.run.config for r in records if r.WhichOneof("record_type") == "run")
    assert {u.key for u in config.update} >= {"algo", "rollout", "train", "data"}


@pytest.mark.slow
def test_mlflow_run_holds_every_metric_and_the_config(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="pip install 'assay[mlflow]'")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow-skinny reads back from a local file store
    from mlflow.tracking import MlflowClient

    run = run_offline(tiny_model_dir, tmp_path, "mlflow")
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run_id = json.loads((run / "trackers.json").read_text())["mlflow"]
    numbers, texts = expected(run)
    for key in {k for k, _ in numbers}:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert all(same(history[s], v) for (k, s), v in numbers.items() if k == key), key
    params = client.get_run(run_id).data.params
    assert params["algo.advantage"] == "grpo" and params["train.report_to"] == '["mlflow"]'
    assert {f.path for f in client.list_artifacts(run_id, "report")} == {"report/heldout_accuracy.png", "report/reward.png"}
    assert {f.path.split("/")[0] for f in client.list_artifacts(run_id)} >= {k for k, _ in texts}


@pytest.mark.slow
def test_trackio_run_holds_every_finite_metric(tiny_model_dir, tmp_path):
    pytest.importorskip("trackio", reason="pip install 'assay[trackio]'")
    run = run_offline(tiny_model_dir, tmp_path, "trackio")
    code = "import json, trackio; print(json.dumps(trackio.SQLiteStorage.get_logs('assay', 'trackio'), default=str))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")})
    logs = json.loads(p.stdout.strip().splitlines()[-1])
    got = {(k, row["step"]): v for row in logs for k, v in row.items() if isinstance(v, (int, float)) and k not in ("step",)}
    numbers, _ = expected(run)
    assert all(same(float(got[k]), v) for k, v in numbers.items() if math.isfinite(v))


def test_a_resumed_run_may_add_a_tracker_and_older_checkpoints_resume(tiny_model_dir, tmp_path):
    """`train.report_to` may change on resume; a checkpoint written before the chat, format and tracker keys existed still resumes."""
    pytest.importorskip("tensorboard", reason="pip install 'assay[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from assay.api import train

    args = [f"model.path={tiny_model_dir}", "train.steps=2", "train.save_every=1", *[a for a in ARGS if not a.startswith(("train.steps", "train.save"))]]
    run = train({"output_dir": str(tmp_path), "run_name": "r"}, *args).run_dir
    record = run / "checkpoints" / "step_000002" / "run.json"
    old = json.loads(record.read_text())
    for section, key in (("data", "format"), ("data", "chat"), ("data", "system_prompt"), ("data", "chat_template_kwargs"),
                         ("model", "chat_template"), ("train", "report_to")):
        del old["config"][section][key]
    record.write_text(json.dumps(old))
    train(None, "train.steps=3", "train.report_to=[tensorboard]", resume=run)
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward/mean")] == [3] and acc.Scalars("eval/accuracy")[-1].step == 3
