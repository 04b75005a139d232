"""Speed must never change what is learned.

The fast paths (the preallocated-cache decoder, the chunked LM head) are checked against
plain reference implementations written out here: the same logprobs, losses and
gradients within 1e-5, and sampling that a seed reproduces.
"""

import copy

import pytest
import torch

from assay.config import AlgoConfig
from assay.data.tasks import make_task
from assay.models import build_char_tokenizer, quiet_hf
from assay.models.llama import supported
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training import learner
from assay.models import logprobs as logprobs_mod
from assay.models.logprobs import token_logprobs_from_hidden
from assay.types import RewardResult

quiet_hf()
TOK = build_char_tokenizer()


def _model(kind: str = "qwen2", kv_heads: int = 4, seed: int = 0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[kind]
    cfg = cls[0](vocab_size=len(TOK), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=kv_heads,
                 intermediate_size=128, max_position_embeddings=128, tie_word_embeddings=kind != "llama",
                 pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id, bos_token_id=TOK.bos_token_id, **extra)
    torch.manual_seed(seed)
    return cls[1](cfg).float().eval()


def _prompts(n=4):
    task = make_task("arithmetic", terms=3)
    return [s for _, s in zip(range(n), task.stream("train", 0))]


def _batch(model, n_prompts=4, group=4, max_new=12, seed=0):
    trajs = TorchSampler(model, TOK).generate(_prompts(n_prompts), group, SamplingParams(max_new, 1.0), torch.Generator().manual_seed(seed))
    results = [RewardResult(score=float(i % 3 == 0)) for i in range(len(trajs))]
    return trajs, learner.collate(trajs, results, TOK.pad_token_id, torch.device("cpu"))


def _grads(model):
    return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _assert_close(a, b, tol=1e-5):
    scale = max(1.0, float(b.abs().max()))
    assert float((a - b).abs().max()) <= tol * scale, float((a - b).abs().max())


# -- sampling ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind,kv_heads,extra", [("qwen2", 4, {}), ("qwen2", 2, {}), ("llama", 1, {}), ("qwen3", 2, {}),
                                                ("llama", 2, {"attention_bias": True, "mlp_bias": True}),
                                                ("llama", 2, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}})])
def test_static_decoder_matches_the_hf_path_and_the_trainer(kind, kv_heads, extra):
    model = _model(kind, kv_heads, **extra)
    if extra:  # biases start at zero; make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
    assert supported(model) is None
    runs = {}
    for fast in (True, False):
        sampler = TorchSampler(model, TOK, fast=fast)
        assert sampler.path.startswith("static" if fast else "hf")
        runs[fast] = sampler.generate(_prompts(), 4, SamplingParams(16, 1.0), torch.Generator().manual_seed(3))
    for a, b in zip(runs[True], runs[False]):
        assert a.completion_ids == b.completion_ids and a.finished == b.finished
        _assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    # the sampler's logprobs are what the trainer computes for the same tokens
    batch = learner.collate(runs[True], [RewardResult(score=0.0)] * len(runs[True]), TOK.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, batch)
    _assert_close(lp * batch.mask, batch.old_logprobs)


def test_sampling_with_a_seed_is_reproducible_and_greedy_is_argmax():
    model = _model()
    sampler = TorchSampler(model, TOK)
    draw = lambda: sampler.generate(_prompts(), 4, SamplingParams(16, 1.0), torch.Generator().manual_seed(7))
    a, b = draw(), draw()
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    other = sampler.generate(_prompts(), 4, SamplingParams(16, 1.0), torch.Generator().manual_seed(8))
    assert [t.completion_ids for t in a] != [t.completion_ids for t in other]
    # greedy: each token is the argmax of a plain full forward pass over the prefix
    (g,) = sampler.generate(_prompts(1), 1, SamplingParams(8, 0.0))
    ids = list(g.prompt_ids)
    for t in g.completion_ids:
        with torch.no_grad():
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        assert nxt == t
        ids.append(t)


@pytest.mark.parametrize("kind,extra", [("qwen2", {}), ("qwen3", {}), ("llama", {"attention_bias": True, "mlp_bias": True})])
def test_the_gpus_form_of_the_decoder_step_matches_the_hf_path(kind, extra, monkeypatch):
    """The step as a GPU runs it (`x @ Wᵀ`, residual sums in `addmm`, rotary as a product), here on the CPU: the Hugging Face path's tokens."""
    from assay.rollout import torch_sampler

    class GpuForm(torch_sampler.StaticDecoder):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.cpu_form, self.rotation_product = False, True  # the product as in bf16 (here in fp32)

    model = _model(kind, 2, **extra)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf = TorchSampler(model, TOK, fast=False).generate(_prompts(), 4, SamplingParams(16, 1.0), torch.Generator().manual_seed(3))
    monkeypatch.setattr(torch_sampler, "StaticDecoder", GpuForm)
    fast = TorchSampler(model, TOK).generate(_prompts(), 4, SamplingParams(16, 1.0), torch.Generator().manual_seed(3))
    for a, b in zip(fast, hf):
        assert a.completion_ids == b.completion_ids
        _assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


