"""End-to-end runs of `assay train` on a tiny randomly initialised model.

Every run is scored by `LEARNING_SIGNAL` (a deterministic 0/1 reward, p = 0.5) unless a test
sets its own reward, so the weights really move and "trains like X" compares real updates.
"""

import json
import re
from pathlib import Path

import pytest

from _train_helpers import LEARNING_SIGNAL, assert_learned, assert_same_update, weights
from assay.config import load_config
from assay.report.metrics import read_metrics
from assay.training.rl import Trainer


def run_cfg(model_dir, out, name, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=3", "train.eval_every=2",
        "train.eval_n=16", "train.save_every=1", "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1",
        "optim.warmup_steps=0", "optim.lr=1e-3", LEARNING_SIGNAL, *extra,
    ])


def steps_of(run_dir):
    """Per-step training metrics without the timing keys (which differ between runs)."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    timing = lambda k: k.startswith("perf/") or k.endswith("_per_s")
    return {r["step"]: {k: v for k, v in r.items() if not timing(k)} for r in rows}


def test_two_step_run_writes_everything(tiny_model_dir, tmp_path):
    cfg = run_cfg(tiny_model_dir, tmp_path, "two", "train.steps=2", "algo.kl_coef=0.1", "reward_workers=2")
    result = Trainer(cfg).fit(progress=False)
    d = result.run_dir
    for f in ["metrics.jsonl", "config.yaml", "report.html", "reward.png", "heldout_accuracy.png", "final/model.safetensors", "final/config.json"]:
        assert (d / f).is_file(), f
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    rows = steps_of(d)
    assert sorted(rows) == [1, 2]
    keys = {"reward/mean", "reward/std", "canary/mean", "actor/kl", "actor/entropy", "actor/clip_frac", "rollout/response_length",
            "reward/zero_var_group_frac", "reward/failures", "reward/none", "reward/length_corr"}
    assert keys <= rows[2].keys()
    all_rows = read_metrics(d / "metrics.jsonl")
    assert all_rows[0]["step"] == 0 and "eval/accuracy" in all_rows[0]
    assert {"perf/tokens_per_s", "perf/step_s"} <= all_rows[1].keys()
    assert "held-out accuracy at end" in (d / "report.html").read_text()
    # the sampler's logprobs are the trainer's: on-policy, the first update sees ratio 1
    assert abs(rows[1]["actor/ratio_mean"] - 1.0) < 1e-4
    assert_learned(d, tiny_model_dir)
    # the reference stays where the policy started: no KL on the first update, some once the policy moved
    assert rows[1]["actor/kl"] == pytest.approx(0.0, abs=1e-6) and rows[2]["actor/kl"] > 1e-6


def test_same_seed_same_metrics(tiny_model_dir, tmp_path):
    a = Trainer(run_cfg(tiny_model_dir, tmp_path, "a", "train.save_every=0")).fit(progress=False).run_dir
    b = Trainer(run_cfg(tiny_model_dir, tmp_path, "b", "train.save_every=0")).fit(progress=False).run_dir
    c = Trainer(run_cfg(tiny_model_dir, tmp_path, "c", "train.save_every=0", "seed=1")).fit(progress=False).run_dir
    assert steps_of(a) == steps_of(b)
    assert steps_of(a) != steps_of(c)
    wa, wb = weights(a / "final"), weights(b / "final")
    assert all(wa[k].equal(wb[k]) for k in wa)
    assert_learned(a, tiny_model_dir)


#: every piece with state of its own on at once: critic (weights + AdamW), retry buffer, variance
#: pool, and the stateless ones that consume prompts and RNG (dynamic sampling, gold, TIS)
STATEFUL = [
    "algo.advantage=gae", "algo.mismatch=tis", "reward={name: random, args: {p: 0.3}}", "selection.retry=true",
    "selection.retry_frac=0.5", "selection.prompts=variance", "selection.dynamic=true", "selection.inject_gold=true",
]


@pytest.mark.parametrize("extra", [[], STATEFUL], ids=["default", "critic-and-samplers"])
def test_interrupted_run_resumes_to_the_same_metrics(tiny_model_dir, tmp_path, monkeypatch, extra):
    full = Trainer(run_cfg(tiny_model_dir, tmp_path, "full", *extra)).fit(progress=False).run_dir

    real_rollout = Trainer._rollout
    calls = {"n": 0}

    def stop_in_third(self):  # Ctrl-C after the third step's rollouts were generated and scored
        out = real_rollout(self)
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(Trainer, "_rollout", stop_in_third)
    cut = Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", *extra, "train.save_every=0"))
    with pytest.raises(KeyboardInterrupt):
        cut.fit(progress=False)
    assert sorted(steps_of(cut.run_dir)) == [1, 2]
    monkeypatch.setattr(Trainer, "_rollout", real_rollout)

    resumed = Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", *extra, "train.save_every=0"), run_dir=cut.run_dir, resume=True)
    assert resumed.step == 2
    resumed.fit(progress=False)
    assert steps_of(cut.run_dir) == steps_of(full)
    assert steps_of(full)[3]["reward/mean"] == steps_of(cut.run_dir)[3]["reward/mean"]
    wf, wc = weights(full / "final"), weights(cut.run_dir / "final")
    assert all(wf[k].equal(wc[k]) for k in wf)  # bit for bit
    assert_learned(full, tiny_model_dir)
    if extra:  # the pieces really ran, so their state mattered
        rows = steps_of(full).values()
        assert all({"critic/loss", "mismatch/weight_mean", "selection/retry_size", "selection/picked_var", "selection/rounds", "selection/gold_injected"} <= r.keys() for r in rows)
        assert any(r["selection/retried_frac"] > 0 for r in rows) and any(r["selection/rounds"] > 1 for r in rows)
        docs = Path(__file__).parents[1] / "docs"  # metrics.md, and rewards.md for the reward metrics
        keys = re.findall(r"`([a-z0-9_<>]+(?:/[a-z0-9_@<>]+)+)`", (docs / "metrics.md").read_text() + (docs / "rewards.md").read_text())
        documented = [re.compile(re.sub(r"<[a-z_]+>", "[^/]+", k) + "$") for k in keys]  # `reward/reason/<code>` is a family
        logged = {k for r in read_metrics(full / "metrics.jsonl") for k in r if k != "step"}
        undefined = sorted(k for k in logged if not any(d.match(k) for d in documented))
        assert not undefined, undefined  # every metric key is defined in the docs


def test_user_jsonl_data_trains(tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) + "\n" for i in range(40)))
    cfg = run_cfg(tiny_model_dir, tmp_path, "user", "data.task=null", f"data.path={data}", "data.fields={prompt: q, answer: a}", "reward=arithmetic", "train.steps=1")
    d = Trainer(cfg).fit(progress=False).run_dir
    assert 1 in steps_of(d)


def test_micro_batches_train_like_the_whole_batch(tiny_model_dir, tmp_path):
    # 0.1 MiB forces every update into micro-batches of a few rows; the update they make
    # must match a run that takes each batch whole.
    from _train_helpers import update_of

    runs = {}
    for name, mb in (("whole", "0"), ("micro", "0.1")):
        trainer = Trainer(run_cfg(tiny_model_dir, tmp_path, name, "train.steps=2", "train.eval_every=0", f"train.micro_batch_mb={mb}"))
        if name == "micro":
            assert 0 < trainer.micro_batch_tokens < 16 * 4
        runs[name] = trainer.fit(progress=False).run_dir
    assert_learned(runs["whole"], tiny_model_dir)
    assert_same_update(update_of(runs["micro"], tiny_model_dir), update_of(runs["whole"], tiny_model_dir))


def test_a_finished_run_is_never_overwritten(tiny_model_dir, tmp_path):
    from assay.errors import AssayError

    cfg = run_cfg(tiny_model_dir, tmp_path, "kept", "train.steps=1", "train.eval_every=0")
    d = Trainer(cfg).fit(progress=False).run_dir
    before = (d / "metrics.jsonl").read_bytes()
    with pytest.raises(AssayError, match="already holds a run; continue it with --resume"):
        Trainer(cfg)
    assert (d / "metrics.jsonl").read_bytes() == before


def test_assays_forward_trains_like_the_models_own(tiny_model_dir, tmp_path):
    # train.fast_forward (the shared-prefix forward) and optim.fused change how the update
    # is computed, never what it computes: the update matches the plain run's.
    from _train_helpers import update_of
    from assay.models import llama

    runs = {}
    for name, flag in (("plain", "false"), ("fast", "true")):
        trainer = Trainer(run_cfg(tiny_model_dir, tmp_path, name, "train.steps=2", "train.eval_every=0",
                                  f"train.fast_forward={flag}", f"optim.fused={flag}"))
        assert llama.supported(trainer.model) is None  # a Qwen2: the fast run really takes assay's forward
        runs[name] = trainer.fit(progress=False).run_dir
    assert_learned(runs["plain"], tiny_model_dir)
    assert_same_update(update_of(runs["fast"], tiny_model_dir), update_of(runs["plain"], tiny_model_dir))


def test_an_old_ema_rollout_policy_samples_a_text_run(tiny_model_dir, tmp_path):
    """With `algo.old_ema` the completions come from the trailing policy: the update's first forward agrees with the
    sampler's logprobs at step 0 (both are the starting weights) and not after, where the loop without it agrees at
    every step; with d = 0 throughout (`old_ema_after` past the run) the run is the plain one, step for step."""
    ema = Trainer(run_cfg(tiny_model_dir, tmp_path, "ema", "algo.old_ema=0.5", "algo.old_ema_rate=null")).fit(progress=False).run_dir
    plain = Trainer(run_cfg(tiny_model_dir, tmp_path, "plain")).fit(progress=False).run_dir
    diff = {name: [r["actor/logprob_diff"] for r in steps_of(d).values()] for name, d in (("ema", ema), ("plain", plain))}
    assert diff["ema"][0] < 1e-5 and min(diff["ema"][1:]) > 1e-4 and max(diff["plain"]) < 1e-5, diff
    assert [r["actor/old_ema"] for r in steps_of(ema).values()] == [0.5] * 3
    assert_learned(ema, tiny_model_dir)
    late = Trainer(run_cfg(tiny_model_dir, tmp_path, "late", "algo.old_ema=0.5", "algo.old_ema_after=10")).fit(progress=False).run_dir
    same = lambda d: {s: {k: v for k, v in r.items() if k != "actor/old_ema"} for s, r in steps_of(d).items()}
    assert same(late) == same(plain)  # d = 0 throughout: the copy samples exactly what the trained policy would
    w_late, w_plain = weights(late / "final"), weights(plain / "final")
    assert w_late.keys() == w_plain.keys() and all(w_late[k].equal(v) for k, v in w_plain.items())
