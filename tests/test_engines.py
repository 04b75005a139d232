"""The engine backends against real engines: a colocated vLLM and a real `vllm serve` process.

Marked `engine`: run with `.venv-engine/bin/python -m pytest -m engine` (CI does). Each
backend is one engine for the whole session (`engine_sampler` in conftest.py), except the
training runs, which build their own sampler as `assay train` does.
"""

from __future__ import annotations

import copy

import pytest
import torch

from assay.config import load_config
from assay.data.tasks import make_task
from assay.envs import Environment, Step
from assay.errors import AssayError
from assay.rollout.base import SamplingParams
from assay.rollout.multiturn import Budget, MultiTurn
from assay.training import learner
from assay.training.rl import Trainer
from assay.types import RewardResult

pytestmark = pytest.mark.engine
ENGINES = ["vllm", "openai"]


def moved(model, scale=0.05, seed=0):
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return out


@pytest.mark.parametrize("name", ENGINES)
def test_first_update_logprobs_match_the_learners_within_1e_3(engine_sampler, bundled, name):
    """The Done-when figure: a training step's rollouts (16 prompts × 8, T = 1) scored by the learner."""
    model, tok = bundled
    sampler = engine_sampler(name)
    prompts = [s for _, s in zip(range(16), make_task("arithmetic").stream("train", 0))]
    trajs = sampler.generate(prompts, 8, SamplingParams(6, 1.0), torch.Generator().manual_seed(0))
    batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, batch, 1.0, fast=True)
    diff = ((lp - batch.old_logprobs).abs() * batch.mask).sum() / batch.mask.sum()
    assert diff < 1e-3
    assert diff < 1e-5  # what it is here in fp32: rounding


@pytest.mark.parametrize("name", ENGINES)
def test_the_probe_proves_each_sync(engine_sampler, bundled, name):
    """A stale engine fails the probe check; after `update_weights` it passes, and scores like the new weights."""
    model = bundled[0]
    sampler = engine_sampler(name)
    new = moved(model)
    with pytest.raises(AssayError, match="weight sync to version .* failed"):
        _check(sampler, new)  # the engine still holds `model`'s weights
    try:
        sampler.update_weights(new, 7)
        report = sampler.metrics()
        assert report["engine/sync_diff_mean"] < 1e-5 and report["engine/sync_s"] > 0
        assert sampler.version == 7
        with pytest.raises(AssayError, match="failed"):
            _check(sampler, model)
    finally:
        sampler.update_weights(model, 0)
        sampler.metrics()


def _check(sampler, model):
    from assay.rollout.sync import check_sync, learner_probe_logprobs

    return check_sync(sampler.probe_logprobs(), learner_probe_logprobs(model, sampler.probe), sampler.tolerance, "engine", sampler.version)


def test_a_sync_that_leaves_out_a_tied_weight_is_caught(engine_sampler, bundled):
    """Sending `named_parameters()` drops the tied `lm_head.weight`; vLLM then keeps its LM head's old values."""
    model = bundled[0]
    sampler = engine_sampler("vllm")
    new = moved(model, seed=1)
    weights = [(n, p.detach()) for n, p in new.named_parameters()]  # remove_duplicate=True: no lm_head.weight
    assert "lm_head.weight" not in dict(weights)
    try:
        sampler.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        sampler.llm.reset_prefix_cache()
        with pytest.raises(AssayError, match="failed"):
            _check(sampler, new)
    finally:
        sampler.update_weights(model, 0)
        sampler.metrics()


def test_a_fixed_server_trains_off_policy_and_logs_the_staleness(bundled, vllm_server):
    from assay.config import RolloutConfig
    from assay.rollout.base import make_sampler

    model, tok = bundled
    sampler = make_sampler("openai", model, tok, RolloutConfig(backend="openai", server_url=vllm_server, weight_sync="none"))
    try:
        sampler.update_weights(moved(model), 3)
        assert sampler.metrics() == {"engine/staleness": 3.0}
        trajs = sampler.generate(make_task("arithmetic").heldout(2), 2, SamplingParams(6, 1.0), torch.Generator().manual_seed(0))
        assert {t.version for t in trajs} == {0}
    finally:
        sampler.close()


