"""Image policies: the shapes task and its checker, the Flow-GRPO step likelihoods, the sampler and the learner's seam."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from assay.batch import collate  # noqa: E402
from assay.images.flow import FlowConfig, FlowPolicy, gaussian_logprob, noise_std, sde_step, time_grid  # noqa: E402
from assay.images.recipe import build_word_tokenizer  # noqa: E402
from assay.images.sampler import ImageSampler  # noqa: E402
from assay.data.tasks.shapes import Shapes, ShapeCount  # noqa: E402
from assay.images.shapes import PALETTE, draw, parse_prompt, read_counts  # noqa: E402
from assay.models.logprobs import token_logprobs  # noqa: E402
from assay.rollout.base import SamplingParams  # noqa: E402
from assay.types import RewardResult, Sample, Trajectory  # noqa: E402


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_word_tokenizer()
    model = FlowPolicy(FlowConfig(vocab_size=len(tok), pad_token_id=tok.pad_token_id, block_out_channels=(8, 16), norm_num_groups=4,
                                  sampling={"steps": 4, "eval_steps": 5, "noise_level": 0.7}))
    return model.eval(), tok


def test_checker_reads_back_every_drawn_picture():
    task, rng = Shapes(), random.Random(0)
    for _ in range(200):
        s = task.make(rng)
        counts = read_counts(draw(s.fields["counts"], rng))
        assert counts == {c: s.fields["counts"].get(c, 0) for c in PALETTE}, s.prompt


def test_checker_counts_touching_blocks_as_one_and_ignores_specks():
    img = np.zeros((16, 16, 3), np.uint8)
    img[0:3, 0:3] = PALETTE["red"]
    img[0:3, 3:6] = PALETTE["red"]  # touches the first: one component
    img[10, 10] = PALETTE["blue"]  # a single pixel is noise
    img[8:11, 0:3] = (128, 0, 128)  # near no palette colour
    assert read_counts(img) == {"red": 1, "green": 0, "blue": 0, "yellow": 0, "white": 0}
    traj = Trajectory(Sample("a", "2 red", "2 red"), "<image>", [], [], [], True, info={"image": img})
    result = ShapeCount()([traj])[0]
    assert result.score == 0.0 and result.components["count_error"] == 1.0 and result.info["extracted"] == "1 red"
    assert ShapeCount(credit="colours")([traj])[0].score == pytest.approx(4 / 5)
    assert ShapeCount(credit="error")([traj])[0].score == pytest.approx(1 / 2)


def test_bad_prompts_and_missing_images_fail_one_item():
    with pytest.raises(ValueError):
        parse_prompt("2 purple")
    r = ShapeCount()([Trajectory(Sample("a", "2 red", "2 red"), "x", [], [], [], True)])[0]
    assert r.error and "no image" in r.error


def test_step_logprob_is_the_sde_gaussian_density():
    """Flow-GRPO's step: mean x + [v + σ²/(2t)(x + (1−t)v)]·Δt, std σ√−Δt, σ = a√(t/(1−t)); density by torch.distributions."""
    g = torch.Generator().manual_seed(1)
    B, a = 5, 0.7
    grid = time_grid(6).double()
    for k in range(6):
        x, v = torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64), torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64)
        t, t_next = float(grid[k]), float(grid[k + 1])
        tc = t if t < 1 else float(grid[1])
        sigma = a * math.sqrt(t / (1 - tc))
        drift = v + sigma**2 / (2 * t) * (x + (1 - t) * v)
        mean_ref, std_ref = x + drift * (t_next - t), sigma * math.sqrt(t - t_next)
        x_next = mean_ref + std_ref * torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64)
        ref = torch.distributions.Normal(mean_ref, std_ref).log_prob(x_next).mean(dim=(1, 2, 3))
        mean, std = sde_step(x, v, torch.full((B,), t, dtype=torch.float64), torch.full((B,), t_next, dtype=torch.float64), a, grid[1])
        assert torch.allclose(gaussian_logprob(x_next, mean, std), ref, atol=1e-5, rtol=0)
        assert float(noise_std(torch.tensor(t), a, grid[1])) == pytest.approx(sigma)


