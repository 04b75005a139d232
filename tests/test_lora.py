"""LoRA through peft (`model.lora`, `assay.models.lora`): the fast paths apply the adapters' deltas, only adapters train,
the reference is the model with its adapters off, and a run's adapter is evaluated, exported and resumed."""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _train_helpers import LEARNING_SIGNAL, plain_logprobs
from assay.batch import collate
from assay.config import LoraSettings, load_config
from assay.errors import AssayError
from assay.models import load_policy
from assay.models.logprobs import token_logprobs
from assay.models import export
from assay.models.lora import ADAPTER_WEIGHTS, AdapterOff, apply_lora, require_peft
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training.rl import Trainer
from assay.types import RewardResult, Sample

pytest.importorskip("peft")


def lora_policy(model_dir, **settings):
    """The tiny model with adapters on every projection, B drawn at random so each delta is far from 0."""
    model, tok = load_policy(str(model_dir))
    model, peft_model = apply_lora(model, LoraSettings(r=4, alpha=8.0, **settings))
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen, device="cpu") * 0.3)
    return model.eval(), peft_model, tok


def sampled_batch(model, tok, fast=True):
    sampler = TorchSampler(model, tok, fast=fast)
    prompts = [Sample(prompt=p, answer="0", id=str(i)) for i, p in enumerate(["12+7=", "3+45=", "60+9="])]
    trajs = sampler.generate(prompts, 3, SamplingParams(6, 1.0), torch.Generator(device="cpu").manual_seed(1))
    results = [RewardResult(score=float(i % 2)) for i in range(len(trajs))]
    return sampler, trajs, collate(trajs, results, tok.pad_token_id, "cpu")


def sampler_logprobs(trajs, batch):
    out = torch.zeros_like(batch.old_logprobs)
    for i, t in enumerate(trajs):
        out[i, : len(t.logprobs)] = torch.tensor(t.logprobs)
    return out


def test_every_fast_path_applies_the_lora_delta(tiny_model_dir, monkeypatch):
    """The static decoder's fused weights, the shared-prefix forward and its gradients all equal the model's own forward
    through peft's layers; the same checks with the deltas ignored fail, so the test would catch a fast path that drops them."""
    model, peft_model, tok = lora_policy(tiny_model_dir)
    sampler, trajs, batch = sampled_batch(model, tok)
    assert sampler.path == "static"
    plain = plain_logprobs(model, batch, 1.0)
    m = batch.mask.bool()
    assert (sampler_logprobs(trajs, batch) - plain)[m].abs().max() < 1e-5  # the decoder samples from W + s·B·A
    fast, _ = token_logprobs(model, batch, fast=True)
    assert (fast - plain)[m].abs().max() < 1e-5
    with peft_model.disable_adapter():
        base = plain_logprobs(model, batch, 1.0)
    assert (base - plain)[m].abs().max() > 1e-2  # the deltas matter for these logprobs
    ref, _ = token_logprobs(AdapterOff(peft_model), batch)
    assert (ref - base)[m].abs().max() < 1e-5  # the reference: the same model, adapters off
    assert (token_logprobs(model, batch)[0] - fast).abs().max() == 0  # and they are on again

    weights = torch.randn(batch.mask.shape, generator=torch.Generator(device="cpu").manual_seed(2), device="cpu") * batch.mask
    grads = []
    for use_fast in (True, False):
        model.zero_grad()
        lp = token_logprobs(model, batch, fast=use_fast)[0] if use_fast else plain_logprobs_grad(model, batch)
        (lp * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() and all(n.count("lora_") for n in grads[0])
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).abs().max() <= 1e-5 * max(1.0, float(grads[1][n].abs().max())), n

    import assay.models.llama as llama
    import assay.rollout.decoder as decoder

    ignore = lambda lin: getattr(lin, "base_layer", lin).weight
    monkeypatch.setattr(llama, "weight_of", ignore)
    monkeypatch.setattr(decoder, "weight_of", ignore)
    _, trajs2, batch2 = sampled_batch(model, tok)
    with torch.no_grad():
        assert (token_logprobs(model, batch, fast=True)[0] - plain)[m].abs().max() > 1e-2
    assert (sampler_logprobs(trajs2, batch2) - plain_logprobs(model, batch2, 1.0))[batch2.mask.bool()].abs().max() > 1e-2


def plain_logprobs_grad(model, batch):
    T = batch.response_len
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    logp = torch.log_softmax(logits[:, -T - 1 : -1].float(), dim=-1)
    return logp.gather(-1, batch.input_ids[:, -T:, None])[..., 0]


