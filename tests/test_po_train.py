"""`assay po train`: the update equals a plain computation, runs learn, resume exactly, cache the reference, stop cleanly."""

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from assay.errors import AssayError
from assay.po.config import load_po_config
from assay.po.data import encode, read_preferences
from assay.po.losses import PREFERENCE_LOSSES, Pairs
from assay.po.step import Objective
from assay.po.train import REFERENCE_FILE, train_po
from assay.report.metrics import read_metrics

from test_rm import assert_keys_documented

# prompts whose chosen and rejected answers differ in a way a 2-layer model can learn in a few steps
SEPARABLE = [{"prompt": f"{a}+{b}=", "chosen": "yes", "rejected": "no", "subset": "s"} for a in range(12) for b in range(4)]


def write(tmp_path, rows, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def po_args(tmp_path, model_dir, data, name, *extra):
    return [f"model={model_dir}", f"data.path={data}", f"output_dir={tmp_path}", f"run_name={name}", "train.threads=1",
            "train.batch_size=8", "optim.lr=2e-3", "optim.warmup_steps=2", "data.eval_fraction=0.25", "loss_args={beta: 0.5}", *extra]


def plain_seq_logps(model, rows):
    """Σ log π of each response through the model's own forward, one sequence at a time (no batching, no padding)."""
    out = []
    for traj in [r.chosen for r in rows] + [r.rejected for r in rows]:
        ids = torch.tensor([traj.prompt_ids + traj.completion_ids])
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
        P = len(traj.prompt_ids)
        out.append(logp[P - 1 :].gather(-1, ids[0, P:, None]).sum())
    return torch.stack(out)


def test_the_update_equals_a_plain_computation(tmp_path, tiny_model_dir):
    """Objective.step (batched, left-padded, shared-prefix forward, micro-batches) gives the loss and gradient of the loss
    written out from the model's own forward one sequence at a time."""
    from assay.models import load_policy

    model, tok = load_policy(str(tiny_model_dir))
    rows = encode(read_preferences(str(write(tmp_path, [{"prompt": "12+3=", "chosen": "15", "rejected": "9"},
                                                        {"prompt": "7+7=", "chosen": "14", "rejected": "1444"},
                                                        {"prompt": "7+7=", "chosen": "14", "rejected": "41"}]))), tok, 64, "p")
    ref = torch.tensor([[-20.0, -18.0], [-15.0, -30.0], [-16.0, -17.5]])
    lp = plain_seq_logps(model, rows)
    lens = torch.tensor([float(len(r.chosen.completion_ids)) for r in rows] + [float(len(r.rejected.completion_ids)) for r in rows])
    want = PREFERENCE_LOSSES.get("dpo")(Pairs(lp[:3], lp[3:], lens[:3], lens[3:]), Pairs(ref[:, 0], ref[:, 1], lens[:3], lens[3:]), beta=0.3)
    want.loss.mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for micro, fast in ((0, True), (1, True), (2, False)):
        model.zero_grad(set_to_none=True)
        got = Objective("dpo", {"beta": 0.3}, tok.pad_token_id, "cpu", fast=fast, micro_batch=micro).step(model, rows, ref)
        assert got["po/loss"] == pytest.approx(float(want.loss.mean().detach()), abs=1e-5)
        assert got["po/logp_chosen"] == pytest.approx(float(lp[:3].mean().detach()), abs=1e-4)
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, grads[n], atol=1e-5, rtol=1e-4), (micro, fast, n)