def test_ddim_step_is_diffusers_ddim_scheduler_step_on_the_rescaled_path():
    """The `ddim` kernel against `diffusers`' own DDIMScheduler.step: the straight path x_t = (1−t)x₀ + tε is the
    variance-preserving x' = c·x_t with c = 1/√((1−t)² + t²), ᾱ_t = c²(1−t)², and ε̂ = x_t + (1−t)v the noise estimate;
    the scheduler's step, rescaled back by 1/c_s, gives the same mean and standard deviation, and so the same density."""
    from diffusers import DDIMScheduler

    from assay.images.flow import ddim_step

    g = torch.Generator().manual_seed(2)
    B = 4
    for t, s, eta in ((0.9, 0.8, 1.0), (0.7, 0.6, 0.5), (0.35, 0.1, 1.0), (0.5, 0.45, 0.3)):
        x, v = torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64), torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64)
        c = {u: 1 / math.sqrt((1 - u) ** 2 + u**2) for u in (t, s)}
        sched = DDIMScheduler(num_train_timesteps=2, clip_sample=False, set_alpha_to_one=False, prediction_type="epsilon")
        sched.alphas_cumprod = torch.tensor([(c[s] * (1 - s)) ** 2, (c[t] * (1 - t)) ** 2], dtype=torch.float64)
        sched.num_inference_steps = 2  # prev_timestep = timestep − 2 // 2: the step from index 1 (t) to index 0 (s)
        eps_hat = x + (1 - t) * v
        zero, one = (sched.step(eps_hat, 1, c[t] * x, eta=eta, variance_noise=torch.full_like(x, z)).prev_sample / c[s] for z in (0.0, 1.0))
        mean, std = ddim_step(x, v, torch.full((B,), t, dtype=torch.float64), torch.full((B,), s, dtype=torch.float64), eta)
        assert torch.allclose(mean, zero, atol=1e-10) and torch.allclose(std.expand_as(mean), one - zero, atol=1e-10)
        x_next = zero + (one - zero) * torch.randn(B, 3, 4, 4, generator=g, dtype=torch.float64)
        ref = torch.distributions.Normal(zero, one - zero).log_prob(x_next).mean(dim=(1, 2, 3))
        assert torch.allclose(gaussian_logprob(x_next, mean, std), ref, atol=1e-5, rtol=0)
    # η = 0 is the ODE's Euler step
    x, v = torch.randn(2, 3, 4, 4, dtype=torch.float64), torch.randn(2, 3, 4, 4, dtype=torch.float64)
    mean, std = ddim_step(x, v, torch.full((2,), 0.6, dtype=torch.float64), torch.full((2,), 0.4, dtype=torch.float64), 0.0)
    assert torch.allclose(mean, x + v * (0.4 - 0.6), atol=1e-12) and float(std.max()) == 0.0