def test_the_bf16_norm_is_the_modules_own():
    """`_norm` in bf16 (the norm, then its weight) gives the Hugging Face module's values, bit for bit."""
    from assay.models.llama import _norm

    model = _model().bfloat16()
    module = model.model.layers[0].input_layernorm
    with torch.no_grad():
        module.weight.normal_(1.0, 0.3)
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).mul(3).bfloat16()
        assert torch.equal(_norm(module, torch.bfloat16)(x), module(x))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_the_draw_is_multinomials_and_its_logprob_the_trainers(temperature):
    """`_pick` draws what `torch.multinomial` draws from the same generator, and scores it as a log-softmax would."""
    from assay.rollout.torch_sampler import _pick

    logits = torch.randn(64, 3000, generator=torch.Generator().manual_seed(0)) * 3
    tok, lp = _pick(logits, SamplingParams(8, temperature), torch.Generator().manual_seed(7))
    ref = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=torch.Generator().manual_seed(7))[:, 0]
    assert torch.equal(tok, ref)
    assert torch.allclose(lp, torch.log_softmax(logits / temperature, -1).gather(-1, tok[:, None])[:, 0], atol=2e-6)
    # bf16 logits (a GPU policy's) are drawn from in fp32, as the trainer scores them
    half = logits.bfloat16()
    tok16, lp16 = _pick(half, SamplingParams(8, temperature), torch.Generator().manual_seed(7))
    assert torch.equal(tok16, _pick(half.float(), SamplingParams(8, temperature), torch.Generator().manual_seed(7))[0])
    assert torch.allclose(lp16, torch.log_softmax(half.float() / temperature, -1).gather(-1, tok16[:, None])[:, 0], atol=2e-6)


@pytest.mark.slow
def test_the_fused_draw_is_the_eager_one():
    """`rollout.compile` draws through `torch.compile`: the same tokens from the same generator, logprobs to rounding."""
    from assay.rollout import torch_sampler

    logits = torch.randn(33, 3000, generator=torch.Generator().manual_seed(1)) * 3
    for temperature in (1.0, 0.6):
        params = SamplingParams(8, temperature)
        eager = torch_sampler._pick(logits, params, torch.Generator().manual_seed(5))
        fused = torch_sampler._pick(logits, params, torch.Generator().manual_seed(5), fused=True)
        assert torch_sampler._COMPILED_RACE not in (None, False)  # compiled, not fallen back
        assert torch.equal(eager[0], fused[0]) and torch.allclose(eager[1], fused[1], atol=2e-6)


def test_dropping_finished_rows_does_not_change_the_samples():
    # Greedy decoding is a function of the model alone, so dropping finished rows from the
    # cache must leave every completion as it is. (Seeded sampling is reproducible for a
    # fixed setting, but the random stream is drawn over the rows still running.)
    from assay.models import load_policy

    model, tok = load_policy("tiny-arith")  # trained: its answers end with EOS after 1-3 digits
    prompts = [s for _, s in zip(range(24), make_task("arithmetic").stream("train", 0))]
    out = {}
    for frac in (0.01, 1.0):  # drop at the first finished row / never drop
        out[frac] = TorchSampler(model, tok, compact_frac=frac).generate(prompts, 1, SamplingParams(8, 0.0))
    lengths = {len(t.completion_ids) for t in out[1.0]}
    assert max(lengths) < 8 and max(lengths) > min(lengths)  # rows did finish, at different steps
    for a, b in zip(out[0.01], out[1.0]):
        assert a.completion_ids == b.completion_ids
        _assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    sampled = TorchSampler(model, tok, compact_frac=0.01).generate(prompts[:6], 4, SamplingParams(8, 1.0), torch.Generator().manual_seed(0))
    batch = learner.collate(sampled, [RewardResult(score=0.0)] * len(sampled), tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, batch)
    _assert_close(lp * batch.mask, batch.old_logprobs)