def test_a_run_learns_and_writes_its_folder(tmp_path, tiny_model_dir):
    data = write(tmp_path, SEPARABLE)
    result = train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "sep", "train.steps=24", "train.eval_every=12")))
    rows = read_metrics(result.run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/loss" in r] == [0, 12, 24]
    assert rows[0]["eval/loss"] == pytest.approx(0.6931, abs=1e-3)  # policy = reference: −log σ(0)
    assert rows[-1]["eval/reward_accuracy"] == 1.0 and rows[-1]["eval/loss"] < 0.3
    assert rows[-1]["po/reward_margin"] > 0 and rows[-1]["po/logp_chosen"] > rows[1]["po/logp_chosen"]
    assert_keys_documented(result.run_dir)
    assert {"report.html", "po_loss.png", "po_heldout.png", REFERENCE_FILE} <= {p.name for p in result.run_dir.iterdir()}
    assert (result.model_dir / "model.safetensors").is_file() and "dpo" in (result.model_dir / "README.md").read_text()


def test_resume_is_exact_and_reads_the_cached_reference(tmp_path, tiny_model_dir):
    """A resumed run reads the reference's log-probabilities from the run folder: it goes on with the reference model gone."""
    ref_dir = tmp_path / "ref-model"
    shutil.copytree(tiny_model_dir, ref_dir)
    data = write(tmp_path, SEPARABLE)
    common = ["train.eval_every=3", "train.save_every=3", f"reference={ref_dir}", "loss=ipo", "train.micro_batch=3"]
    whole = train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "whole", "train.steps=6", *common)))
    train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "cut", "train.steps=3", *common)))
    cut = tmp_path / "cut"
    with open(cut / "metrics.jsonl", "a") as f:  # a run killed after step 4 left a row past its checkpoint
        f.write(json.dumps({"step": 4, "po/loss": 123.0}) + "\n")
    shutil.rmtree(ref_dir)
    resumed = train_po(resume=cut, overrides=["train.steps=6"])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("po/step_seconds", "po/elapsed_seconds")} for r in rows]  # noqa: E731
    assert strip(read_metrics(cut / "metrics.jsonl")) == strip(read_metrics(whole.run_dir / "metrics.jsonl"))
    a, b = load_file(whole.model_dir / "model.safetensors"), load_file(resumed.model_dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(AssayError, match="cannot change when a run is resumed"):
        train_po(resume=cut, overrides=["loss=dpo"])


def test_the_cache_holds_the_reference_model_s_log_probabilities(tmp_path, tiny_model_dir):
    from assay.models import build_char_tokenizer, build_tiny_model, load_policy

    other = tmp_path / "other"  # a reference that is not the policy
    tok = build_char_tokenizer()
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, seed=5).save_pretrained(other)
    tok.save_pretrained(other)
    data = write(tmp_path, SEPARABLE[:16])
    result = train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "c", "train.steps=1", f"reference={other}",
                                                   "data.eval_fraction=0")))
    cached = load_file(result.run_dir / REFERENCE_FILE)["train"]
    ref_model, tok2 = load_policy(str(other))
    rows = encode(read_preferences(str(data)), tok2, 256, "p")
    with torch.no_grad():
        direct = plain_seq_logps(ref_model, rows)
    assert cached.shape == (16, 2) and torch.allclose(cached.t().reshape(-1), direct, atol=1e-4)


def test_kto_on_an_unpaired_file_and_a_task_evaluation(tmp_path, tiny_model_dir):
    rows = [{"prompt": f"{a}+1=", "completion": str(a + 1) if a % 2 else "0", "label": bool(a % 2)} for a in range(24)]
    data = write(tmp_path, rows)
    result = train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "kto", "loss=kto", "train.steps=4", "eval.task=arithmetic",
                                                   "eval.n=8", "loss_args={beta: 0.1, undesirable_weight: 1.5}")))
    m = read_metrics(result.run_dir / "metrics.jsonl")
    assert m[0]["eval/accuracy"] == 0.0 and "eval/mean_length" in m[-1]  # the random model never adds; its answers are measured
    assert all(r["po/kl"] >= 0 for r in m[1:]) and "po/reward_accuracy" not in m[1]  # unpaired rows: no pairs to be right about
    assert_keys_documented(result.run_dir)


@pytest.mark.parametrize("extra, needle", [
    (["loss=dpp"], "unknown preference loss 'dpp'"),
    (["loss_args={beta: -1}"], "loss_args: beta=-1 for dpo must be > 0"),
    (["loss_args={gamma: 1}"], "unknown argument 'gamma' for dpo"),
])
def test_bad_losses_are_one_line_before_any_folder(tmp_path, tiny_model_dir, extra, needle):
    data = write(tmp_path, SEPARABLE[:4])
    with pytest.raises(AssayError, match=needle):
        train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "bad", *extra)))
    assert not (tmp_path / "bad").exists()


def test_an_unpaired_file_needs_an_unpaired_loss(tmp_path, tiny_model_dir):
    data = write(tmp_path, [{"prompt": "1+1=", "completion": "2", "label": True}] * 4)
    with pytest.raises(AssayError, match="unpaired rows .* need an unpaired loss"):
        train_po(load_po_config(None, po_args(tmp_path, tiny_model_dir, data, "u", "data.eval_fraction=0")))


def test_sigterm_saves_the_finished_step_and_resume_continues(tmp_path, tiny_model_dir):
    data = write(tmp_path, SEPARABLE)
    args = po_args(tmp_path, tiny_model_dir, data, "sig", "train.steps=100000", "train.save_every=0", "train.eval_every=0")
    proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "po", "train", *args, "--no-progress"], stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "continue with: assay po train --resume" in err.splitlines()[-1]
    rows = read_metrics(metrics)
    step = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(step + 1)) and (tmp_path / "sig" / "checkpoints" / f"step_{step:06d}").is_dir()
    resumed = train_po(resume=tmp_path / "sig", overrides=[f"train.steps={step + 2}"])
    assert [r["step"] for r in read_metrics(metrics)] == list(range(step + 3)) and resumed.final["po/loss"] > 0
