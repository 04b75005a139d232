"""The device rule's helpers, and the GPU decoding loop's logic run on the CPU.

What only a GPU can show (CUDA graphs, CUDA tensors) is in `tests/test_gpu.py`; here are the
parts of it a CPU can check: the random streams a device gets, device-free checkpoints, the
decoding loop as it runs on a GPU (a fixed batch, a read-back every 16 steps), and the
assumption CUDA-graph capture rests on (re-running a step before it is recorded changes nothing).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
import sys

import pytest
import torch

from assay.devices import activation_budget_mb, check_device, generator_for, seeded, to_cpu
from assay.errors import AssayError
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training.checkpoint import rng_state, set_rng_state


def test_a_generator_on_the_device_is_passed_through_and_none_stays_none():
    g = torch.Generator(device="cpu").manual_seed(0)
    assert generator_for(g, "cpu") is g and generator_for(g, torch.device("cpu")) is g
    assert generator_for(None, "cuda") is None


def test_another_device_gets_a_generator_seeded_from_the_runs_stream(monkeypatch):
    made = []

    class Recorder:  # stands in for a CUDA generator, which this machine cannot make
        def __init__(self, device):
            self.device = torch.device(device)
            made.append(self)

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(torch, "Generator", Recorder)
    a, b = (torch._C.Generator(device="cpu").manual_seed(5) for _ in range(2))
    ga, gb = generator_for(a, "cuda:0"), generator_for(b, "cuda:0")
    assert ga.device == torch.device("cuda:0") and ga.seed == gb.seed  # the same seed, the same device stream
    assert torch.equal(a.get_state(), b.get_state())  # and one draw taken from each run stream alike
    assert generator_for(a, "cuda:0").seed != ga.seed  # the next call draws the next seed


def test_seeded_draws_from_the_seed_and_leaves_the_global_stream_where_it_was():
    """What LoRA's and the image scorer's initialisations draw in (they take no generator): the same values for a seed,
    whatever the run drew before, and the run's own stream goes on as if nothing had been drawn."""
    torch.manual_seed(5)
    plain = torch.rand(3, device="cpu")
    torch.manual_seed(5)
    with seeded(1):
        inside = torch.rand(3, device="cpu")
    after = torch.rand(3, device="cpu")
    torch.rand(7, device="cpu")
    with seeded(1):
        again = torch.rand(3, device="cpu")
    assert after.equal(plain) and inside.equal(again) and not inside.equal(plain)
    if torch.cuda.is_available():  # the GPU's global stream too, when the draw is on it
        torch.cuda.manual_seed(5)
        first = torch.rand(3, device="cuda")
        torch.cuda.manual_seed(5)
        with seeded(1, "cuda"):
            torch.rand(3, device="cuda")
        assert torch.rand(3, device="cuda").equal(first)


def test_one_gpu_named_for_several_processes_is_one_line_before_any_process_group(monkeypatch):
    """Under torchrun `cuda` is each rank's own GPU; `cuda:0` would put every rank on one, which NCCL refuses later."""
    from assay.training.dist import Ranks

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(AssayError, match=r"model.device=cuda:0: with 2 processes each trains on its own GPU \(cuda:LOCAL_RANK\); give model.device=cuda"):
        Ranks.from_env(torch.device("cuda:0"))
    assert Ranks(1, 2, 1).device(torch.device("cuda")) == torch.device("cuda:1")


def test_the_micro_batch_budget_is_the_devices_unless_given():
    """`train.micro_batch_mb: null`: 256 MiB on a CPU; on a GPU an eighth of its memory (a pass there costs its launches
    whatever its size, so 256 MiB would cut a 0.5B model's 128-row batch into 128 passes)."""
    assert activation_budget_mb(None, "cpu") == 256.0 and activation_budget_mb(0, "cpu") == 0 and activation_budget_mb(64, "cuda") == 64
    if torch.cuda.is_available():
        assert activation_budget_mb(None, "cuda") == torch.cuda.get_device_properties(0).total_memory / 8 / 2**20


def test_to_cpu_walks_containers():
    state = {"a": [torch.ones(2), (torch.zeros(1), 3)], "b": {"c": torch.ones(1, requires_grad=True)}, "d": "x"}
    out = to_cpu(state)
    assert out["d"] == "x" and out["a"][1][1] == 3 and isinstance(out["a"][1], tuple)
    assert not out["b"]["c"].requires_grad