@pytest.mark.parametrize("name", ENGINES)
def test_assay_train_on_an_engine(tmp_path, name, request, engine_sampler, bundled):
    """A short `assay train` on the bundled task: weights synced and checked every step, mismatch correction on."""
    extra = [f"rollout.server_url={request.getfixturevalue('vllm_server')}"] if name == "openai" else []
    cfg = load_config(None, [f"rollout.backend={name}", "train.steps=3", "train.eval_every=0", "train.eval_n=50", "train.save_every=0",
                             "reward_workers=0", f"output_dir={tmp_path}", "run_name=r", *extra])
    assert cfg.algo.mismatch == "tis"
    trainer = Trainer(cfg)
    try:
        trainer.fit(progress=False)
    finally:
        trainer.sampler.close()
        if name == "openai":  # the session's server now holds the trained weights: give it the bundled ones back
            engine_sampler("openai").update_weights(bundled[0], 0)
    import json

    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in rows if "engine/sync_diff_mean" in r]
    assert len(steps) == 3
    assert all(r["engine/sync_diff_mean"] < 1e-3 and r["mismatch/abs_diff_mean"] < 1e-3 for r in steps)
    assert steps[0]["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("name", ENGINES)
def test_a_lora_run_reaches_the_engine_after_every_update(tmp_path, name, request, engine_sampler, bundled):
    """`model.lora` on an engine: the engine gets the merged weights (W + s·B·A under the plain model's names) after each
    update, and the probe check, the engine's logprobs against the learner's through peft's layers, passes every step."""
    pytest.importorskip("peft")
    extra = [f"rollout.server_url={request.getfixturevalue('vllm_server')}"] if name == "openai" else []
    cfg = load_config(None, [f"rollout.backend={name}", "train.steps=3", "train.eval_every=0", "train.eval_n=50", "train.save_every=0",
                             "reward_workers=0", f"output_dir={tmp_path}", "run_name=r", "model.lora={r: 8, alpha: 16}", "optim.lr=1e-2",
                             "optim.warmup_steps=0", *extra])
    trainer = Trainer(cfg)
    try:
        trainer.fit(progress=False)
    finally:
        trainer.sampler.close()
        if name == "openai":
            engine_sampler("openai").update_weights(bundled[0], 0)
    import json

    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in rows if "engine/sync_diff_mean" in r]
    assert len(steps) == 3 and all(r["engine/sync_diff_mean"] < 1e-3 and r["mismatch/abs_diff_mean"] < 1e-3 for r in steps)
    moved = [p for n, p in trainer.model.named_parameters() if "lora_B" in n]
    assert moved and max(float(p.detach().abs().max()) for p in moved) > 0  # the adapters trained, so the probe compared new weights


@pytest.mark.parametrize("name", ENGINES)
def test_assay_eval_and_pass_at_large_k_through_an_engine(name, request):
    """`assay eval --backend NAME`: greedy accuracy equals the torch sampler's; pass@64 from 64 engine samples a problem."""
    from assay.eval.run import evaluate_model

    url = request.getfixturevalue("vllm_server") if name == "openai" else None
    common = dict(task="arithmetic", n=40, workers=0)
    torch_greedy = evaluate_model("tiny-arith", k=0, **common)
    out = evaluate_model("tiny-arith", k=64, backend=name, server_url=url, **common)
    assert out["accuracy"] == torch_greedy["accuracy"]
    assert out["pass@64"] >= out["accuracy"] and out["pass@64"] > 0.9  # the bundled model's pass@8 is 98.6%


class _Echo(Environment):
    """A 4-turn episode: each turn is answered `|k:<its first 3 characters>|`; the reward is the turns taken / 10."""

    def __init__(self):
        self.k, self.shown = 0, []

    def reset(self, sample):
        self.k = 0
        return sample.prompt

    def step(self, action):
        self.k += 1
        if self.k >= 4:
            return Step("", self.k / 10, True, {"finish_reason": "answer"})
        self.shown.append(f"|{self.k}:{action[:3]}|")
        return Step(self.shown[-1], 0.0, False, {})