def test_static_decoder_refuses_what_it_cannot_run():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(TOK), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert "gpt2" in supported(gpt2)
    assert TorchSampler(gpt2, TOK).path.startswith("hf")
    sliding = _model()
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding" in supported(sliding)
    dynamic = _model("llama", 2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert "dynamic" in supported(dynamic)  # its frequencies change with the length of each call


# -- the trainer's logprobs ---------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_lm_head_equals_full_log_softmax(temperature):
    torch.manual_seed(0)
    hidden = torch.randn(5, 9, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (5, 9))
    upstream = torch.randn(5, 9)
    lp, ent = token_logprobs_from_hidden(hidden, weight, targets, temperature, chunk=7, with_entropy=True)  # 45 rows: a ragged last chunk
    (lp * upstream).sum().backward()
    got = (lp.detach(), ent, hidden.grad.clone(), weight.grad.clone())
    # the reference in float64, so that the comparison measures the fp32 error of the fast path
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logp = torch.log_softmax(h64 @ w64.t() / temperature, dim=-1)
    ref = logp.gather(-1, targets[..., None])[..., 0]
    (ref * upstream.double()).sum().backward()
    _assert_close(got[0].double(), ref.detach())
    _assert_close(got[1].double(), -(logp.exp() * logp).sum(-1).detach())
    _assert_close(got[2].double(), h64.grad)
    _assert_close(got[3].double(), w64.grad)
    assert not ent.requires_grad


@pytest.mark.parametrize("kind,kv_heads,extra", [("qwen2", 4, {}), ("llama", 1, {}), ("qwen3", 2, {}),
                                                ("llama", 2, {"attention_bias": True, "mlp_bias": True})])
def test_shared_prefix_forward_equals_the_models_own_forward(kind, kv_heads, extra):
    import dataclasses

    from assay.models import llama as forward

    model = _model(kind, kv_heads, **extra)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    trajs, _ = _batch(model, n_prompts=5, group=3)
    order = torch.randperm(len(trajs), generator=torch.Generator().manual_seed(0)).tolist()  # a prompt's rows apart
    trajs = [trajs[i] for i in order]
    one = [dataclasses.replace(t, completion_ids=t.completion_ids[:1], logprobs=t.logprobs[:1]) for t in trajs]  # T = 1
    for rows in (trajs, one):
        batch = learner.collate(rows, [RewardResult(score=0.0)] * len(rows), TOK.pad_token_id, torch.device("cpu"))
        assert forward.batch_supported(model, batch) is None
        assert len({len(t.prompt_ids) for t in rows}) > 1  # prompts of several lengths: left padding differs by row
        upstream = torch.randn(batch.mask.shape)
        got = {}
        model.train()
        for fast in (True, False):
            model.zero_grad()
            lp, ent = learner.token_logprobs(model, batch, 0.7, with_entropy=True, fast=fast)
            (lp * batch.mask * upstream).sum().backward()
            got[fast] = (lp.detach() * batch.mask, ent * batch.mask, _grads(model))
        _assert_close(got[True][0], got[False][0])
        _assert_close(got[True][1], got[False][1])
        for a, b in zip(got[True][2], got[False][2]):
            _assert_close(a, b)
    empty = dataclasses.replace(trajs[0], prompt_ids=[])
    batch = learner.collate([empty, trajs[1]], [RewardResult(score=0.0)] * 2, TOK.pad_token_id, torch.device("cpu"))
    assert forward.batch_supported(model, batch) == "an empty prompt"


def _reference_loss(model, batch, adv, clip=0.2, temperature=1.0):
    """PPO-clip with token-mean aggregation, written out position by position."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids).logits
    B, T = batch.mask.shape
    P = batch.input_ids.shape[1] - T
    total, count = 0.0, 0
    for i in range(B):
        for t in range(T):
            if batch.mask[i, t] == 0:
                continue
            logp = torch.log_softmax(logits[i, P + t - 1] / temperature, dim=-1)[batch.input_ids[i, P + t]]
            ratio = torch.exp(logp - batch.old_logprobs[i, t])
            total = total + torch.maximum(-adv[i, t] * ratio, -adv[i, t] * ratio.clamp(1 - clip, 1 + clip))
            count += 1
    return total / count


@pytest.mark.parametrize("chunked", [False, True])
def test_policy_loss_and_gradients_equal_a_plain_reference(chunked, monkeypatch):
    model = _model()
    _, batch = _batch(model)
    # move the policy off the sampler's so that ratios differ from 1 and clipping engages
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    adv = torch.randn(batch.mask.shape)
    if chunked:
        monkeypatch.setattr(logprobs_mod, "CHUNKED_MIN_ELEMENTS", 0)
    model.train()
    model.zero_grad()
    loss, metrics = learner.policy_step(model, None, batch, adv, AlgoConfig(), 1.0, 12)
    loss.backward()
    fast = _grads(model)
    assert metrics["actor/clip_frac"] > 0
    model.zero_grad()
    ref = _reference_loss(model, batch, adv)
    ref.backward()
    _assert_close(loss.detach(), ref.detach())
    for a, b in zip(fast, _grads(model)):
        _assert_close(a, b)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_whole_batch_gradient(aggregation):
    from assay.models import load_policy

    model, tok = load_policy("tiny-arith")  # completions of different lengths, so micro-batches trim differently
    prompts = [s for _, s in zip(range(6), make_task("arithmetic").stream("train", 1))]
    trajs = TorchSampler(model, tok).generate(prompts, 4, SamplingParams(6, 1.2), torch.Generator().manual_seed(0))
    assert len({len(t.completion_ids) for t in trajs}) > 1
    batch = learner.collate(trajs, [RewardResult(score=float(i % 2)) for i in range(len(trajs))], tok.pad_token_id, torch.device("cpu"))
    adv = torch.randn(batch.mask.shape)
    algo = AlgoConfig(aggregation=aggregation)
    model.train()
    grads, metrics = {}, {}
    for size in (0, 40):  # 40 tokens: micro-batches of 3-4 rows
        model.zero_grad()
        metrics[size] = learner.accumulate_step(model, None, batch, adv, algo, 1.0, 6, micro_batch_tokens=size)
        grads[size] = _grads(model)
    assert len(learner.pack_rows(batch, 40)) > 4
    for a, b in zip(grads[40], grads[0]):
        _assert_close(a, b)
    assert metrics[40]["actor/loss"] == pytest.approx(metrics[0]["actor/loss"], abs=1e-5)


def test_trim_drops_only_padding():
    model = _model()
    _, batch = _batch(model)
    sub = batch.select(torch.tensor([0, 1]))
    trimmed, adv = learner.trim(sub, torch.ones_like(sub.mask))
    assert trimmed.input_ids.shape[1] <= sub.input_ids.shape[1] and adv.shape == trimmed.mask.shape
    assert int(trimmed.attention_mask.sum()) == int(sub.attention_mask.sum())
    with torch.no_grad():
        a, _ = learner.token_logprobs(model, sub)
        b, _ = learner.token_logprobs(model, trimmed)
    _assert_close(b * trimmed.mask, (a * sub.mask)[:, : trimmed.mask.shape[1]])


def test_a_sliding_window_model_decodes_fast_when_sequences_fit_the_window():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=len(TOK), hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128, sliding_window=64, pad_token_id=TOK.pad_token_id, eos_token_id=TOK.eos_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg).eval()
    assert "sliding" in supported(model) and supported(model, max_len=64) is None and "sliding" in supported(model, max_len=65)
    runs = [TorchSampler(model, TOK, fast=f).generate(_prompts(), 2, SamplingParams(16, 1.0), torch.Generator().manual_seed(1)) for f in (True, False)]
    for a, b in zip(*runs):
        assert a.completion_ids == b.completion_ids
        _assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs))


# -- rows with zero advantage are left out of the update ---------------------------------

@pytest.fixture(scope="module")
def arith_batch():
    from assay.models import load_policy

    model, tok = load_policy("tiny-arith")
    prompts = [s for _, s in zip(range(6), make_task("arithmetic").stream("train", 1))]
    trajs = TorchSampler(model, tok).generate(prompts, 4, SamplingParams(6, 1.2), torch.Generator().manual_seed(0))
    batch = learner.collate(trajs, [RewardResult(score=float(i % 2)) for i in range(len(trajs))], tok.pad_token_id, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    batch.old_logprobs = batch.old_logprobs + 0.3 * torch.randn(batch.mask.shape, generator=gen) * batch.mask  # ratios off 1: clips engage
    adv = torch.randn(batch.mask.shape, generator=gen)
    adv[:4] = 0.0  # one whole group scored alike
    adv[8:12] = 0.0
    short = int(batch.mask.sum(-1).argmin())
    adv[short] = torch.where(batch.mask[short].bool(), 0.0, 5.0)  # nonzero only on padding: inert too
    return model, batch, adv, len({0, 1, 2, 3, 8, 9, 10, 11, short})


def _update(model, batch, adv, algo, size, skip):
    model.train()
    model.zero_grad(set_to_none=True)
    metrics = learner.accumulate_step(model, None, batch, adv, algo, 1.0, 6, micro_batch_tokens=size, skip_inert=skip)
    return metrics, _grads(model)


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo", "sapo", "reinforce"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("size", [0, 40])
def test_skipping_zero_advantage_rows_keeps_the_gradient(arith_batch, loss, aggregation, size):
    model, batch, adv, inert = arith_batch
    algo = AlgoConfig(loss=loss, aggregation=aggregation)
    assert learner.skips_inert_rows(algo)
    full, g_full = _update(model, batch, adv, algo, size, skip=False)
    skip, g_skip = _update(model, batch, adv, algo, size, skip=True)
    assert skip["actor/skipped_frac"] == pytest.approx(inert / batch.mask.shape[0])
    assert any(float(g.abs().max()) > 0 for g in g_full)
    for a, b in zip(g_skip, g_full):
        _assert_close(a, b)
    assert skip["actor/loss"] == pytest.approx(full["actor/loss"], abs=1e-6)


def test_an_all_inert_batch_steps_the_optimizer_as_the_full_update_does(arith_batch):
    model, batch, adv, _ = arith_batch
    algo = AlgoConfig()
    weights = {}
    for skip in (False, True):
        torch.manual_seed(0)
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        for a, s in ((adv, False), (torch.zeros_like(adv), skip)):  # a real step builds up Adam's moments; then one with nothing to learn
            metrics, _ = _update(m, batch, a, algo, 0, s)
            opt.step()
        weights[skip] = [p.detach().clone() for p in m.parameters()]
        if skip:
            assert metrics["actor/skipped_frac"] == 1.0 and metrics["actor/loss"] == 0.0
    for a, b in zip(weights[True], weights[False]):
        _assert_close(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(weights[True], model.parameters()))


def test_rows_are_not_skipped_when_a_zero_advantage_still_has_a_gradient(arith_batch):
    model, batch, adv, _ = arith_batch
    ref = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():  # a reference apart from the policy, so the KL term has a gradient
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for algo, ref_model in ((AlgoConfig(entropy_coef=0.01), None), (AlgoConfig(kl_coef=0.1), ref)):
        assert not learner.skips_inert_rows(algo, ref_model)
        model.zero_grad(set_to_none=True)
        model.train()
        metrics = learner.accumulate_step(model, ref_model, batch, torch.zeros_like(adv), algo, 1.0, 6, skip_inert=True)
        assert metrics["actor/skipped_frac"] == 0.0
        assert any(float(p.grad.abs().max()) > 0 for p in model.parameters() if p.grad is not None)
    assert learner.skips_inert_rows(AlgoConfig(kl_coef=0.1, advantage="frpo"), ref)  # KL through the advantages only


def test_the_cache_goes_by_the_name_the_models_forward_takes():
    """transformers 5.17's forward takes `past_key_values` only; a `cache=` there lands in `**kwargs`, is ignored,
    and every token would decode without its context (seen on the GPU machine's transformers)."""
    from assay.rollout.decoder import cache_arg

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, past_key_values=None, **kwargs):
            return input_ids

    assert cache_arg(Old()) == "past_key_values" and cache_arg(New()) == "cache"


@pytest.mark.parametrize("fast", [True, False])
def test_activation_checkpointing_recomputes_each_layer_and_keeps_the_gradient(arith_batch, fast, monkeypatch):
    """`train.activation_checkpointing`: the update's gradient is the same, and the layers really are recomputed in the
    backward pass (assay's forward checkpoints each layer; the model's own forward calls each layer's MLP twice)."""
    from assay.models import llama

    model, batch, adv, _ = arith_batch
    algo = AlgoConfig()
    model.train()
    model.zero_grad()
    plain = learner.accumulate_step(model, None, batch, adv, algo, 1.0, 6, fast=fast)
    reference = _grads(model)
    calls = {"checkpoint": 0, "mlp": 0}
    real = torch.utils.checkpoint.checkpoint

    def counting(*args, **kwargs):
        calls["checkpoint"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", counting)
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))  # the recomputation
    # stops as soon as it has what the backward needs, inside the MLP: a pre-hook sees it, a forward hook would not
    llama.enable_checkpointing(model)
    try:
        model.zero_grad()
        recomputed = learner.accumulate_step(model, None, batch, adv, algo, 1.0, 6, fast=fast)
    finally:
        hook.remove()
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
    assert llama.checkpointing(model) is False
    if fast:
        assert calls["checkpoint"] == len(model.model.layers)  # one micro-batch: each layer once
    else:
        assert calls["mlp"] == 2  # the forward, then the recomputation in the backward
    assert recomputed["actor/loss"] == pytest.approx(plain["actor/loss"], abs=1e-6)
    for a, b in zip(_grads(model), reference):
        _assert_close(a, b)
    assert learner.activation_bytes_per_token(model, True) < learner.activation_bytes_per_token(model) / 2 or len(model.model.layers) < 4