def test_a_device_this_machine_lacks_is_one_line():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(AssayError, match="sees no CUDA device") if not torch.cuda.is_available() else pytest.raises(AssayError):
        check_device("cuda:99")
    with pytest.raises(AssayError, match="not a torch device"):
        check_device("gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_every_command_refuses_a_device_this_machine_lacks_in_one_line(tmp_path):
    """A run or command given `cuda` (or `mps`) where torch sees none: one line, exit 2, no run folder, never torch's
    traceback from the first `.to(device)`."""
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n' * 8)
    out = tmp_path / "runs"
    commands = [("train", "model.device=mps", f"output_dir={out}"),
                ("rm", "train", f"data.path={pairs}", "device=cuda", f"output_dir={out}"),
                ("po", "train", f"data.path={pairs}", "device=cuda:1", f"output_dir={out}"),
                ("eval", "--model", "tiny-arith", "--device", "cuda", "--n", "2"),
                ("serve", "model", "tiny-arith", "--device", "cuda", "--port", "0")]
    for args in commands:
        p = subprocess.run([sys.executable, "-m", "assay", *args], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "Traceback" not in p.stderr, (args, p.stderr)
        assert p.stderr.strip().splitlines()[-1].startswith("assay: error: device '") and "sees no" in p.stderr, (args, p.stderr)
    assert not out.exists()


def test_rng_state_without_cuda_state_and_a_cuda_state_on_a_cpu_machine():
    state = rng_state()
    assert "sampler" not in state and ("cuda" in state) == (torch.cuda.is_available() and torch.cuda.is_initialized())
    before = torch.rand(3, device="cpu")
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 3  # written on a 3-GPU machine
    if not torch.cuda.is_available():
        torch.rand(3, device="cpu")
        set_rng_state(state)  # the CPU streams come back; the CUDA states have nowhere to go and are skipped
        assert torch.equal(torch.rand(3, device="cpu"), before)


@pytest.fixture(scope="module")
def model_tok():
    from assay.models import load_policy

    model, tok = load_policy("tiny-arith")
    return model.eval(), tok


def _prompts(n=12):
    from assay.data.tasks import make_task

    return make_task("arithmetic").heldout(n)


def test_the_gpu_loop_decodes_as_the_cpu_loop(model_tok):
    """A fixed batch read back every 16 steps (the GPU's loop) gives the CPU loop's greedy tokens and logprobs."""
    model, tok = model_tok
    cpu = TorchSampler(model, tok)
    gpu_like = TorchSampler(model, tok, compact_frac=0.0, check_every=16)
    params = SamplingParams(10, 0.0)
    a, b = cpu.generate(_prompts(), 2, params), gpu_like.generate(_prompts(), 2, params)
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b] and [t.finished for t in a] == [t.finished for t in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) < 1e-5
    assert any(len(t.completion_ids) < 10 for t in a)  # rows did finish early: the fixed batch carried them on as padding


def test_the_gpu_loop_records_what_the_learner_recomputes(model_tok):
    from assay.training.learner import collate, token_logprobs
    from assay.types import RewardResult

    model, tok = model_tok
    sampler = TorchSampler(model, tok, compact_frac=0.0, check_every=16)
    trajs = sampler.generate(_prompts(), 4, SamplingParams(10, 1.0), torch.Generator(device="cpu").manual_seed(0))
    batch = collate(trajs, [RewardResult(1.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lp, _ = token_logprobs(model, batch, 1.0)
    assert float(((lp - batch.old_logprobs).abs() * batch.mask).max()) < 5e-5


def test_a_step_run_again_before_it_is_recorded_writes_the_same_cache(model_tok):
    """CUDA-graph capture runs the first step three times (two warm-ups, the capture) before replaying it:
    `forward_token` must write the same keys, values and mask each time and leave the slot where it was."""
    from assay.rollout.decoder import StaticDecoder
    from assay.rollout.torch_sampler import _left_pad

    model, tok = model_tok
    ids, mask = _left_pad(TorchSampler(model, tok).encode(_prompts(4)), tok.pad_token_id)

    def first_step(warmups: int):
        dec = StaticDecoder(model)
        logits = dec.prefill(ids, mask, 2, 6).repeat_interleave(2, 0)
        tok_ = logits.argmax(-1)
        pos = mask.sum(-1, keepdim=True).repeat_interleave(2, 0)
        for _ in range(warmups):
            dec.forward_token(tok_, pos)
        slot = int(dec.slot)
        out = dec.step(tok_, pos)
        return out, torch.stack(dec.keys), torch.stack(dec.values), dec.bias.clone(), slot, int(dec.slot)

    once, thrice = first_step(0), first_step(3)
    for x, y in zip(once[:4], thrice[:4]):
        assert torch.equal(x, y)
    assert once[4] == thrice[4] == ids.shape[1] and once[5] == thrice[5] == ids.shape[1] + 1


def test_a_step_over_the_written_slots_is_the_recorded_step_over_the_whole_buffer(model_tok):
    """`StaticDecoder.step` attends over the cache slots written so far; a recorded step (`forward_token` without a
    span) over the whole buffer, its unwritten slots masked: the same logits and cache to rounding, the same mask."""
    from assay.rollout.decoder import StaticDecoder
    from assay.rollout.torch_sampler import _left_pad

    model, tok = model_tok
    ids, mask = _left_pad(TorchSampler(model, tok).encode(_prompts(4)), tok.pad_token_id)
    grown, whole = StaticDecoder(model), StaticDecoder(model)
    logits = grown.prefill(ids, mask, 2, 8).repeat_interleave(2, 0)
    whole.prefill(ids, mask, 2, 8)
    pos = mask.sum(-1, keepdim=True).repeat_interleave(2, 0)
    for _ in range(8):
        t = logits.argmax(-1)
        logits, full = grown.step(t, pos), whole.forward_token(t, pos)
        whole.slot += 1
        torch.testing.assert_close(logits, full, rtol=1e-5, atol=1e-5)  # sums over fewer slots round differently
        assert torch.equal(logits.argmax(-1), full.argmax(-1))
        pos = pos + 1
    assert grown.filled == ids.shape[1] + 8 == int(grown.slot)
    for a, b in zip(grown.keys + grown.values, whole.keys + whole.values):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(grown.bias, whole.bias)


def test_the_tests_run_without_pytest_xdist():
    """`scripts/gpu-check.sh` runs the gpu tests on a machine without pytest-xdist: the suite's conftest must load there."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--co", "-m", "gpu",
                          "tests/test_gpu.py"], capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 0 and "tests collected" in out.stdout, out.stdout + out.stderr


def test_python_dash_m_assay_runs_the_command():
    out = subprocess.run([sys.executable, "-m", "assay", "reward", "list"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "math" in out.stdout


def test_a_machine_with_its_own_torch_build_keeps_it(tmp_path):
    """`pip install -e .` on a GPU machine whose Python already has a CUDA build of torch (2.11+cu130 on the one tried)
    leaves that torch in place: pip, offline, resolves assay's declared requirements against an environment where that
    build comes first and would install nothing. An exact pin (`torch==2.13.0`) fails this: pip would replace it."""
    import json
    import os
    import tomllib

    root = Path(__file__).resolve().parent.parent
    requirements = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    info = tmp_path / "site" / "torch-2.11.0+cu130.dist-info"  # the metadata pip reads of an installed distribution
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.11.0+cu130\n")
    (info / "RECORD").write_text("")
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--disable-pip-version-check", "--quiet",
                          "--report", str(report), *requirements], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(tmp_path / "site")})
    assert out.returncode == 0, out.stdout + out.stderr
    would_install = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert "torch" not in would_install, would_install


@pytest.mark.slow
def test_a_compiled_step_decodes_as_the_eager_step_on_the_cpu(model_tok):
    """`rollout.compile`: the same greedy tokens and logprobs to rounding (Inductor's fused kernels round differently);
    the step and the draw are each compiled once, though the first step's inputs are views cut from the prompts' and
    the step attends over a span that grows."""
    from torch._dynamo.utils import counters

    model, tok = model_tok
    compiled, eager = TorchSampler(model, tok, compile=True), TorchSampler(model, tok)
    torch._dynamo.reset()
    frames = counters["frames"]["total"]
    compiled.generate(_prompts(), 2, SamplingParams(10, 1.0), torch.Generator().manual_seed(0))
    params = SamplingParams(10, 0.0)
    a, b = compiled.generate(_prompts(), 2, params), eager.generate(_prompts(), 2, params)
    assert counters["frames"]["total"] - frames == 2, "the decoding step or the draw was compiled more than once"
    assert compiled.compile and compiled.path == "static+compiled"
    assert [t.completion_ids for t in a] == [t.completion_ids for t in b]
    assert max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.logprobs, t.logprobs)) < 1e-4