def test_what_the_fast_paths_cannot_fold_takes_the_models_own_forward(tiny_model_dir):
    from assay.models.llama import batch_supported, supported

    model, _, tok = lora_policy(tiny_model_dir, dropout=0.1)
    _, trajs, batch = sampled_batch(model, tok)
    assert supported(model) is None and batch_supported(model, batch) is None  # sampling: dropout is off
    model.train()
    assert batch_supported(model, batch) == "LoRA dropout while training"
    model.eval()
    dora, _, _ = lora_policy(tiny_model_dir)
    dora.model.layers[0].self_attn.q_proj.use_dora = {"default": True}
    assert "LoRA variant" in supported(dora)
    assert TorchSampler(dora, tok).path.startswith("hf (")


def run_cfg(model_dir, out, name, *extra):
    return load_config(None, [
        f"model.path={model_dir}", f"output_dir={out}", f"run_name={name}", "train.steps=4", "train.eval_every=2", "train.eval_n=8",
        "train.save_every=2", "reward_workers=0", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.threads=1",
        "optim.warmup_steps=0", "optim.lr=1e-2", "model.lora={r: 4, alpha: 8}", "algo.kl_coef=0.05", LEARNING_SIGNAL, *extra,
    ])


def test_a_lora_run_trains_only_adapters_and_its_folder_is_a_model(tiny_model_dir, tmp_path):
    trainer = Trainer(run_cfg(tiny_model_dir, tmp_path, "lora"))
    assert isinstance(trainer.ref, AdapterOff)  # no second copy of the weights
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_A" in n or "lora_B" in n for n in trained)
    assert sum(p.numel() for p in trainer.weights.params) == sum(p.numel() for n, p in trainer.model.named_parameters() if n in trained)
    run = trainer.fit(progress=False).run_dir
    rows = [r for r in run_rows(run) if "actor/kl" in r]
    assert rows[0]["actor/kl"] == 0.0 and rows[-1]["actor/kl"] > 0  # B starts at 0: the adapter moves away from its reference
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): p for n, p in trainer.adapter.named_parameters() if "lora_" not in n}
    assert all(base[k].equal(start[k]) for k in start if k in base)  # the base weights never moved
    final = run / "final"
    assert (final / ADAPTER_WEIGHTS).is_file() and not (final / "model.safetensors").exists()
    assert all("lora_" in k for k in load_file(final / ADAPTER_WEIGHTS))
    assert (run / "checkpoints" / "step_000004" / ADAPTER_WEIGHTS).is_file()

    # the adapter folder loads as one model (base + merged adapter), and `export --merge` writes it whole
    merged, tok = load_policy(str(final))
    _, trajs, batch = sampled_batch(trainer.model.eval(), trainer.tokenizer)
    want = plain_logprobs(trainer.model, batch, 1.0)
    assert (plain_logprobs(merged, batch, 1.0) - want)[batch.mask.bool()].abs().max() < 1e-5
    out = export(final, tmp_path / "merged", merge=True)
    assert (out / "model.safetensors").is_file() and not (out / ADAPTER_WEIGHTS).exists()
    again, _ = load_policy(str(out))
    assert (plain_logprobs(again, batch, 1.0) - want)[batch.mask.bool()].abs().max() < 1e-5
    from assay import evaluate

    assert evaluate(str(final), task="arithmetic", n=4, k=0)["n"] == 4


def run_rows(run):
    from assay.report.metrics import read_metrics

    return [r for r in read_metrics(run / "metrics.jsonl") if "reward/mean" in r]


def test_an_interrupted_async_lora_run_resumes_bit_for_bit(tiny_model_dir, tmp_path, monkeypatch):
    """LoRA with a producer one version ahead: the checkpoint holds the adapter and the older adapter version; resumed, the
    run ends with the same metrics and adapter as one never stopped."""
    from assay.training.async_rollouts import AsyncRollouts

    full = Trainer(run_cfg(tiny_model_dir, tmp_path, "full", "rollout.max_staleness=1")).fit(progress=False).run_dir
    real_take = AsyncRollouts.take

    def stop_at_three(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return real_take(self, step)

    monkeypatch.setattr(AsyncRollouts, "take", stop_at_three)
    cut = Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", "rollout.max_staleness=1", "train.save_every=0"))
    with pytest.raises(KeyboardInterrupt):
        cut.fit(progress=False)
    version = load_file(cut.run_dir / "checkpoints" / "step_000003" / "policy-version-2.safetensors")
    assert version and all("lora_" in k for k in version)  # only adapters change between versions
    monkeypatch.setattr(AsyncRollouts, "take", real_take)
    Trainer(run_cfg(tiny_model_dir, tmp_path, "cut", "rollout.max_staleness=1", "train.save_every=0"), run_dir=cut.run_dir, resume=True).fit(progress=False)
    timing = lambda k: k.startswith(("perf/", "async/learner", "async/producer", "async/queue")) or k.endswith("_per_s")
    strip = lambda rows: [{k: v for k, v in r.items() if not timing(k)} for r in rows]
    assert strip(run_rows(cut.run_dir)) == strip(run_rows(full))
    a, b = load_file(full / "final" / ADAPTER_WEIGHTS), load_file(cut.run_dir / "final" / ADAPTER_WEIGHTS)
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)


