"""`model.dtype=bfloat16`: bf16 weights with fp32 master weights (`assay.training.precision`)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from _train_helpers import LEARNING_SIGNAL, weights
from assay.config import load_config
from assay.report.metrics import read_metrics
from assay.training.precision import MasterWeights
from assay.training.rl import Trainer


def _sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def test_updates_below_bf16_resolution_accumulate_in_the_masters():
    # a weight of 1.0 moves in steps of 2^-8 in bf16 (7 stored mantissa bits): an update of 1e-3 rounds away
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mixed = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt_plain, weights_mixed = _sgd([plain]), MasterWeights([mixed], _sgd)
    assert weights_mixed.mixed and weights_mixed.master[0].dtype == torch.float32
    for _ in range(10):
        for p in (plain, mixed):
            p.grad = torch.full((4,), 1e-3, dtype=torch.bfloat16)
        opt_plain.step()
        weights_mixed.step(max_norm=1e9)
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))  # ten updates of 1e-3, all lost
    assert weights_mixed.master[0].tolist() == pytest.approx([1 - 10 * 1e-3] * 4, abs=2e-5)
    assert mixed.dtype == torch.bfloat16 and torch.equal(mixed.detach(), weights_mixed.master[0].to(torch.bfloat16))
    assert float(mixed.detach()[0]) < 1.0  # the masters' sum reached the bf16 weight


def test_the_norm_is_clipped_in_fp32_and_fp32_params_need_no_masters():
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
    w = MasterWeights([p], _sgd)
    p.grad = torch.tensor([3.0, 4.0], dtype=torch.bfloat16)
    assert w.step(max_norm=1.0) == pytest.approx(5.0)
    assert w.master[0].tolist() == pytest.approx([-0.6, -0.8], abs=1e-6)
    q = torch.nn.Parameter(torch.zeros(2))
    plain = MasterWeights([q], _sgd)
    assert not plain.mixed and plain.master == [] and plain.master_state()["masters"] is None
    assert plain.optimizer.param_groups[0]["params"][0] is q


def test_masters_round_trip_and_default_to_the_weights():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    w = MasterWeights([p], _sgd)
    w.master[0].data += 1e-3  # a master between two bf16 values
    saved = w.master_state()
    fresh = MasterWeights([p], _sgd)
    fresh.load_master(saved)
    assert torch.equal(fresh.master[0], saved["masters"][0]) and saved["masters"][0].device.type == "cpu"
    fresh.load_master(None)  # a checkpoint from before masters existed: read back from the bf16 weights
    assert torch.equal(fresh.master[0], torch.ones(3))
    fresh.load_master(saved["masters"])  # as older checkpoints hold them: the list alone
    assert torch.equal(fresh.master[0], saved["masters"][0])


def test_fp16_loss_scaling_keeps_gradients_that_would_flush_to_zero():
    """A gradient of 1e-8 inside the backward (below fp16's smallest subnormal, 6e-8) is zero without a loss scale and
    reaches the fp32 master with one, unscaled."""
    x = torch.full((4,), 0.5, dtype=torch.float16)

    def loss_of(w):  # d loss / d h = 1e-4 · 1e-4 = 1e-8 in fp16: flushed to zero unless scaled
        return ((w * x) * torch.tensor(1e-4, dtype=torch.float16)).float().sum() * 1e-4

    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    loss_of(plain).backward()
    assert torch.count_nonzero(plain.grad) == 0
    w = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))  # at 0 an fp32 master can hold the step of 5e-9
    weights = MasterWeights([w], _sgd)
    assert weights.scaled and weights.loss_scale == 2.0**16
    weights.backward(loss_of(w))
    assert weights.step(max_norm=1e9) == pytest.approx(2 * 0.5e-8, rel=1e-2)  # ‖(0.5e-8,) × 4‖
    assert weights.master[0].tolist() == pytest.approx([-0.5e-8] * 4, rel=1e-2)
    assert weights.good_steps == 1 and weights.skipped == 0


def test_a_gradient_that_is_not_finite_skips_the_step(caplog):
    """fp16: an overflow skips the step, halves the loss scale, and 2,000 (here 2) good steps double it again. Any dtype:
    an inf or NaN gradient leaves the weights and AdamW's moments as they were, with a warning and the count."""
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
    weights = MasterWeights([w], lambda ps: torch.optim.AdamW(ps, lr=0.1))
    weights.GROWTH_INTERVAL = 2
    w.grad = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    assert weights.step(1.0) == float("inf")
    assert torch.equal(w.detach(), torch.ones(2, dtype=torch.float16)) and weights.optimizer.state == {}
    assert weights.loss_scale == 2.0**15 and weights.skipped == 1 and w.grad is None and weights.master[0].grad is None
    assert weights.metrics(0) == {"actor/skipped_updates": 1.0, "actor/loss_scale": 2.0**15}
    for _ in range(2):
        w.grad = torch.tensor([1.0, 1.0], dtype=torch.float16) * weights.loss_scale
        assert weights.step(1e9) == pytest.approx(2**0.5)
    assert weights.loss_scale == 2.0**16 and weights.good_steps == 0 and w.detach()[0] < 1
    saved = weights.master_state()
    fresh = MasterWeights([torch.nn.Parameter(w.detach().clone())], _sgd)
    fresh.load_master(saved)
    assert (fresh.loss_scale, fresh.good_steps, fresh.skipped) == (2.0**16, 0, 1) and torch.equal(fresh.master[0], weights.master[0])
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.nn.Parameter(torch.ones(2, dtype=dtype))
        plain = MasterWeights([q], lambda ps: torch.optim.AdamW(ps, lr=0.1))
        assert not plain.scaled and plain.loss_scale == 1.0 and "actor/loss_scale" not in plain.metrics(0)
        q.grad = torch.tensor([1.0, 2.0], dtype=dtype)
        plain.step(1.0)
        before = {k: v.clone() for k, v in plain.optimizer.state[plain.optimizer.param_groups[0]["params"][0]].items()}
        kept = q.detach().clone()
        q.grad = torch.tensor([float("nan"), 2.0], dtype=dtype)
        with caplog.at_level("WARNING", logger="assay"):
            assert math.isnan(plain.step(1.0))
        assert "this optimizer step is skipped" in caplog.text
        after = plain.optimizer.state[plain.optimizer.param_groups[0]["params"][0]]
        assert torch.equal(q.detach(), kept) and all(torch.equal(after[k], v) for k, v in before.items()) and plain.skipped == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler")  # pytest drops the filter precision.py sets
def test_an_fp16_base_under_fp32_adapters_is_still_loss_scaled(caplog):
    """LoRA over an fp16 model: the adapters train in fp32, but the backward runs through the fp16 base, so the loss is
    scaled and the adapters' gradients unscaled. A loss that is NaN at any scale says so once the scale falls below 1;
    the scheduler stepped after a skipped step draws no torch warning."""
    base = torch.nn.Parameter(torch.ones(2, dtype=torch.float16), requires_grad=False)
    adapter = torch.nn.Parameter(torch.zeros(2))
    weights = MasterWeights([base, adapter], _sgd)
    assert weights.scaled and not weights.mixed and weights.loss_scale == 2.0**16
    weights.backward((adapter * torch.tensor([3.0, 4.0])).sum() * 1e-3)
    assert weights.step(max_norm=1e9) == pytest.approx(5e-3, rel=1e-4) and adapter.tolist() == pytest.approx([-3e-3, -4e-3])
    sched = torch.optim.lr_scheduler.LambdaLR(weights.optimizer, lambda s: 1.0)
    with caplog.at_level("WARNING", logger="assay"):
        for _ in range(17):
            weights.backward((adapter * float("nan")).sum())
            assert math.isnan(weights.step(1.0))
            sched.step()
    assert weights.loss_scale == 2.0**-1 and weights.skipped == 17 and adapter.tolist() == pytest.approx([-3e-3, -4e-3])
    assert caplog.text.count("the fp16 loss scale fell below 1") == 1
    # pytest drops warning filters set while it imports, so the scheduler's warning is checked in a process of its own
    skip_then_schedule = ("import torch; from assay.training.precision import MasterWeights; p = torch.nn.Parameter(torch.ones(2, "
                          "dtype=torch.float16)); w = MasterWeights([p], lambda ps: torch.optim.SGD(ps, lr=1.0)); "
                          "s = torch.optim.lr_scheduler.LambdaLR(w.optimizer, lambda i: 1.0); w.backward((p * float('inf')).sum()); "
                          "w.step(1.0); s.step(); print(w.skipped)")
    out = subprocess.run([sys.executable, "-c", skip_then_schedule], capture_output=True, text=True, timeout=120)
    assert out.stdout == "1\n" and "lr_scheduler.step()" not in out.stderr, out.stderr


def interrupted_and_resumed(cfg, monkeypatch, in_step: int):
    """A run stopped by Ctrl-C during its step `in_step` (1-based), then resumed to the end: its folder."""
    real, calls = Trainer._rollout, {"n": 0}

    def stop(self):
        out = real(self)
        calls["n"] += 1
        if calls["n"] == in_step:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(Trainer, "_rollout", stop)
    cut = Trainer(cfg)
    with pytest.raises(KeyboardInterrupt):
        cut.fit(progress=False)
    monkeypatch.setattr(Trainer, "_rollout", real)
    Trainer(cfg, run_dir=cut.run_dir, resume=True).fit(progress=False)
    return cut.run_dir


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_run_trains_keeps_its_weights_and_resumes_exactly(tiny_model_dir, tmp_path, monkeypatch, dtype):
    """bf16 or fp16 weights trained through fp32 masters; a run stopped in its second step and resumed ends with the same
    weights and metrics as one that was not. Under fp16 the loss scale grows after every step here (a growth interval of
    1), so the resumed run matches only if the checkpoint carried the scale."""
    if dtype == "float16":
        monkeypatch.setattr(MasterWeights, "GROWTH_INTERVAL", 1)

    def cfg(name):
        return load_config(None, [
            f"model.path={tiny_model_dir}", f"model.dtype={dtype}", f"output_dir={tmp_path}", f"run_name={name}", "train.steps=2",
            "train.eval_every=0", "train.save_every=1", "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "train.threads=1", "optim.warmup_steps=0", "optim.lr=1e-3", LEARNING_SIGNAL])

    half = getattr(torch, dtype)
    full = Trainer(cfg("full")).fit(progress=False).run_dir
    cut = interrupted_and_resumed(cfg("cut"), monkeypatch, in_step=2)
    wa, wb = weights(full / "final"), weights(cut / "final")
    assert all(v.dtype == half for v in wa.values())
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # the masters came back from the checkpoint, so the half weights did too
    start = weights(tiny_model_dir)
    assert any(not torch.equal(wa[k], start[k].to(half)) for k in wa)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("perf/") and not k.endswith("_per_s")} for r in rows]  # noqa: E731
    rows = read_metrics(full / "metrics.jsonl")
    assert strip(rows) == strip(read_metrics(cut / "metrics.jsonl"))
    rows = [r for r in rows if "actor/loss" in r]  # the training steps (not the evaluations before and after)
    assert [r["actor/skipped_updates"] for r in rows] == [0.0, 0.0]
    assert [r.get("actor/loss_scale") for r in rows] == ([2.0**17, 2.0**18] if dtype == "float16" else [None, None])


@pytest.mark.parametrize("disable", [True, False])
def test_dropout_is_off_in_the_policy_unless_kept(tmp_path, disable):
    """A policy whose config has dropout (GPT-2's 0.1 everywhere): with `model.disable_dropout` (the default) the learner's
    logprobs in training mode are the sampler's, so the first update's ratio is exactly 1; kept, they are not."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from assay.models import load_policy

    _, tok = load_policy("tiny-arith")
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    run = load_config(None, [f"model.path={tmp_path / 'gpt2'}", f"model.disable_dropout={str(disable).lower()}", "train.steps=1",
                             "train.eval_every=0", "train.save_every=0", "rollout.max_new_tokens=6", "reward={name: random, args: {p: 0.5}}",
                             "reward_workers=0", f"output_dir={tmp_path}", "run_name=r"])
    trainer = Trainer(run)
    rates = [m.p for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all((p == 0.0) == disable for p in rates)
    trainer.fit(progress=False)
    row = next(r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "actor/ratio_mean" in r)
    assert (row["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6)) == disable, row["actor/ratio_mean"]


@pytest.mark.parametrize("decay", ["linear", "cosine"])
def test_the_learning_rate_decays_after_the_warm_up_and_a_resume_keeps_the_schedule(tiny_model_dir, tmp_path, monkeypatch, decay):
    import math

    steps, warm, lr, floor = 6, 2, 1e-3, 0.1

    def cfg(name):
        return load_config(None, [
            f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", f"run_name={name}", f"train.steps={steps}", "train.eval_every=0",
            "train.save_every=1", "reward_workers=0", "rollout.prompts_per_step=2", "rollout.group_size=2", "train.threads=1",
            f"optim.warmup_steps={warm}", f"optim.lr={lr}", f"optim.decay={decay}", f"optim.min_lr_ratio={floor}", LEARNING_SIGNAL])

    full = Trainer(cfg("full")).fit(progress=False).run_dir
    got = [r["actor/lr"] for r in read_metrics(full / "metrics.jsonl") if "actor/lr" in r]
    done = [(s - warm) / (steps - warm) for s in range(warm, steps)]
    shape = [1 - d for d in done] if decay == "linear" else [0.5 * (1 + math.cos(math.pi * d)) for d in done]
    want = [lr / warm * (s + 1) for s in range(warm)] + [lr * (floor + (1 - floor) * f) for f in shape]
    assert got == pytest.approx(want, rel=1e-9)
    assert got[warm] == pytest.approx(lr) and got[-1] < got[warm]

    cut = interrupted_and_resumed(cfg("cut"), monkeypatch, in_step=4)
    assert [r["actor/lr"] for r in read_metrics(cut / "metrics.jsonl") if "actor/lr" in r] == pytest.approx(want, rel=1e-9)


def test_a_decay_name_not_known_is_refused_in_one_line(tmp_path):
    from assay.errors import AssayError

    with pytest.raises(AssayError) as e:
        load_config(None, ["optim.decay=exponential"])
    assert "optim.decay" in str(e.value) and "cosine" in str(e.value)
