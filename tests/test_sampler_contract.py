"""The contract every generation backend must pass (`assay.rollout.base.Sampler`).

Each check runs against every backend in `BACKENDS`: the in-process torch sampler, a
colocated vLLM engine and vLLM's OpenAI-compatible server (a real `vllm serve` process
started for the session). The engine backends are marked `engine` (run with
`.venv-engine/bin/python -m pytest -m engine`): skipped where vLLM is not installed, one
failing line when `CI` is set. The learner is the reference: what a backend reports must
be what the learner computes. The model is the bundled one (its head size is one vLLM's
CPU attention supports).
"""

import copy

import pytest
import torch

from assay.data.tasks import make_task
from assay.models import build_char_tokenizer, quiet_hf
from assay.rollout.base import Sampler, SamplingParams, make_sampler
from assay.training import learner
from assay.types import RewardResult

quiet_hf()
TOK = build_char_tokenizer()
BACKENDS = ["torch", pytest.param("vllm", marks=pytest.mark.engine), pytest.param("openai", marks=pytest.mark.engine)]


#: largest |Δ logprob| of a token against the learner: the torch sampler runs the learner's own
#: kernels; an engine runs its own (oneDNN GEMMs, paged attention), so fp32 rounding differs
#: by ~1e-5 on the odd token (the mean is ~1e-7, tests/test_engines.py)
ATOL = {"torch": 2e-5, "vllm": 1e-4, "openai": 1e-4}


def name_of(backend) -> str:
    return {"TorchSampler": "torch", "VLLMSampler": "vllm", "OpenAISampler": "openai"}[type(backend).__name__]


@pytest.fixture(scope="module")
def model(bundled):
    return bundled[0]


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request, model, engine_sampler):
    if request.param != "torch":
        yield engine_sampler(request.param)  # one engine per backend for the whole session
        return
    sampler = make_sampler(request.param, model, TOK)
    yield sampler
    sampler.close()


def prompts(n=5):
    task = make_task("arithmetic", terms=3)
    return [s for _, s in zip(range(n), task.stream("train", 7))]


def learner_logprobs(model, trajs, temperature):
    batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), TOK.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = learner.token_logprobs(model, batch, temperature, fast=False)
    return lp, batch


def test_it_is_a_sampler(backend):
    assert isinstance(backend, Sampler)
    backend.sleep()
    backend.wake()


def test_n_completions_per_prompt_grouped_prompt_by_prompt(backend):
    ps = prompts()
    trajs = backend.generate(ps, 3, SamplingParams(10, 1.0), torch.Generator().manual_seed(0))
    assert len(trajs) == 15
    for i, t in enumerate(trajs):
        assert t.group == i // 3 and t.sample is ps[i // 3]
        assert t.prompt_ids == TOK(t.sample.prompt, add_special_tokens=False)["input_ids"]


def test_token_ids_are_what_was_sampled(backend):
    trajs = backend.generate(prompts(), 4, SamplingParams(12, 1.0), torch.Generator().manual_seed(1))
    for t in trajs:
        assert 1 <= len(t.completion_ids) <= 12 and len(t.logprobs) == len(t.completion_ids)
        assert t.completion == TOK.decode(t.completion_ids, skip_special_tokens=True)
        ended_on_eos = t.completion_ids[-1] == TOK.eos_token_id
        assert t.finished == ended_on_eos and t.finish_reason == ("stop" if ended_on_eos else "length")
        assert TOK.eos_token_id not in t.completion_ids[:-1]  # nothing is sampled after EOS
        if not t.finished:
            assert len(t.completion_ids) == 12
        assert t.loss_mask is None or all(t.loss_mask)  # single-turn: every token was sampled


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_logprobs_are_the_learners_on_the_first_update(backend, model, temperature):
    trajs = backend.generate(prompts(), 4, SamplingParams(12, temperature), torch.Generator().manual_seed(2))
    lp, batch = learner_logprobs(model, trajs, temperature)
    sampled = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.logprobs) for t in trajs], batch_first=True)
    torch.testing.assert_close(sampled, lp[:, : sampled.shape[1]] * batch.mask[:, : sampled.shape[1]], atol=ATOL[name_of(backend)], rtol=1e-5)
    assert all(x <= 0 for t in trajs for x in t.logprobs)


def test_greedy_is_the_argmax(backend, model):
    trajs = backend.generate(prompts(), 1, SamplingParams(8, temperature=0.0))
    for t in trajs:
        ids = list(t.prompt_ids)
        for tok in t.completion_ids:
            with torch.no_grad():
                assert int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) == tok
            ids.append(tok)


def test_seeded_runs_are_reproducible(backend):
    params = SamplingParams(10, 1.0)
    a, b, c = (backend.generate(prompts(), 4, params, torch.Generator().manual_seed(s)) for s in (5, 5, 6))
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b]
    assert [t.logprobs for t in a] == [t.logprobs for t in b]
    assert [t.completion_ids for t in a] != [t.completion_ids for t in c]


def test_the_version_advances_and_new_weights_are_used(backend, model):
    params = SamplingParams(10, 1.0)
    before = backend.generate(prompts(), 2, params, torch.Generator().manual_seed(3))
    assert {t.version for t in before} == {backend.version}
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend.update_weights(moved, backend.version + 1)
    after = backend.generate(prompts(), 2, params, torch.Generator().manual_seed(3))
    assert {t.version for t in after} == {before[0].version + 1}
    lp, batch = learner_logprobs(moved, after, 1.0)  # the sampler now samples from the new weights
    sampled = torch.nn.utils.rnn.pad_sequence([torch.tensor(t.logprobs) for t in after], batch_first=True)
    torch.testing.assert_close(sampled, lp[:, : sampled.shape[1]] * batch.mask[:, : sampled.shape[1]], atol=ATOL[name_of(backend)], rtol=1e-5)
    backend.update_weights(model, before[0].version)