@pytest.mark.parametrize("kernel", ["sde", "ddim"])
def test_learner_recomputes_the_samplers_step_logprobs(policy, kernel):
    model, tok = policy
    model.sampling.kernel, model.sampling.train_steps = kernel, (3 if kernel == "ddim" else None)  # DDIM's last step is not an action
    sampler = ImageSampler(model, tok)
    samples = [Sample("p0", "2 red", "2 red"), Sample("p1", "1 blue 3 white", "1 blue 3 white")]
    try:
        trajs = sampler.generate(samples, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
        K = model.sampling.actions
        assert len(trajs) == 6 and [t.group for t in trajs] == [0, 0, 0, 1, 1, 1]
        assert all(len(t.logprobs) == K and t.info["actions"].shape == (5, 3, 16, 16) and t.info["image"].dtype == np.uint8 for t in trajs)
        assert all(math.isfinite(x) for t in trajs for x in t.logprobs)
        batch = collate(trajs, [RewardResult(1.0)] * 6, tok.pad_token_id, torch.device("cpu"))
        lp, ent = token_logprobs(model, batch)
        assert ent is None and torch.allclose(lp, batch.old_logprobs, atol=1e-5)
        lp.sum().backward()  # the likelihoods are differentiable in the policy's weights
        assert model.unet.conv_in.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    finally:
        model.zero_grad()
        model.sampling.kernel, model.sampling.train_steps = "sde", None


def test_greedy_pictures_are_fixed_by_the_prompt(policy):
    model, tok = policy
    sampler = ImageSampler(model, tok)
    s = [Sample("heldout-1", "2 red", "2 red")]
    a = sampler.generate(s, 1, SamplingParams(temperature=0.0))[0]
    b = sampler.generate(s, 1, SamplingParams(temperature=0.0))[0]
    assert len(a.completion_ids) == 5 and np.array_equal(a.info["image"], b.info["image"])


def test_policy_saves_and_loads(policy, tmp_path):
    from assay.models import load_policy

    model, tok = policy
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, tok2 = load_policy(str(tmp_path))
    assert loaded.policy_kind == "image" and loaded.sampling.steps == 4 and tok2("2 red")["input_ids"] == tok("2 red")["input_ids"]
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), loaded.state_dict().values()))


def _image_cfg(tmp_path, name, steps, *more):
    from assay.config import load_config

    return load_config(None, [f"output_dir={tmp_path}", f"run_name={name}", "model.path=tiny-shapes", "data.task=shapes", f"train.steps={steps}",
                              "train.eval_every=2", "train.eval_n=16", "train.save_every=1", "reward_workers=0", "rollout.prompts_per_step=2",
                              "rollout.group_size=4", "train.threads=1", "optim.warmup_steps=0", "optim.lr=1e-4", "image.steps=4",
                              "image.eval_steps=4", "image.train_steps=3", *more])


def test_an_image_run_trains_reports_and_resumes_bit_for_bit(tmp_path):
    """The same loop as text: GRPO on the checker's reward, held-out pictures in the report, final/ loads, exact resume."""
    from _train_helpers import weights

    from assay.models import load_policy
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    full = Trainer(_image_cfg(tmp_path, "full", 4)).fit(progress=False).run_dir
    cut = Trainer(_image_cfg(tmp_path, "cut", 2)).fit(progress=False).run_dir
    Trainer(_image_cfg(tmp_path, "cut", 4), run_dir=cut, resume=True).fit(progress=False)

    def steps(d):
        return [{k: v for k, v in r.items() if not k.startswith(("perf/", "eval/")) and not k.endswith("_per_s")}
                for r in read_metrics(d / "metrics.jsonl") if "actor/loss" in r]  # a run that ends at step 2 evaluates it in its own row

    rows = steps(full)
    assert rows == steps(cut) and len(rows) == 4
    assert all(r["rollout/response_length"] == 3 and r.get("actor/logprob_diff", 0.0) < 1e-5 for r in rows)
    assert any(r["actor/grad_norm"] > 0 for r in rows)
    assert "reward/count_error/mean" in rows[0] and any("eval/accuracy" in r for r in read_metrics(full / "metrics.jsonl"))
    wf, wc = weights(full / "final"), weights(cut / "final")
    assert all(wf[k].equal(wc[k]) for k in wf)
    assert sorted(p.name for p in (full / "images").iterdir()) == ["heldout_step000000.png", "heldout_step000002.png", "heldout_step000004.png"]
    assert "Held-out pictures" in (full / "report.html").read_text()
    model, _ = load_policy(str(full / "final"))
    assert model.policy_kind == "image" and model.sampling.train_steps == 3  # the run's sampling travels with the model


