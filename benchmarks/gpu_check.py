"""The GPU path, measured: decoding and GRPO steps of the torch backend against Hugging Face `generate` and TRL.

Builds Qwen2-architecture models from a config with random weights (no hub access) and a
character tokenizer padded to the model's vocabulary, then runs each framework in its own
process on the same shape (16 prompts × 8 completions × 256 new tokens by default):

- `assay-decode`: `TorchSampler.generate` alone — tokens/s, ms per token step, and the
  fraction of the decode roofline (`assay.bench.roofline`: weights and KV cache read per
  step over the device's bandwidth); `assay-decode-compiled` with `rollout.compile`;
- `hf-generate`: `model.generate(do_sample=True)` on the same prompts, the same figures;
- `assay-torch`: whole GRPO steps (`Trainer.learn(collect())`, `rollout.backend=torch`);
- `trl`: TRL's `GRPOTrainer` without vLLM (its generation is Hugging Face `generate`), its
  update in 4 gradient-accumulation passes (the whole batch in one pass does not fit an H100's
  memory at 0.5B without gradient checkpointing; assay splits by `train.micro_batch_mb`);
- `assay-vllm`, `trl-vllm`: the same with vLLM, where vLLM is installed.

Peak memory is torch's own peak on the device (and, on a CPU, the peak resident memory).
A framework that fails or runs past `--timeout` is reported as such; the others go on. Rows
run in order of what the figures are for — decoding against `generate`, then GRPO steps against
TRL, for each model; the compiled decoder and the vLLM rows last — so a short `--budget` loses
the least; each finished row is written to `--json` at once, and a row is not started with less
than `--min-row` seconds left.

    python benchmarks/gpu_check.py                 # on a CUDA GPU: 0.5B and ~100M models in bf16
    python benchmarks/gpu_check.py --tiny          # anywhere: tiny shapes in fp32 (how it is tested on a CPU)

`scripts/gpu-check.sh` runs this after the GPU tests and a main job, under one time limit.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: name → Qwen2 sizes; `qwen2-0.5b` is Qwen2-0.5B's shape (494M parameters with its 151,936-token vocabulary)
MODELS = {
    "qwen2-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "qwen2-100m": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000),
    "tiny-a": dict(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=128, vocab=512),
    "tiny-b": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512),
}
FRAMEWORKS = ("assay-decode", "assay-decode-compiled", "hf-generate", "assay-torch", "trl", "assay-vllm", "trl-vllm")
#: run after every model's other rows: the compiled decoder compiles for a minute, and vLLM is not on the GPU machine
LATE = ("assay-decode-compiled", "assay-vllm", "trl-vllm")
#: TRL's update in this many gradient-accumulation passes (see the module's docstring)
TRL_PASSES = 4


def padding_chars(n: int, start: int = 0x4E00) -> str:
    """`n` distinct characters from `start` on, skipping the surrogate code points U+D800–U+DFFF (no tokenizer takes them)."""
    out, cp = [], start
    while len(out) < n:
        if not 0xD800 <= cp <= 0xDFFF:
            out.append(chr(cp))
        cp += 1
    if cp > 0x10FFFF:
        raise ValueError(f"{n} padding characters do not fit in Unicode from U+{start:04X}")
    return "".join(out)


def build_model(name: str, out: Path, dtype: str) -> int:
    """A random `name`-shaped Qwen2 with a character tokenizer of its vocabulary size, saved to `out`; its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.models import ALPHABET, SPECIAL, build_char_tokenizer, quiet_hf

    quiet_hf()
    size = MODELS[name]
    tok = build_char_tokenizer(ALPHABET + padding_chars(size["vocab"] - len(SPECIAL) - len(ALPHABET)))
    assert len(tok) == size["vocab"], (len(tok), size["vocab"])
    config = Qwen2Config(vocab_size=len(tok), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], intermediate_size=size["intermediate"],
                         max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, rope_theta=10000.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def _sync(device) -> None:
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _memory(device) -> dict[str, float]:
    import torch

    from assay.bench.workers import peak_rss_mib

    if str(device).startswith("cuda"):
        return {"peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    return {"peak_gib": peak_rss_mib() / 1024}


def _prompts(spec: dict):
    from assay.bench.config import BenchConfig
    from assay.bench.workers import train_samples

    bench = BenchConfig(prompts_per_step=spec["prompts"], group_size=spec["group"], max_new_tokens=spec["max_new_tokens"])
    return train_samples(bench, spec["prompts"])[1]


def _roofline(model, spec: dict, prompt_len: float, steps: int, step_s: float) -> dict[str, float]:
    from assay.bench.roofline import decode_bytes_per_step, peak_bandwidth

    if not spec["device"].startswith("cuda"):
        return {}
    bw, source = peak_bandwidth(spec["device"])
    need = decode_bytes_per_step(model, spec["prompts"] * spec["group"], prompt_len, steps)
    return {"roofline_ms": need / bw * 1e3, "roofline_frac": need / bw / step_s, "bandwidth": source}


def run_decode(spec: dict, hf: bool, compile: bool = False) -> dict:
    """Time generation alone: `TorchSampler.generate` (or Hugging Face `generate`), one warm-up call, then `--repeats` timed calls."""
    import torch

    from assay.models import load_policy
    from assay.rollout.base import SamplingParams
    from assay.rollout.torch_sampler import TorchSampler

    model, tok = load_policy(spec["model_dir"], spec["device"], spec["dtype"])
    model.eval()
    samples = _prompts(spec)
    sampler = TorchSampler(model, tok, spec["device"], compile=compile)
    ids, mask = (t.to(spec["device"]) for t in _left_padded(sampler, samples))
    params = SamplingParams(spec["max_new_tokens"], 1.0)
    gen = torch.Generator(device="cpu").manual_seed(0)

    def once() -> tuple[float, int, int]:
        _sync(spec["device"])
        t0 = time.perf_counter()
        if hf:
            with torch.no_grad():
                out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                                     max_new_tokens=spec["max_new_tokens"], num_return_sequences=spec["group"], pad_token_id=tok.pad_token_id)
            _sync(spec["device"])
            new = out[:, ids.shape[1]:]
            lengths = [int((row != tok.pad_token_id).sum()) for row in new]
        else:
            trajs = sampler.generate(samples, spec["group"], params, gen)
            _sync(spec["device"])
            lengths = [len(t.completion_ids) for t in trajs]
        return time.perf_counter() - t0, sum(lengths), max(lengths)

    once()  # warm-up: kernels chosen, graphs captured, allocator settled
    runs = [once() for _ in range(spec["repeats"])]
    seconds = statistics.median(r[0] for r in runs)
    tokens, steps = runs[-1][1], runs[-1][2]
    prompt_len = float(mask.sum(-1).float().mean())
    step_s = seconds / max(steps, 1)
    memory = _memory(spec["device"])  # before the roofline, which may measure the bandwidth with buffers of its own
    return {"tokens_per_s": tokens / seconds, "step_ms": step_s * 1e3, "decode_steps": steps, "path": "hf-generate" if hf else sampler.path,
            **_roofline(model, spec, prompt_len, steps, step_s), **memory}