@pytest.mark.parametrize("name", ENGINES)
def test_multi_turn_episodes_on_the_engine_are_token_exact(engine_sampler, bundled, name):
    """Episodes generated turn by turn through an engine: the learner's row is the engine's tokens and the
    environment's, the environment's are masked, and the learner's logprobs equal the engine's (first update)."""
    model, tok = bundled
    envs = []

    def make():
        envs.append(_Echo())
        return envs[-1]

    prompts = [s for _, s in zip(range(4), make_task("arithmetic").stream("train", 0))]
    loop = MultiTurn(engine_sampler(name), tok, make, Budget(max_turns=6, max_tokens=256))
    trajs = loop.run(prompts, 2, SamplingParams(6, 1.0), torch.Generator().manual_seed(0))
    assert len(trajs) == 8
    for t, env in zip(trajs, envs):
        assert len(t.turns) == 4 and t.info["reward"] == pytest.approx(0.4)
        shown = [j for j, m in enumerate(t.loss_mask) if m == 0]
        assert tok.decode([t.completion_ids[j] for j in shown]) == "".join(env.shown)  # every env token, and only those, masked
        assert all(t.loss_mask[a:b] == [1] * (b - a) for a, b in t.turns)
    batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    for i, t in enumerate(trajs):
        assert batch.input_ids[i][batch.attention_mask[i].bool()].tolist() == t.prompt_ids + t.completion_ids
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, batch, 1.0, fast=True)
    diff = ((lp - batch.old_logprobs).abs() * batch.mask).sum() / batch.mask.sum()
    assert diff < 1e-3


def test_the_judge_scores_through_vllm_serve(vllm_server):
    """The `judge` reward against a real `vllm serve` of the bundled model: ratings parsed and scaled, off-scale unscored,
    the pairwise verdict read, and the reply cache hit on a repeat (the engine is not asked again)."""
    from assay.models import resolve_model_path
    from assay.rewards.judge import Judge
    from assay.types import Sample, Trajectory

    def traj(completion: str, group: int = 0) -> Trajectory:
        return Trajectory(Sample(str(group), "q", "5"), completion, [], [], [], True, group=group)

    model = str(resolve_model_path("tiny-arith"))
    judge = Judge(vllm_server, model=model, api="completions", template="{completion}+0=", low=0, high=10, max_tokens=4)
    results = judge([traj("7"), traj("3", 1), traj("95", 2)])  # the bundled model adds: "7+0=" -> 7
    assert [r.score for r in results] == [0.7, 0.3, None] and results[2].info["reason"] == "unparsable"
    again = judge([traj("7")])[0]
    assert again.score == 0.7 and again.info.get("cached") is True


def test_each_torchrun_rank_generates_with_its_own_engine(tmp_path):
    """`torchrun --nproc-per-node 2 -m assay train rollout.backend=vllm`: each rank's engine takes the sharded policy's
    weights after every update (streamed one FSDP2 unit at a time), the probe check passes every step, and the learner's
    logprobs of the engine's tokens match the engine's."""
    import json
    import os
    import subprocess
    import sys

    from _engines import require_vllm

    require_vllm()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "assay", "train", "--no-progress",
           f"output_dir={tmp_path}", "run_name=r", "rollout.backend=vllm", "train.steps=3", "train.eval_every=3", "train.eval_n=32",
           "train.save_every=0", "train.threads=1", "rollout.prompts_per_step=8"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in rows if "engine/sync_diff_mean" in r]
    assert len(steps) == 3 and all(r["engine/sync_diff_mean"] < 1e-3 and r["mismatch/abs_diff_mean"] < 1e-3 for r in steps), steps
    assert (tmp_path / "r" / "final" / "model.safetensors").is_file()


def test_torchrun_ranks_share_one_server_and_rank_0_pushes_the_sharded_weights(tmp_path, vllm_server, engine_sampler, bundled):
    """`torchrun --nproc-per-node 2 -m assay train rollout.backend=openai`: both ranks generate their shares with one
    `vllm serve`; after every update the ranks gather the sharded policy one unit at a time and rank 0 pushes it; the
    probe check passes every step and the learner's logprobs of the served tokens match the server's."""
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "assay", "train", "--no-progress",
           f"output_dir={tmp_path}", "run_name=r", "rollout.backend=openai", f"rollout.server_url={vllm_server}", "rollout.weight_sync=push",
           "train.steps=3", "train.eval_every=3", "train.eval_n=32", "train.save_every=0", "train.threads=1", "rollout.prompts_per_step=8"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        engine_sampler("openai").update_weights(bundled[0], 0)  # the session's server holds the trained weights: the bundled ones back
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    steps = [r for r in rows if "engine/sync_diff_mean" in r]
    assert len(steps) == 3 and all(r["engine/sync_diff_mean"] < 1e-3 and r["mismatch/abs_diff_mean"] < 1e-3 for r in steps), steps
    assert all(r["engine/staleness"] == 0.0 for r in steps)


