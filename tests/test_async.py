"""Asynchronous rollouts (`rollout.max_staleness`, `assay.training.async_rollouts`): the producer thread's schedule,
its reduction to the synchronous trainer at k = 0, reproducibility, and that no trajectory is dropped or trained twice."""

import signal
import time
import threading
from pathlib import Path

import pytest

from _train_helpers import LEARNING_SIGNAL, assert_learned, weights
from assay.config import load_config
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.training import async_rollouts
from assay.training.async_rollouts import AsyncHealth, AsyncRollouts, thread_shares
from assay.training.rl import Trainer


def run_cfg(model_dir, out, name, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=5", "train.eval_every=3",
        "train.eval_n=8", "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1",
        "optim.warmup_steps=0", "optim.lr=1e-3", LEARNING_SIGNAL, *extra,
    ])


def steps_of(run_dir, drop=("perf/", "async/")):
    """Per-step metrics without timing (and without the producer's own keys)."""
    rows = [r for r in read_metrics(Path(run_dir) / "metrics.jsonl") if "reward/mean" in r]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(drop) and not k.endswith("_per_s")} for r in rows}


def same_weights(a, b) -> bool:
    wa, wb = weights(Path(a) / "final"), weights(Path(b) / "final")
    return wa.keys() == wb.keys() and all(wa[k].equal(wb[k]) for k in wa)


def _producer_even_at_zero(self, k):
    """`Trainer._start_producer` that starts the producer for k = 0 too (a run starts it only for k > 0)."""
    self.async_ = AsyncRollouts(self, k)


def test_staleness_zero_through_the_producer_is_the_synchronous_trainer(tiny_model_dir, tmp_path, monkeypatch):
    """The whole asynchronous pipeline (producer thread, its own copy of the policy and tokenizer, published versions,
    admission) run with k = 0 gives the synchronous trainer's metrics and weights bit for bit: what k > 0 changes is the
    staleness alone."""
    sync = Trainer(run_cfg(tiny_model_dir, tmp_path, "sync")).fit(progress=False).run_dir
    monkeypatch.setattr(Trainer, "_start_producer", _producer_even_at_zero)
    piped = Trainer(run_cfg(tiny_model_dir, tmp_path, "piped")).fit(progress=False).run_dir
    assert steps_of(piped) == steps_of(sync)
    assert same_weights(piped, sync)
    rows = [r for r in read_metrics(piped / "metrics.jsonl") if "async/staleness_max" in r]
    assert len(rows) == 5 and all(r["async/staleness_max"] == 0 for r in rows)  # it did run through the producer
    assert_learned(sync, tiny_model_dir)


