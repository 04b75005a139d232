"""Training past one process (`assay.training.dist`): two gloo processes on this CPU, as `torchrun` starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def torchrun(*args: str, nproc: int = 2, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run --nproc-per-node N ARGS` on loopback, one thread per process."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


@pytest.mark.parametrize("aggregation,lora", [("token-mean", False), ("seq-mean-token-sum-norm", False), ("token-mean", True)])
def test_two_ranks_give_one_process_gradient(aggregation, lora):
    """Each rank trains on its share of the groups with the whole batch's denominator; FSDP2 sums the shards'
    gradients: the single process's gradient, to floating-point rounding (with LoRA: the adapters', the base frozen)."""
    if lora:
        pytest.importorskip("peft")
    p = torchrun(str(HERE / "_dist_grad.py"), aggregation, *(["lora"] if lora else []))
    assert p.returncode == 0, p.stderr[:1500] + "\n...\n" + p.stderr[-1500:]
    out = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert out["max_grad"] > 1e-5  # a real gradient
    assert out["max_diff"] <= 1e-5 * out["max_grad"] * 10, out  # 1e-5 of the largest entry (rounding of a different summation order)
    assert out["loss_sum"] == pytest.approx(out["loss_single"], abs=1e-6)


def test_a_sharded_critic_gives_one_process_gradient():
    """The learned critic of `gae` sharded over two ranks, each fitting its share of five groups (3 and 2) with the whole
    minibatch's denominator: the single process's values, loss, gradient norm and gradient, with half the weights a rank."""
    p = torchrun(str(HERE / "_dist_critic.py"))
    assert p.returncode == 0, p.stderr[:1500] + "\n...\n" + p.stderr[-1500:]
    out = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert out["max_grad"] > 1e-3 and out["max_diff"] <= 1e-5 * out["max_grad"] * 10, out
    single, sharded = out["single"], out["sharded"]
    assert sharded["critic/loss"] == pytest.approx(single["critic/loss"], rel=1e-5)
    assert sharded["critic/grad_norm"] == pytest.approx(single["critic/grad_norm"], rel=1e-5)
    assert sharded["critic/explained_variance"] == single["critic/explained_variance"]
    assert out["sharded_params"] < 0.6 * out["single_params"]


def test_an_engine_gets_the_sharded_policy_one_unit_at_a_time():
    """What a sharded policy streams to an inference engine: the single process's weights by name (a LoRA policy's merged),
    exactly, with no more than one FSDP2 unit (the root's own weights, or one decoder layer) whole at any time."""
    try:
        import peft  # noqa: F401
        lora = ["lora"]
    except ImportError:
        lora = []
    p = torchrun(str(HERE / "_dist_engine_weights.py"), *lora)
    assert p.returncode == 0, p.stderr[:1500] + "\n...\n" + p.stderr[-1500:]
    outs = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [o["lora"] for o in outs] == [False, *([True] if lora else [])]
    for out in outs:
        assert out["same_names"] and out["max_diff"] == 0.0 and out["units"] > 2
        assert out["most_whole_units"] == 1, out


def _assay(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "assay", *args], capture_output=True, text=True, timeout=timeout, cwd=HERE.parent,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def _rows(run_dir: Path) -> dict[int, dict]:
    from assay.report.metrics import read_metrics

    rows: dict[int, dict] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):  # a step's training row and its evaluation row, merged
        rows.setdefault(r["step"], {}).update({k: v for k, v in r.items() if not k.startswith("perf/") and not k.endswith("_per_s")})
    return rows


def _walls(run_dir: Path) -> list[float]:
    """`perf/wall_s` in the order the rows were written: it counts on over a resume, never from zero again."""
    from assay.report.metrics import read_metrics

    return [r["perf/wall_s"] for r in read_metrics(run_dir / "metrics.jsonl") if "perf/wall_s" in r]


COMMON = ("--no-progress", "train.eval_every=2", "train.eval_n=64", "train.save_every=2", "train.threads=1", "rollout.prompts_per_step=8")