def _left_padded(sampler, samples):
    from assay.rollout.torch_sampler import _left_pad

    return _left_pad(sampler.encode(samples), sampler.pad_id)


def run_assay(spec: dict) -> dict:
    """`Trainer.learn(collect())` step by step with `rollout.backend` = spec's backend."""
    from assay.bench.config import BenchConfig
    from assay.bench.workers import assay_run_config
    from assay.training.rl import Trainer

    bench = BenchConfig(prompts_per_step=spec["prompts"], group_size=spec["group"], max_new_tokens=spec["max_new_tokens"],
                        steps=spec["steps"], warmup=1, reward_workers=0)
    cfg = assay_run_config(bench, spec["model_dir"], spec["work_dir"], 0)
    cfg.model.dtype, cfg.model.device = spec["dtype"], spec["device"]
    cfg.rollout.backend, cfg.algo.mismatch = spec["framework"].split("-")[1], None
    cfg = type(cfg).model_validate(cfg.model_dump())  # algo.mismatch resolved for the backend (tis for vllm)
    trainer = Trainer(cfg)
    steps = []
    for _ in range(bench.warmup + bench.steps):
        _sync(spec["device"])
        t0 = time.perf_counter()
        m = trainer.learn(trainer.collect())
        _sync(spec["device"])
        steps.append({"s": time.perf_counter() - t0, "generate_s": m["perf/generate_s"], "tokens": m["rollout/tokens"]})
    trainer.sampler.close()
    trainer.executor.close()
    return _summary(steps[bench.warmup:], spec)