def test_an_async_run_is_reproducible_and_trains_on_stale_rollouts(tiny_model_dir, tmp_path, monkeypatch):
    """k = 1 with a fixed seed and thread count: the same metrics and weights twice (which version samples which batch
    does not depend on timing); after the first step every batch is exactly one version old, the loss uses the decoupled
    correction by default, and the run differs from the synchronous one. The learner does not empty the device's cache
    (`sleep`) under a producer that is sampling, as the synchronous trainer does between rollout and update."""
    from assay.rollout.torch_sampler import TorchSampler

    slept = []
    monkeypatch.setattr(TorchSampler, "sleep", lambda self: slept.append(self))
    a = Trainer(run_cfg(tiny_model_dir, tmp_path, "a", "rollout.max_staleness=1")).fit(progress=False).run_dir
    b = Trainer(run_cfg(tiny_model_dir, tmp_path, "b", "rollout.max_staleness=1")).fit(progress=False).run_dir
    assert steps_of(a) == steps_of(b) and same_weights(a, b)
    rows = [r for r in read_metrics(a / "metrics.jsonl") if "reward/mean" in r]
    assert [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert [r["async/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all("mismatch/corrected_frac" in r and r["async/learner_idle_s"] >= 0 and r["async/queue_depth"] >= 0 for r in rows)
    assert rows[1]["mismatch/ratio_mean"] != 1.0  # the proximal policy (one update newer) is not the behaviour policy
    assert slept == []
    sync = Trainer(run_cfg(tiny_model_dir, tmp_path, "sync", "algo.mismatch=tis")).fit(progress=False).run_dir
    assert len(slept) == 5
    assert steps_of(sync)[1] == {k: v for k, v in steps_of(a)[1].items()}  # step 1 is sampled by version 0 either way
    assert steps_of(sync)[3] != steps_of(a)[3]
    assert_learned(a, tiny_model_dir)


def test_every_sampled_trajectory_is_trained_on_exactly_once(tiny_model_dir, tmp_path, monkeypatch):
    """k = 2: count the trajectories the producer's sampler returned and the rows every update trained on; each sampled
    trajectory is trained on once, at the step its version allows, and none is dropped for being stale."""
    sampled, trained = [], []
    real_policy, real_learn = async_rollouts.producer_policy, Trainer.learn

    def counting_policy(trainer):
        model, sampler = real_policy(trainer)
        generate = sampler.generate

        def counted(*a, **kw):
            out = generate(*a, **kw)
            sampled.extend(out)
            return out
        sampler.generate = counted
        return model, sampler

    def counting_learn(self, rollout):
        trained.append((self.step, list(rollout[0])))
        return real_learn(self, rollout)

    monkeypatch.setattr(async_rollouts, "producer_policy", counting_policy)
    monkeypatch.setattr(Trainer, "learn", counting_learn)
    run = Trainer(run_cfg(tiny_model_dir, tmp_path, "count", "rollout.max_staleness=2", "train.steps=6")).fit(progress=False)
    every = [id(t) for _, trajs in trained for t in trajs]
    assert len(sampled) == 6 * 4 * 4 == len(every)
    assert sorted(map(id, sampled)) == sorted(every) and len(set(every)) == len(every)  # each one once, none left out
    for step, trajs in trained:
        assert {t.version for t in trajs} == {max(0, step - 2)}
    assert [r["async/staleness_max"] for r in run.metrics() if "reward/mean" in r] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]


def test_an_interrupted_async_run_resumes_to_the_same_metrics(tiny_model_dir, tmp_path, monkeypatch):
    """Ctrl-C while the learner waits for the producer: the checkpoint holds the last finished step, the position before
    the next batch and the older version that batch samples with; the resumed run regenerates the batches the producer
    had made but the learner had not trained, and ends bit for bit where an uninterrupted run does."""
    extra = ("rollout.max_staleness=2", "train.steps=6", "train.save_every=2")
    full = Trainer(run_cfg(tiny_model_dir, tmp_path, "full", *extra)).fit(progress=False).run_dir
    real_take = AsyncRollouts.take

    def stop_at_four(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return real_take(self, step)

    monkeypatch.setattr(AsyncRollouts, "take", stop_at_four)
    cut = Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", *extra))
    with pytest.raises(KeyboardInterrupt):
        cut.fit(progress=False)
    assert not cut.async_.thread.is_alive()
    ckpt = cut.run_dir / "checkpoints" / "step_000004"
    assert sorted(p.name for p in ckpt.glob("policy-version-*")) == ["policy-version-2.safetensors", "policy-version-3.safetensors"]
    monkeypatch.setattr(AsyncRollouts, "take", real_take)
    resumed = Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", *extra), run_dir=cut.run_dir, resume=True)
    assert resumed.step == 4 and sorted(resumed.resumed_versions) == [2, 3]
    resumed.fit(progress=False)
    assert steps_of(cut.run_dir) == steps_of(full)
    assert same_weights(cut.run_dir, full)


def test_a_producer_error_stops_the_run_with_its_own_message(tiny_model_dir, tmp_path, monkeypatch):
    real_collect = Trainer._collect
    calls = []

    def fails_on_third(self):
        calls.append(threading.current_thread().name)
        if len(calls) == 3:
            raise AssayError("reward: the judge's server is gone")
        return real_collect(self)

    monkeypatch.setattr(Trainer, "_collect", fails_on_third)
    trainer = Trainer(run_cfg(tiny_model_dir, tmp_path, "err", "rollout.max_staleness=1"))
    with pytest.raises(AssayError, match="judge's server is gone"):
        trainer.fit(progress=False)
    assert set(calls) == {"assay-producer"} and not trainer.async_.thread.is_alive()


def test_warnings_when_the_learner_mostly_waits_or_the_correction_mostly_clips():
    health = AsyncHealth()
    waiting = {"perf/step_s": 1.0, "async/learner_idle_s": 0.8, "async/producer_idle_s": 0.0, "mismatch/corrected_frac": 0.1}
    said = [health.check(waiting) for _ in range(async_rollouts.WARN_STEPS)]
    assert said[:-1] == [None] * (async_rollouts.WARN_STEPS - 1) and "generation is the bottleneck" in said[-1]
    assert health.check({**waiting, "async/learner_idle_s": 0.1}) is None and health.wait_streak == 0
    both = {**waiting, "async/producer_idle_s": 0.4, "mismatch/corrected_frac": 0.7}
    said = [health.check(both) for _ in range(async_rollouts.WARN_STEPS)][-1]
    assert "too tight" in said and "lower it" in said and "80%" in said and "70%" in said
    restored = AsyncHealth()
    restored.load_state_dict(health.state_dict())
    assert restored == health


def test_thread_shares_and_what_async_refuses(tiny_model_dir, tmp_path):
    assert [thread_shares(n) for n in (1, 2, 3, 4)] == [(1, 1), (1, 1), (2, 1), (2, 2)]
    with pytest.raises(AssayError, match="max_staleness=1: asynchronous rollouts run their producer on the torch backend"):
        load_config(None, ["rollout.max_staleness=1", "rollout.backend=vllm"])
    with pytest.raises(AssayError, match="max_staleness"):
        load_config(None, ["rollout.max_staleness=-1"])
    assert load_config(None, ["rollout.max_staleness=1"]).algo.mismatch == "tis"
    assert load_config(None, ["rollout.max_staleness=1", "algo.mismatch=none"]).algo.mismatch == "none"
    assert load_config(None, []).algo.mismatch == "none"


@pytest.mark.slow  # 13-17 s: the default suite stays near ten minutes (CI runs the slow tier)
def test_sigterm_mid_async_run_then_resume_through_the_command(tiny_model_dir, tmp_path):
    """The user's way: `assay train` with options in any order, SIGTERM while the producer runs ahead, `--resume`; the
    run ends with the same rows and weights as one never stopped."""
    from test_cli_runs import RUN, assay, start, trained_rows

    common = [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "train.steps=10", "rollout.max_staleness=1"]
    assay("train", *common, "run_name=ref", "--no-progress", *RUN)
    run = tmp_path / "cut"
    p = start("train", "--no-progress", *RUN[::-1], "run_name=cut", *common[::-1], "train.save_every=0")
    deadline = time.time() + 120
    while trained_rows(run) < 3 and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err
    assert "checkpoint saved; continue with: assay train --resume" in err and "Traceback" not in err
    stopped = trained_rows(run)
    assert 3 <= stopped < 10
    ckpt = run / "checkpoints" / f"step_{stopped:06d}"
    assert [c.name for c in ckpt.glob("policy-version-*")] == [f"policy-version-{stopped - 1}.safetensors"]
    assay("train", "--resume", str(run), "--no-progress")
    assert rows_of(run) == rows_of(tmp_path / "ref")
    assert same_weights(run, tmp_path / "ref")


#: what depends on timing in an asynchronous run (how long each side waited, how far the producer had got)
TIMING = ("perf/", "async/learner_idle_s", "async/producer_idle_s", "async/queue_depth")


def rows_of(run_dir):
    """Every metric row in order without what depends on timing: a lost or repeated row shows here."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING) and not k.endswith("_per_s")} for r in read_metrics(Path(run_dir) / "metrics.jsonl")]


def test_time_to_accuracy_reads_the_first_evaluation_at_the_final_figure():
    from assay.report.figures import time_to_accuracy

    rows = [{"step": 0, "eval/accuracy": 0.3, "perf/wall_s": 1.0}, {"step": 20, "eval/accuracy": 0.9, "perf/wall_s": 5.04},
            {"step": 40, "eval/accuracy": 0.85, "perf/wall_s": 9.0}, {"step": 41, "reward/mean": 1.0, "perf/wall_s": 9.5},
            {"step": 60, "eval/accuracy": 0.88, "perf/wall_s": 13.0}]
    assert time_to_accuracy(rows) == {"wall time (s)": 13.0, "time to held-out accuracy at end (s)": 5.0, "steps to held-out accuracy at end": 20}
    assert time_to_accuracy([{"step": 0, "eval/accuracy": 0.3}]) == {}  # rows written before perf/wall_s


def test_the_updates_own_forward_is_the_proximal_policy(tiny_model_dir):
    """With one optimizer step per batch the decoupled loss needs no extra pass: π_old taken from the update's own forward
    (`Batch.behaviour`) gives the loss and gradient of π_old recomputed beforehand with TIS weights against the sampler."""
    import dataclasses

    import torch

    from assay.algos import mismatch_correction
    from assay.batch import collate
    from assay.models import load_policy
    from assay.models.logprobs import token_logprobs
    from assay.rollout.base import SamplingParams
    from assay.rollout.torch_sampler import TorchSampler
    from assay.training.learner import policy_step
    from assay.types import RewardResult, Sample

    cfg = load_config(None, ["algo.mismatch=tis", "algo.mismatch_cap=1.05"])
    model, tok = load_policy(str(tiny_model_dir))
    prompts = [Sample(prompt=f"{i}+{i}=", answer="0", id=str(i)) for i in range(4)]
    trajs = TorchSampler(model, tok).generate(prompts, 4, SamplingParams(6, 1.0), torch.Generator(device="cpu").manual_seed(0))
    batch = collate(trajs, [RewardResult(float(i % 3 == 0)) for i in range(16)], tok.pad_token_id, "cpu")
    stale = batch.old_logprobs + 0.1 * torch.randn(batch.old_logprobs.shape, generator=torch.Generator(device="cpu").manual_seed(1), device="cpu")
    stale = stale * batch.mask  # a behaviour policy that is not the learner's: weights below and above the cap
    adv = (batch.rewards - batch.rewards.mean())[:, None] * batch.mask
    with torch.no_grad():
        prox = token_logprobs(model, batch)[0] * batch.mask
    weights, _ = mismatch_correction(prox, stale, batch.mask, "tis", 1.05)
    assert 0 < float((weights[batch.mask.bool()] == 1.05).float().mean()) < 1
    out = []
    for b in (dataclasses.replace(batch, old_logprobs=prox, is_weights=weights), dataclasses.replace(batch, old_logprobs=stale, behaviour=stale)):
        model.zero_grad()
        loss, metrics = policy_step(model, None, b, adv, cfg.algo, 1.0, 6)
        loss.backward()
        out.append((float(loss.detach()), [p.grad.clone() for p in model.parameters()], metrics))
    assert abs(out[0][0] - out[1][0]) < 1e-6 and out[1][2]["mismatch/corrected_frac"] > 0
    assert all((a - b).abs().max() < 1e-6 for a, b in zip(out[0][1], out[1][1]))


def test_a_run_whose_learner_mostly_waits_says_so(tiny_model_dir, tmp_path, monkeypatch):
    """Generation slower than the update: after 10 steps of waiting most of each step the row, the bar and the report warn."""
    real_collect = Trainer._collect

    def slow(self):
        time.sleep(0.3)
        return real_collect(self)

    monkeypatch.setattr(Trainer, "_collect", slow)
    run = Trainer(run_cfg(tiny_model_dir, tmp_path, "slow", "rollout.max_staleness=1", "train.steps=10", "train.eval_every=0")).fit(progress=False)
    rows = [r for r in run.metrics() if "reward/mean" in r]
    assert [("warning" in r) for r in rows] == [False] * 9 + [True]
    assert "generation is the bottleneck" in rows[-1]["warning"]
    assert "generation is the bottleneck" in (run.run_dir / "report.html").read_text()