def test_lora_on_an_image_policy_trains_only_adapters_resumes_exactly_and_final_loads_merged(tmp_path):
    """`model.lora` on the UNet's convolutions (`LORA_TARGETS`, the default for an image policy): only the adapters train,
    checkpoints hold the adapter, a resumed run ends on the same adapter as an uninterrupted one, and `final/` loads as the
    base policy with the adapter merged, drawing the pictures the run's own model draws with the run's sampling settings."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    from assay.images.flow import LORA_TARGETS
    from assay.models import load_policy
    from assay.training.rl import Trainer

    lora = ("model.lora={r: 4, alpha: 8}", "optim.lr=0.01")
    trainer = Trainer(_image_cfg(tmp_path, "full", 3, *lora))
    trained = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained) and {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained} == set(LORA_TARGETS)
    full = trainer.fit(progress=False).run_dir
    cut = Trainer(_image_cfg(tmp_path, "cut", 2, *lora)).fit(progress=False).run_dir
    Trainer(_image_cfg(tmp_path, "cut", 3, *lora), run_dir=cut, resume=True).fit(progress=False)
    a, b = load_file(full / "final" / "adapter_model.safetensors"), load_file(cut / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a) and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    merged, tok = load_policy(str(full / "final"))
    assert merged.policy_kind == "image" and not any("lora" in n for n, _ in merged.named_parameters())
    assert (merged.sampling.steps, merged.sampling.train_steps) == (4, 3)  # the run's; tiny-shapes' own are (10, None)
    x, t = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0)), torch.tensor([0.9, 0.4])
    ids, mask = torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.long)
    with torch.no_grad():
        want = trainer.model.velocity(x, t, trainer.model.condition(ids, mask))
        got = merged.velocity(x, t, merged.condition(ids, mask))
        base = load_policy("tiny-shapes")[0]
        before = base.velocity(x, t, base.condition(ids, mask))
    assert torch.allclose(got, want, atol=1e-5) and not torch.allclose(got, before, atol=1e-4)


def test_what_an_image_policy_does_not_do_is_refused_in_one_line(tmp_path):
    from assay.errors import AssayError
    from assay.training.rl import Trainer

    with pytest.raises(AssayError, match="image policy samples in process"):
        Trainer(_image_cfg(tmp_path, "x", 1, "rollout.backend=vllm"))
    with pytest.raises(AssayError, match="rollout.max_staleness.*: an image policy trains in one process on fresh rollouts"):
        Trainer(_image_cfg(tmp_path, "x", 1, "rollout.max_staleness=1"))
    with pytest.raises(AssayError, match="DDIM's last step is deterministic"):
        Trainer(_image_cfg(tmp_path, "x", 1, "image.kernel=ddim", "image.train_steps=100"))
    with pytest.raises(AssayError, match="algo.mismatch=tis with algo.loss=nft: a loss on the forward process reads no step likelihoods"):
        Trainer(_image_cfg(tmp_path, "x", 1, "algo.loss=nft", "algo.mismatch=tis"))
    with pytest.raises(AssayError, match=r"algo.loss_args: beta=0 is not a valid float > 0 for nft"):
        Trainer(_image_cfg(tmp_path, "x", 1, "algo.loss=nft", "algo.loss_args={beta: 0}"))
    for picked in ("rollout.backend=image", "rollout.backend=torch"):  # the in-process samplers: the learner's own logprobs
        assert _image_cfg(tmp_path, "x", 1, picked).algo.mismatch == "none"
    from assay.config import load_config

    with pytest.raises(AssayError, match="algo.loss=nft: a loss on the forward process trains a picture generator.*is a language model"):
        Trainer(load_config(None, [f"output_dir={tmp_path}", "algo.loss=nft", "train.steps=1", "reward_workers=0"]))


def test_demonstrations_overshoot_by_one_block_at_the_recipes_rate():
    from assay.images.recipe import demonstrated

    rng = random.Random(0)
    shown = [demonstrated({"red": 2, "blue": 1}, 0.6, rng) for _ in range(2000)]
    extra = [sum(s.values()) - 3 for s in shown]
    assert set(extra) == {0, 1} and 0.55 < sum(extra) / len(extra) < 0.65
    assert all(read_counts(draw({"red": 4, "blue": 3}, rng)) == {"red": 4, "green": 0, "blue": 3, "yellow": 0, "white": 0} for _ in range(50))


def test_the_example_config_names_the_bundled_image_policy():
    from pathlib import Path

    from assay.config import load_config
    from assay.models import resolve_model_path
    from assay.images.flow import is_image_policy

    for name, loss in (("image-count.yaml", "nft"), ("image-count-flow-grpo.yaml", "ppo_clip")):
        cfg = load_config(str(Path(__file__).parents[1] / "examples" / name), [])
        assert cfg.data.task == "shapes" and is_image_policy(resolve_model_path(cfg.model.path)) and cfg.algo.loss == loss


def test_nft_gradient_at_the_rollout_policy_is_the_advantage_times_the_flow_matching_gradient():
    """DiffusionNFT's loss, checked against its closed-form gradient at v = v_old: 2·t²·clip(A)·(v_old − target)/(D·w),
    w the mean absolute error of x̂₀ = x_t − t·v; zero for A = 0; a good picture's velocity moves toward its target."""
    from assay.algos.losses import nft

    gen = torch.Generator().manual_seed(0)
    B, K, D = 3, 2, 3 * 4 * 4
    old = torch.randn(B, K, 3, 4, 4, generator=gen, dtype=torch.float64)
    target = torch.randn(B, K, 3, 4, 4, generator=gen, dtype=torch.float64)
    t = torch.rand(B, K, generator=gen, dtype=torch.float64)
    adv = torch.tensor([[1.5, 1.5], [-7.0, -7.0], [0.0, 0.0]], dtype=torch.float64)  # −7 is clipped to −a_max = −5
    v = old.clone().requires_grad_(True)
    loss, metrics = nft(v, old, target, t, adv, torch.ones(B, K), beta=0.5, adv_clip=5.0)
    loss.sum().backward()
    tt = t.view(B, K, 1, 1, 1)
    w = (tt * (target - old)).abs().mean(dim=(2, 3, 4)).view(B, K, 1, 1, 1)
    expected = 2 * tt**2 * adv.clamp(-5, 5).view(B, K, 1, 1, 1) * (old - target) / (D * w)
    assert torch.allclose(v.grad, expected, atol=1e-12)
    assert float(v.grad[2].abs().max()) < 1e-12
    assert float((v.grad[0] * (old[0] - target[0])).sum()) > 0  # descending the loss moves v toward the target
    assert metrics["r_mean"] == pytest.approx(((1.5 / 5 + 1) / 2 + 0.0 + 0.5) / 3)