def run_trl(spec: dict) -> dict:
    """TRL's `GRPOTrainer` on the same shape (with vLLM colocated for `trl-vllm`), timed per step and per generation."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from assay.bench.config import BenchConfig
    from assay.bench.workers import RecordingReward, train_samples, trl_args

    bench = BenchConfig(prompts_per_step=spec["prompts"], group_size=spec["group"], max_new_tokens=spec["max_new_tokens"],
                        steps=spec["steps"], warmup=1, trl_gradient_checkpointing=False)
    task, samples = train_samples(bench, (bench.warmup + bench.steps) * bench.prompts_per_step)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).to(spec["device"])
    vllm = spec["framework"] == "trl-vllm"
    passes = TRL_PASSES if bench.completions_per_step % (TRL_PASSES * bench.group_size) == 0 else 1
    args = trl_args(bench, spec["work_dir"], use_cpu=not spec["device"].startswith("cuda"), bf16=spec["dtype"] == "bfloat16",
                    use_vllm=vllm, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,  # the step shape of `assay bench train`,
                    per_device_train_batch_size=bench.completions_per_step // passes,  # one generation and one optimizer step
                    gradient_accumulation_steps=passes, steps_per_generation=passes)  # a step, its update in `passes` passes
    reward = RecordingReward(task.reward, {s.prompt: len(tok(text=s.prompt)["input_ids"]) for s in samples}, bench.group_size)
    clock: dict[str, list] = {"end": [], "gen": []}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            _sync(spec["device"])
            clock["end"].append(time.perf_counter())

    dataset = datasets.Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in samples])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tok, callbacks=[StepClock()])
    _time_generation(trainer, clock, vllm)
    t_start = time.perf_counter()
    trainer.train()
    starts = [t_start] + clock["end"][:-1]
    gens = clock["gen"] if len(clock["gen"]) == len(starts) else [None] * len(starts)
    steps = [{"s": e - s, "generate_s": g, "tokens": sum(c)} for s, e, g, (_, c) in zip(starts, clock["end"], gens, reward.calls)]
    return {**_summary(steps[bench.warmup:], spec), "trl": trl.__version__}


def _time_generation(trainer, clock: dict, vllm: bool) -> None:
    """Wrap TRL's generation call (its vLLM client, or the model's `generate`) to time it."""
    owner, name = (getattr(trainer, "vllm_generation", None), "generate") if vllm else (trainer.model, "generate")
    if owner is None or not hasattr(owner, name):
        return
    inner = getattr(owner, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        clock["gen"].append(time.perf_counter() - t0)
        return out

    setattr(owner, name, timed)


def _summary(steps: list[dict], spec: dict) -> dict:
    """Medians over the timed steps: s/step, generation tokens/s; peak memory."""
    gen = [s["tokens"] / s["generate_s"] for s in steps if s.get("generate_s")]
    return {"s_per_step": statistics.median(s["s"] for s in steps), "tokens_per_s": statistics.median(gen) if gen else None,
            **_memory(spec["device"])}


def worker(spec_path: str) -> None:
    import torch

    from assay.models import quiet_hf

    spec = json.loads(Path(spec_path).read_text())
    quiet_hf()
    if spec["device"] == "cpu":
        torch.set_num_threads(1)  # the CPU check of the script itself: one thread, whatever else the machine runs
    fw = spec["framework"]
    out = (run_decode(spec, hf=False, compile=fw.endswith("compiled")) if fw.startswith("assay-decode")
           else run_decode(spec, hf=True) if fw == "hf-generate" else run_trl(spec) if fw.startswith("trl") else run_assay(spec))
    Path(spec["out"]).write_text(json.dumps(out))


def run_one(framework: str, model: str, model_dir: Path, args, work: Path, timeout: float) -> dict:
    spec = {"framework": framework, "model_dir": str(model_dir), "work_dir": str(work / framework / model),
            "out": str(work / f"{framework}-{model}.json"), "dtype": args.dtype, "device": args.device, "prompts": args.prompts,
            "group": args.group, "max_new_tokens": args.max_new_tokens, "steps": args.steps, "repeats": args.repeats}
    Path(spec["work_dir"]).mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{framework}-{model}.spec.json"
    spec_path.write_text(json.dumps(spec))
    try:
        proc = subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        raised = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]  # a traceback's last line
        return {"error": f"exit {proc.returncode}: " + (raised or lines or ["no output"])[-1]}
    return json.loads(Path(spec["out"]).read_text())


def render(rows: list[dict]) -> str:
    head = (f"{'model':>11} {'params':>7} {'framework':>21} {'tokens/s':>9} {'ms/token step':>14} {'roofline':>9} {'s/step':>7} {'peak GiB':>9}"
            "  decoding path")
    lines = [head, "-" * len(head)]
    for r in rows:
        size = f"{r['params'] / 1e6:6.1f}M" if r.get("params") else f"{'—':>7}"
        name = f"{r['model']:>11} {size} {r['framework']:>21}"
        if "error" in r:
            lines.append(f"{name}  {'' if r['error'].startswith('skipped') else 'failed: '}{r['error']}")
            continue
        fmt = lambda key, f: (f.format(r[key]) if r.get(key) is not None else "—")  # noqa: E731
        lines.append(f"{name} {fmt('tokens_per_s', '{:.0f}'):>9} {fmt('step_ms', '{:.2f}'):>14} {fmt('roofline_frac', '{:.1%}'):>9} "
                     f"{fmt('s_per_step', '{:.2f}'):>7} {fmt('peak_gib', '{:.2f}'):>9}  {r.get('path', '')}")
    bw = sorted({r["bandwidth"] for r in rows if r.get("bandwidth")})
    if bw:
        lines.append(f"roofline: weights + KV cache read per token step over {', '.join(bw)} bandwidth")
    return "\n".join(lines)


def _vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny models in fp32 on the CPU (the check of the script itself)")
    p.add_argument("--models", default=None, help="comma-separated model names (default: qwen2-0.5b,qwen2-100m; tiny-a,tiny-b with --tiny)")
    p.add_argument("--frameworks", default=None, help=f"comma-separated, from {', '.join(FRAMEWORKS)} "
                   "(default: all; the vLLM ones where vLLM is installed; not the compiled one with --tiny, where compiling takes longest)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16; 4 with --tiny)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion limit (default 256; 16 with --tiny)")
    p.add_argument("--steps", type=int, default=2, help="timed GRPO steps after one warm-up step (default 2)")
    p.add_argument("--repeats", type=int, default=2, help="timed generation calls after one warm-up call (default 2)")
    p.add_argument("--timeout", type=float, default=240, help="seconds one framework run may take (default 240)")
    p.add_argument("--budget", type=float, default=None, help="seconds the whole benchmark may take; runs that would start past it are skipped")
    p.add_argument("--min-row", type=float, default=None, help="seconds a row needs to be started (default 60 on a GPU: a 0.5B worker "
                   "loads for ~20 s before it measures; 10 with --tiny)")
    p.add_argument("--json", default=None, help="also write the rows here, each as it finishes")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    started = time.perf_counter()
    args.device, args.dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    args.prompts = args.prompts or (4 if args.tiny else 16)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 256)
    args.min_row = args.min_row if args.min_row is not None else (10 if args.tiny else 60)
    models = (args.models or ("tiny-a,tiny-b" if args.tiny else "qwen2-0.5b,qwen2-100m")).split(",")
    default = [f for f in FRAMEWORKS if ("vllm" not in f or _vllm_installed()) and not (args.tiny and f.endswith("compiled"))]
    frameworks = args.frameworks.split(",") if args.frameworks else default
    order = [(m, f) for late in (False, True) for m in models for f in frameworks if (f in LATE) == late]
    rows: list[dict] = []
    params: dict[str, int] = {}

    def time_left() -> float:
        return args.timeout if args.budget is None else min(args.timeout, args.budget - (time.perf_counter() - started))

    with tempfile.TemporaryDirectory(prefix="assay-gpu-check-") as tmp:
        work = Path(tmp)
        for model, framework in order:
            if model not in params and time_left() >= args.min_row:
                params[model] = build_model(model, work / model, args.dtype)
            left = time_left()
            row = {"model": model, "params": params.get(model), "framework": framework}
            if left < args.min_row:
                rows.append({**row, "error": "skipped: out of time"})
            else:
                t0 = time.perf_counter()
                rows.append({**row, **run_one(framework, model, work / model, args, work, left)})
                print(f"  {model} {framework}: {time.perf_counter() - t0:.0f} s" + (f" ({rows[-1]['error']})" if "error" in rows[-1] else ""), flush=True)
            if args.json:  # as it goes: a run cut off keeps the rows it finished
                Path(args.json).write_text(json.dumps(rows, indent=1))
    print(render(rows))


if __name__ == "__main__":
    main()