@pytest.mark.slow
def test_checkpoints_move_between_world_sizes(tmp_path):
    """A run of two processes resumes in one, a run of one in two, and two in two exactly as if never stopped."""
    out = f"output_dir={tmp_path}"
    assert torchrun("-m", "assay", "train", *COMMON, out, "run_name=two", "train.steps=2").returncode == 0
    ckpt = tmp_path / "two" / "checkpoints" / "step_000002"
    assert (ckpt / "dcp").is_dir() and {p.name for p in ckpt.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    p = _assay("train", "--resume", str(tmp_path / "two"), "train.steps=4", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(_rows(tmp_path / "two")) == [0, 1, 2, 3, 4]
    assert _assay("train", *COMMON, out, "run_name=one", "train.steps=2").returncode == 0
    p = torchrun("-m", "assay", "train", "--resume", str(tmp_path / "one"), "train.steps=4", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(_rows(tmp_path / "one")) == [0, 1, 2, 3, 4] and (tmp_path / "one" / "final" / "model.safetensors").is_file()
    assert _walls(tmp_path / "one") == sorted(_walls(tmp_path / "one"))
    # two → two: the resumed run is the uninterrupted one, row for row
    assert torchrun("-m", "assay", "train", *COMMON, out, "run_name=whole", "train.steps=4").returncode == 0
    assert torchrun("-m", "assay", "train", *COMMON, out, "run_name=cut", "train.steps=2").returncode == 0
    assert torchrun("-m", "assay", "train", "--resume", str(tmp_path / "cut"), "train.steps=4", "--no-progress").returncode == 0
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "whole")
    assert _walls(tmp_path / "cut") == sorted(_walls(tmp_path / "cut")) and len(_walls(tmp_path / "cut")) > 4


@pytest.mark.slow
def test_two_processes_learn_like_one(tmp_path):
    """The bundled task, 30 steps, the same seed: two ranks raise held-out accuracy about as much as one process."""
    out, steps = f"output_dir={tmp_path}", ("train.steps=30", "train.eval_every=30", "train.eval_n=200", "train.threads=1", "--no-progress")
    one = _assay("train", out, "run_name=one", *steps)
    two = torchrun("-m", "assay", "train", out, "run_name=two", *steps)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    acc = {name: [r["eval/accuracy"] for r in _rows(tmp_path / name).values() if "eval/accuracy" in r] for name in ("one", "two")}
    gain = {name: a[-1] - a[0] for name, a in acc.items()}
    assert gain["two"] > 0.1 and abs(gain["two"] - gain["one"]) < 0.15, acc
    with open(tmp_path / "two" / "final" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen2ForCausalLM"]  # an ordinary Hugging Face folder, not FSDP's class


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_at_one_checkpoint(tmp_path):
    """A SIGTERM that reaches one rank only: both finish the step, save one checkpoint together, and resume from it."""
    import signal
    import time

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "assay", "train", *COMMON,
           f"output_dir={tmp_path}", "run_name=sig", "train.steps=400", "train.save_every=0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "sig" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.is_file() or metrics.read_text().count("\n") < 4):
        time.sleep(0.2)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGTERM)  # one rank only
    proc.communicate(timeout=300)
    ckpts = sorted((tmp_path / "sig" / "checkpoints").glob("step_*"))
    assert len(ckpts) == 1 and (ckpts[0] / "trainer_state.pt").is_file() and not list((tmp_path / "sig" / "checkpoints").glob(".tmp-*"))
    step = int(ckpts[0].name.split("_")[1])
    assert 2 < step < 400 and max(_rows(tmp_path / "sig")) == step  # no metric row past the checkpoint
    p = torchrun("-m", "assay", "train", "--resume", str(tmp_path / "sig"), f"train.steps={step + 2}", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert max(_rows(tmp_path / "sig")) == step + 2


@pytest.mark.slow
def test_lora_under_torchrun_checkpoints_the_adapters_and_moves_between_world_sizes(tmp_path):
    """`model.lora` with two ranks: a checkpoint holds the adapters and their AdamW state only, no frozen base weight;
    the run resumes in one process and again in two; `final/` is the adapter folder one process writes, trained."""
    pytest.importorskip("peft")
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    run, lora = tmp_path / "lora", ("model.lora={r: 8, alpha: 16}", "optim.lr=1e-2")
    p = torchrun("-m", "assay", "train", *COMMON, f"output_dir={tmp_path}", "run_name=lora", "train.steps=2", *lora)
    assert p.returncode == 0, p.stderr[-2000:]
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step_000002" / "dcp")).read_metadata().state_dict_metadata
    saved = [k for k in meta if k.startswith("model.")]
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), saved
    p = _assay("train", "--resume", str(run), "train.steps=4", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    p = torchrun("-m", "assay", "train", "--resume", str(run), "train.steps=6", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert sorted(_rows(run)) == [0, 1, 2, 3, 4, 5, 6]
    final = run / "final"
    assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
    b = [v for k, v in load_file(final / "adapter_model.safetensors").items() if "lora_B" in k]
    assert b and max(float(v.abs().max()) for v in b) > 0  # B starts at 0: these adapters trained
    p = _assay("eval", "--model", str(final), "--n", "16", "--workers", "0")
    assert p.returncode == 0, p.stderr[-2000:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(*args: str, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Two `torchrun` agents, one process each, meeting at a c10d rendezvous as two machines would: `RANK` 0 and 1, and
    `LOCAL_RANK` 0 on both (the difference from one machine with two processes)."""
    endpoint = f"127.0.0.1:{_free_port()}"
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "nodes",
                               "--max-restarts", "0", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=HERE.parent, env={**os.environ, "OMP_NUM_THREADS": "1"}) for node in (0, 1)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


@pytest.mark.slow
def test_two_machines_of_one_process_train_as_one_machine_of_two(tmp_path):
    """`torchrun --nnodes 2`: two agents (as on two machines sharing the output folder) train, checkpoint and resume,
    and give the same metrics row for row as `--nproc-per-node 2` on one machine; files are written once, by rank 0."""
    out = f"output_dir={tmp_path}"
    assert torchrun("-m", "assay", "train", *COMMON, out, "run_name=one-node", "train.steps=4").returncode == 0
    for p in _two_nodes("-m", "assay", "train", *COMMON, out, "run_name=two-nodes", "train.steps=2"):
        assert p.returncode == 0, p.stderr[-2000:]
    ckpt = tmp_path / "two-nodes" / "checkpoints" / "step_000002"
    assert {p.name for p in ckpt.glob("rng-rank*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    nodes = _two_nodes("-m", "assay", "train", "--resume", str(tmp_path / "two-nodes"), "train.steps=4", "--no-progress")
    for p in nodes:
        assert p.returncode == 0, p.stderr[-2000:]
    assert "steps: 4" in nodes[0].stderr and "run folder" not in nodes[1].stderr  # the summary comes from rank 0 alone
    assert _rows(tmp_path / "two-nodes") == _rows(tmp_path / "one-node")
    assert (tmp_path / "two-nodes" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_gae_run_shards_its_critic_and_moves_between_world_sizes(tmp_path):
    """`algo.advantage=gae` under torchrun: the critic's shards in `dcp-critic/` (no whole copy written by rank 0), and
    the run resumes in one process and a single-process run in two, the critic training throughout."""
    out, gae = f"output_dir={tmp_path}", "algo.advantage=gae"
    assert torchrun("-m", "assay", "train", *COMMON, out, gae, "run_name=two", "train.steps=2").returncode == 0
    ckpt = tmp_path / "two" / "checkpoints" / "step_000002"
    assert (ckpt / "dcp-critic").is_dir() and not (ckpt / "critic.safetensors").exists()
    p = _assay("train", "--resume", str(tmp_path / "two"), "train.steps=4", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    assert _assay("train", *COMMON, out, gae, "run_name=one", "train.steps=2").returncode == 0
    assert (tmp_path / "one" / "checkpoints" / "step_000002" / "critic.safetensors").is_file()
    p = torchrun("-m", "assay", "train", "--resume", str(tmp_path / "one"), "train.steps=4", "--no-progress")
    assert p.returncode == 0, p.stderr[-2000:]
    for run in ("two", "one"):
        rows = _rows(tmp_path / run)
        assert sorted(rows) == [0, 1, 2, 3, 4]
        assert all(r["critic/loss"] > 0 and "critic/explained_variance" in r for s, r in rows.items() if s > 0), run
    # two → two: the critic's shards come back exactly (its values decide the advantages, its metrics are logged)
    assert torchrun("-m", "assay", "train", *COMMON, out, gae, "run_name=whole", "train.steps=4").returncode == 0
    assert torchrun("-m", "assay", "train", *COMMON, out, gae, "run_name=cut", "train.steps=2").returncode == 0
    assert torchrun("-m", "assay", "train", "--resume", str(tmp_path / "cut"), "train.steps=4", "--no-progress").returncode == 0
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "whole")


def test_commands_that_run_in_one_process_are_refused_under_torchrun(tmp_path):
    """`assay rm train` under torchrun would train whole in every process, all writing one folder: one line, exit 2."""
    p = torchrun("-m", "assay", "rm", "train", "train.steps=2", f"output_dir={tmp_path}")
    assert p.returncode != 0
    assert "assay rm train runs in one process; run it without torchrun" in p.stderr
    assert not list(tmp_path.iterdir())


def test_float16_under_torchrun_is_refused_in_one_line(tmp_path):
    """FSDP2's mixed precision here is bf16's: fp16 weights would train as fp32 shards without a word."""
    p = torchrun("-m", "assay", "train", "--no-progress", "model.dtype=float16", "train.steps=1", f"output_dir={tmp_path}")
    assert p.returncode != 0
    assert "torchrun with 2 processes: model.dtype=float16 is not supported (sharded training casts to bf16 only" in p.stderr
    assert not list(tmp_path.iterdir())


def test_an_image_policy_under_torchrun_is_refused_in_one_line(tmp_path):
    """A picture generator trains in one process for now: under torchrun, one line saying so (not the sharded trainer's
    advice about language-model engines, which an image policy cannot use), and no run folder."""
    p = torchrun("-m", "assay", "train", "--no-progress", "model.path=tiny-shapes", "data.task=shapes", "train.steps=1",
                 f"output_dir={tmp_path}")
    assert p.returncode != 0
    assert "assay: error: several processes (torchrun): an image policy trains in one process" in p.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_torchrun_ranks_generate_their_shares_with_one_openai_server(tmp_path):
    """`rollout.backend=openai` under torchrun against `assay serve model` (a fixed server: no weight routes): both ranks
    send their shares to the one server, which returns token ids and the sampled tokens' logprobs; before the first update
    the learner scores the served tokens exactly as the server did."""
    sys.path.insert(0, str(HERE))
    from test_judge import Proc

    server = Proc([sys.executable, "-m", "assay.cli", "serve", "model", "tiny-arith", "--port", "0", "--max-new-tokens", "8"], "serving model")
    try:
        p = torchrun("-m", "assay", "train", *COMMON, f"output_dir={tmp_path}", "run_name=r", "train.steps=2", "rollout.backend=openai",
                     f"rollout.server_url={server.url}")
        health = server.get("/health")
    finally:
        assert server.stop() == 0
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _rows(tmp_path / "r")
    assert rows[1]["mismatch/abs_diff_mean"] < 1e-5 and rows[2]["engine/staleness"] == 2.0
    assert rows[0]["eval/accuracy"] > 0.2 and health["requests"] >= 2 * 8  # at least one request per prompt of each step


@pytest.mark.slow
def test_a_weight_push_that_fails_mid_run_stops_every_rank(tmp_path):
    """Under torchrun rank 0 alone pushes the weights; when the server fails a push in the middle of the run (the fourth
    `/pause`: the push after step 3's update), every rank stops at that step with the server's error, instead of the others
    waiting in a collective rank 0 never reaches (until the process group's 30-minute timeout)."""
    sys.path.insert(0, str(HERE))
    from test_judge import Proc

    model = Proc([sys.executable, "-m", "assay.cli", "serve", "model", "tiny-arith", "--port", "0", "--max-new-tokens", "8"], "serving model")
    routes = Proc([sys.executable, str(HERE / "_weight_routes.py"), model.url, "--fail-at-pause", "4"], "serving on")
    try:
        p = torchrun("-m", "assay", "train", *COMMON, f"output_dir={tmp_path}", "run_name=r", "train.steps=5", "rollout.backend=openai",
                     f"rollout.server_url={routes.url}", "rollout.weight_sync=push", "rollout.verify_sync=false",
                     "rollout.max_retries=0", timeout=300)
    finally:
        routes.stop()
        assert model.stop() == 0
    assert p.returncode != 0
    assert f"assay: error: server {routes.url}: POST /pause failed: HTTP 500" in p.stderr
    assert max(_rows(tmp_path / "r")) == 2  # steps 1 and 2 finished, step 3 did not
    assert (tmp_path / "r" / "checkpoints" / "step_000002").is_dir()  # and step 2's checkpoint stays


@pytest.mark.slow
def test_a_model_outside_the_llama_family_trains_under_torchrun_with_a_server(tmp_path):
    """A GPT-2 policy (no Llama-family decoder for the torch sampler) under torchrun with `rollout.backend=openai`: sharded
    block by block (`transformer.h`), trained, checkpointed, and `final/` an ordinary GPT-2 folder."""
    sys.path.insert(0, str(HERE))
    from test_judge import Proc
    from transformers import GPT2Config, GPT2LMHeadModel

    from assay.models import load_policy

    _, tok = load_policy("tiny-arith")
    folder = tmp_path / "gpt2"
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=tok.eos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    server = Proc([sys.executable, "-m", "assay.cli", "serve", "model", str(folder), "--port", "0", "--max-new-tokens", "8"], "serving model")
    try:
        p = torchrun("-m", "assay", "train", *COMMON, f"output_dir={tmp_path}", "run_name=r", "train.steps=2", f"model.path={folder}",
                     "rollout.backend=openai", f"rollout.server_url={server.url}", "rollout.max_new_tokens=6",
                     "reward={name: random, args: {p: 0.5}}")  # an untrained model answers nothing right: a reward with spread
    finally:
        assert server.stop() == 0
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _rows(tmp_path / "r")
    assert rows[2]["actor/grad_norm"] > 0 and rows[1]["mismatch/abs_diff_mean"] < 1e-5
    assert (tmp_path / "r" / "checkpoints" / "step_000002" / "dcp").is_dir()
    with open(tmp_path / "r" / "final" / "config.json") as f:
        assert json.load(f)["architectures"] == ["GPT2LMHeadModel"]