@pytest.mark.parametrize("workers", ["cluster.rollout_workers=2", "cluster.learner_workers=2"])
def test_ray_workers_generate_with_engines_of_their_own(tmp_path, workers):
    """`rollout.backend=vllm` on Ray: each rollout actor (or each learner actor, a rank of the FSDP2 job) runs a vLLM
    engine of its own, takes the learner's weights after every update in place and passes the probe check; the learner's
    logprobs of the engines' tokens match the engines'."""
    pytest.importorskip("ray", reason="the ray extra is not installed in this venv")
    from assay.api import train
    from assay.report.metrics import read_metrics

    result = train(None, "rollout.backend=vllm", "cluster.ray=true", workers, "train.steps=3", "train.eval_every=3", "train.eval_n=32",
                   "train.save_every=0", "train.threads=1", "rollout.prompts_per_step=8", "reward_workers=0", f"output_dir={tmp_path}",
                   "run_name=r", progress=False)
    steps = [r for r in read_metrics(tmp_path / "r" / "metrics.jsonl") if "reward/mean" in r]
    assert len(steps) == 3
    assert all(r["engine/sync_diff_mean"] < 1e-3 and r["mismatch/abs_diff_mean"] < 1e-3 for r in steps), steps
    if "rollout_workers" in workers:
        assert all(r["cluster/rollout_failures"] == 0.0 for r in steps)
    assert (tmp_path / "r" / "final" / "model.safetensors").is_file() and result.run_dir


def test_image_prompts_on_the_engine_match_the_learner_and_survive_a_sync(tmp_path):
    """A vision-language policy on vLLM: prompts with one and two pictures, the engine's own expansion of the
    placeholders checked against the processor's, logprobs equal to the learner's before and after a weight sync."""
    from _engines import require_vllm
    import numpy as np
    from _vlm import build_tiny_idefics3
    from PIL import Image

    from assay.config import RolloutConfig
    from assay.models import load_policy
    from assay.rollout.base import make_sampler
    from assay.types import Sample

    require_vllm()
    model, tok = load_policy(str(build_tiny_idefics3(tmp_path / "vlm")))
    model.eval()

    def picture(seed):
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8))

    def ask(i, pictures):
        return Sample(f"p{i}", [{"role": "user", "content": [*({"type": "image", "image": p} for p in pictures), {"type": "text", "text": f"{i}?"}]}])

    prompts = [ask(0, [picture(0)]), ask(1, [picture(1), picture(2)]), ask(2, [picture(3)])]
    sampler = make_sampler("vllm", model, tok, RolloutConfig(backend="vllm"))
    try:
        for version, policy in ((0, model), (1, moved(model, scale=0.02))):
            if version:
                sampler.update_weights(policy, version)
            trajs = sampler.generate(prompts, 4, SamplingParams(4, 1.0), torch.Generator().manual_seed(version))
            assert all(t.version == version and "vision" in t.info for t in trajs)
            assert trajs[4].info["vision"]["pixel_values"].shape[1] == 2  # the two-picture prompt's pictures
            batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
            with torch.no_grad():
                lp, _ = learner.token_logprobs(policy, batch, 1.0)
            diff = ((lp - batch.old_logprobs).abs() * batch.mask).sum() / batch.mask.sum()
            assert batch.mask.sum() > 0 and diff < 1e-3, diff
        # a sync that leaves the vision tower out: the text probe cannot see it, the picture probe does
        import assay.rollout.vllm_sampler as vs

        whole = vs.merged_weights
        vs.merged_weights = lambda m: ((k, v) for k, v in whole(m) if "vision" not in k)
        try:
            with pytest.raises(AssayError, match="weight sync to version 2 failed"):
                sampler.update_weights(moved(model, scale=0.05, seed=3), 2)
        finally:
            vs.merged_weights = whole
    finally:
        sampler.close()