def test_nft_noisings_are_fixed_per_batch_and_the_first_step_starts_at_the_rollout_policy(policy):
    """`draw_noisings` draws once per batch; the policy's velocities at them equal the stored old ones before any step, and
    selecting rows selects their noisings."""
    model, tok = policy
    sampler = ImageSampler(model, tok)
    trajs = sampler.generate([Sample("p0", "2 red", "2 red")], 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    batch = collate(trajs, [RewardResult(1.0)] * 3, tok.pad_token_id, torch.device("cpu"))
    draws = model.draw_noisings(batch, torch.Generator().manual_seed(1))
    K = model.sampling.actions
    assert draws.t.shape == (3, K) and draws.noise.shape == draws.old_velocity.shape == (3, K, 3, 16, 16)
    import dataclasses

    batch = dataclasses.replace(batch, draws=draws)
    v, target = model.forward_process(batch)
    assert torch.allclose(v, draws.old_velocity, atol=1e-6) and torch.allclose(target, draws.noise - batch.actions[:, -1:].squeeze(1)[:, None])
    part = batch.select(torch.tensor([2, 0]))
    assert torch.equal(part.draws.t, draws.t[[2, 0]]) and torch.equal(part.draws.old_velocity, draws.old_velocity[[2, 0]])


def test_an_nft_run_takes_several_steps_a_batch_and_resumes_bit_for_bit(tmp_path):
    """`algo.loss=nft` through the same loop: the batch's noisings are drawn once from the run's stream (checkpointed), two
    optimizer steps a batch, and a run cut after its first step and resumed ends on the same weights."""
    from _train_helpers import weights

    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    more = ("algo.loss=nft", "algo.minibatches=2", "train.eval_every=0")
    full = Trainer(_image_cfg(tmp_path, "full", 2, *more)).fit(progress=False).run_dir
    cut = Trainer(_image_cfg(tmp_path, "cut", 1, *more)).fit(progress=False).run_dir
    Trainer(_image_cfg(tmp_path, "cut", 2, *more), run_dir=cut, resume=True).fit(progress=False)
    rows = [r for r in read_metrics(full / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and all(r["actor/fm_error"] > 0 and 0 < r["actor/r_mean"] < 1 and r["actor/grad_norm"] > 0 for r in rows)
    wf, wc = weights(full / "final"), weights(cut / "final")
    assert all(wf[k].equal(wc[k]) for k in wf)


def test_an_old_ema_rollout_policy_trails_the_trained_one_and_resumes_bit_for_bit(tmp_path):
    """`algo.old_ema` (DiffusionNFT's soft update): the saved rollout policy is d·old + (1 − d)·θ after each step, computed
    here from the checkpoints' own weights; a run cut after its first step and resumed ends on the same weights, rollout
    policy included; without it the same run trains to other weights."""
    from _train_helpers import weights
    from safetensors.torch import load_file

    from assay.models import resolve_model_path
    from assay.report.metrics import read_metrics
    from assay.training.old_policy import STEM
    from assay.training.rl import Trainer

    more = ("algo.loss=nft", "algo.minibatches=2", "train.eval_every=0", "algo.old_ema=0.5", "algo.old_ema_rate=null")
    full = Trainer(_image_cfg(tmp_path, "full", 2, *more)).fit(progress=False).run_dir
    cut = Trainer(_image_cfg(tmp_path, "cut", 1, *more)).fit(progress=False).run_dir
    Trainer(_image_cfg(tmp_path, "cut", 2, *more), run_dir=cut, resume=True).fit(progress=False)
    plain = Trainer(_image_cfg(tmp_path, "plain", 2, *more[:3])).fit(progress=False).run_dir

    start = weights(resolve_model_path("tiny-shapes"))
    ck = [full / "checkpoints" / f"step_{s:06d}" for s in (1, 2)]
    theta = [weights(c) for c in ck]
    old = [load_file(c / f"{STEM}.safetensors") for c in ck]
    assert old[0].keys() == start.keys()
    for k in start:
        assert torch.allclose(old[0][k], 0.5 * start[k] + 0.5 * theta[0][k], atol=1e-6)
        assert torch.allclose(old[1][k], 0.5 * old[0][k] + 0.5 * theta[1][k], atol=1e-6)
    assert any(not torch.equal(old[1][k], theta[1][k]) for k in start)
    assert [r["actor/old_ema"] for r in read_metrics(full / "metrics.jsonl") if "actor/loss" in r] == [0.5, 0.5]
    wf, wc, wp = weights(full / "final"), weights(cut / "final"), weights(plain / "final")
    assert all(wf[k].equal(wc[k]) for k in wf) and any(not wf[k].equal(wp[k]) for k in wf)
    resumed = load_file(cut / "checkpoints" / "step_000002" / f"{STEM}.safetensors")
    assert all(resumed[k].equal(old[1][k]) for k in start)


def test_old_ema_is_refused_where_another_process_or_thread_samples(tmp_path):
    from assay.errors import AssayError

    with pytest.raises(AssayError, match="algo.old_ema=0.5.*max_staleness"):
        _image_cfg(tmp_path, "x", 1, "algo.old_ema=0.5", "rollout.max_staleness=1")
    with pytest.raises(AssayError, match="old_ema"):
        _image_cfg(tmp_path, "x", 1, "algo.old_ema=1.0")