def test_lora_mistakes_are_one_line(tiny_model_dir, tmp_path, monkeypatch):
    with pytest.raises(AssayError, match=r"model.lora.target_modules=\['nope'\]"):
        Trainer(run_cfg(tiny_model_dir, tmp_path, "bad", "model.lora={target_modules: [nope]}"))
    with pytest.raises(AssayError, match="invalid config value model.lora.r=0"):
        load_config(None, ["model.lora={r: 0}"])
    with pytest.raises(AssayError, match="exists and is not empty"):
        export(Path(tiny_model_dir), Path(tiny_model_dir), merge=True)
    monkeypatch.setitem(sys.modules, "peft", None)  # the extra is not installed
    with pytest.raises(AssayError, match=r"pip install 'assay\[lora\]'") as e:
        require_peft()
    assert "\n" not in str(e.value)


def test_an_engine_gets_the_merged_weights_under_the_models_own_names(tiny_model_dir):
    """What the vLLM backend and the server push (`merged_weights`): every name of the plain model, tied ones too, each
    LoRA layer as W + s·B·A, equal to peft's own merge; a model without adapters gives its parameters unchanged."""
    from assay.models.lora import merged_weights
    from assay.rollout.weight_transfer import decode_chunk, encode_chunks

    model, peft_model, _ = lora_policy(tiny_model_dir)
    pushed = dict(merged_weights(model))
    plain, _ = load_policy(str(tiny_model_dir))
    assert list(pushed) == [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    merged = {n: p for n, p in peft_model.merge_and_unload().named_parameters(remove_duplicate=False)}
    assert all(pushed[n].equal(merged[n]) for n in pushed)
    assert any(not pushed[n].equal(p) for n, p in plain.named_parameters())  # the deltas are in
    unchanged = merged_weights(plain)
    assert [n for n, _ in unchanged] == [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert all(t.data_ptr() == p.data_ptr() for (_, t), (_, p) in zip(unchanged, plain.named_parameters(remove_duplicate=False)))
    chunks = [decode_chunk(**c) for c in encode_chunks(model)]
    assert dict(x for c in chunks for x in c).keys() == pushed.keys()


def test_a_lora_reward_model_learns_resumes_exactly_and_is_a_plain_classifier(tmp_path, tiny_model_dir):
    """`assay rm train` with `lora`: the adapters and the score head train (the base does not), checkpoints hold them alone,
    a resumed run ends with the same rows and final model, and `final/` is a plain sequence classifier the `rm` reward reads."""
    from test_rm import SEPARABLE, rm_args, write_jsonl

    from assay.report.metrics import read_metrics
    from assay.rewards.spec import build_reward
    from assay.rm.config import load_rm_config
    from assay.rm.train import train_rm
    from assay.types import Trajectory

    data = write_jsonl(tmp_path / "pairs.jsonl", SEPARABLE)
    common = ["train.eval_every=10", "train.save_every=10", "lora={r: 4, alpha: 8}", "optim.lr=3e-3", "optim.warmup_steps=0"]
    whole = train_rm(load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "whole", "train.steps=30", *common)))
    rows = read_metrics(whole.run_dir / "metrics.jsonl")
    assert rows[-1]["eval/pair_accuracy"] == 1.0 and rows[-1]["eval/bt_loss"] < rows[0]["eval/bt_loss"] / 2
    saved = load_file(whole.run_dir / "checkpoints" / "step_000030" / ADAPTER_WEIGHTS)
    assert saved and all("lora_" in k or "score" in k for k in saved) and any("score" in k for k in saved)
    final = load_file(whole.model_dir / "model.safetensors")
    start = load_file(Path(tiny_model_dir) / "model.safetensors")
    assert not any("lora_" in k for k in final)
    moved = [k for k in start if k in final and not final[k].equal(start[k])]
    assert moved and all("proj" in k for k in moved)  # the merged adapters changed the adapted projections, nothing else

    train_rm(load_rm_config(None, rm_args(tmp_path, tiny_model_dir, data, "cut", "train.steps=20", *common)))
    resumed = train_rm(resume=tmp_path / "cut", overrides=["train.steps=30"])
    strip = lambda rows: [{k: v for k, v in r.items() if k not in ("rm/step_seconds", "rm/elapsed_seconds")} for r in rows]
    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(rows)
    again = load_file(resumed.model_dir / "model.safetensors")
    assert all(again[k].equal(final[k]) for k in final)

    reward = build_reward({"name": "rm", "args": {"path": str(whole.run_dir)}})
    trajs = [Trajectory(Sample(str(i), "99+1=", None), text, [], [], [], True) for i, text in enumerate(["yes", "no"])]
    scores = [r.score for r in reward(trajs)]
    assert scores[0] > scores[1]
