"""The GPU path, checked: a few GRPO steps per model size under assay+vLLM, assay+torch and TRL+vLLM.

Builds Qwen2-architecture models from a config with random weights (no hub access) and a
character tokenizer, then runs each framework in its own process on the same step shape
and prints, side by side: generation tokens/s, seconds per step and peak device memory
(on a GPU: the most memory in use on the device while the run lasted, every allocator
included, sampled every 50 ms, and torch's own peak; on a CPU: peak resident memory).

    python benchmarks/gpu_check.py                # on a CUDA GPU: 0.5B and ~100M models, bf16
    python benchmarks/gpu_check.py --tiny         # anywhere: tiny shapes in fp32 (CPU-tested)

`scripts/gpu-check.sh` sets up the engine venv and runs this under a time limit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: name → Qwen2 sizes; `qwen2-0.5b` is Qwen2-0.5B's shape (494M parameters with its 151,936-token vocabulary)
MODELS = {
    "qwen2-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864, vocab=151936),
    "qwen2-100m": dict(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000),
    "tiny-a": dict(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=128, vocab=512),
    "tiny-b": dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=512),
}
FRAMEWORKS = ("assay-vllm", "assay-torch", "trl-vllm")


def build_model(name: str, out: Path, dtype: str) -> int:
    """A random `name`-shaped Qwen2 with a character tokenizer of its vocabulary size, saved to `out`; its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from assay.models import ALPHABET, build_char_tokenizer

    size = MODELS[name]
    extra = "".join(chr(0x4E00 + i) for i in range(size["vocab"] - 4 - len(ALPHABET)))  # pad the alphabet to the vocabulary
    tok = build_char_tokenizer(ALPHABET + extra)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                         num_attention_heads=size["heads"], num_key_value_heads=size["kv_heads"], intermediate_size=size["intermediate"],
                         max_position_embeddings=1024, tie_word_embeddings=True, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, rope_theta=10000.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


class DeviceMemory:
    """Peak bytes in use on the CUDA device (every allocator: torch's, vLLM's), sampled every 50 ms."""

    def __init__(self):
        import torch

        self.peak, self._stop = 0, threading.Event()
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self):
        import torch

        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.05)

    def stop(self) -> dict[str, float]:
        import torch

        from assay.bench.workers import peak_rss_mib

        self._stop.set()
        if not self.cuda:
            return {"peak_rss_gib": peak_rss_mib() / 1024}
        return {"peak_device_gib": self.peak / 2**30, "peak_torch_gib": torch.cuda.max_memory_allocated() / 2**30}


def run_assay(spec: dict) -> dict:
    """`Trainer.learn(collect())` step by step with `rollout.backend` = spec's backend."""
    from assay.bench.config import BenchConfig
    from assay.bench.workers import assay_run_config
    from assay.training.rl import Trainer

    bench = BenchConfig(prompts_per_step=spec["prompts"], group_size=spec["group"], max_new_tokens=spec["max_new_tokens"],
                        steps=spec["steps"], warmup=1, reward_workers=0)
    cfg = assay_run_config(bench, spec["model_dir"], spec["work_dir"], 0)
    cfg.model.dtype, cfg.model.device = spec["dtype"], spec["device"]
    cfg.rollout.backend, cfg.algo.mismatch = spec["backend"], None
    cfg = type(cfg).model_validate(cfg.model_dump())  # algo.mismatch resolved for the backend (tis for vllm)
    memory = DeviceMemory()
    trainer = Trainer(cfg)
    steps = []
    for _ in range(bench.warmup + bench.steps):
        t0 = time.perf_counter()
        m = trainer.learn(trainer.collect())
        steps.append({"s": time.perf_counter() - t0, "generate_s": m["perf/generate_s"], "tokens": m["rollout/tokens"]})
    trainer.sampler.close()
    trainer.executor.close()
    return {"steps": steps[bench.warmup:], **memory.stop()}


def run_trl(spec: dict) -> dict:
    """TRL's `GRPOTrainer` with `use_vllm=True, vllm_mode="colocate"` on the same shape, timed per step and per generation."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from assay.bench.config import BenchConfig
    from assay.bench.workers import RecordingReward, train_samples, trl_args

    bench = BenchConfig(prompts_per_step=spec["prompts"], group_size=spec["group"], max_new_tokens=spec["max_new_tokens"],
                        steps=spec["steps"], warmup=1)
    task, samples = train_samples(bench, (bench.warmup + bench.steps) * bench.prompts_per_step)
    tok = AutoTokenizer.from_pretrained(spec["model_dir"])
    tok.padding_side = "left"
    memory = DeviceMemory()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=getattr(torch, spec["dtype"])).to(spec["device"])
    gpu = spec["device"].startswith("cuda")
    args = trl_args(bench, spec["work_dir"])  # the step shape of `assay bench train`; set after __post_init__, which derives batch sizes
    for key, value in dict(use_cpu=not gpu, bf16=spec["dtype"] == "bfloat16", use_vllm=True, vllm_mode="colocate",
                           vllm_gpu_memory_utilization=0.3, gradient_checkpointing=False).items():
        setattr(args, key, value)
    reward = RecordingReward(task.reward, {s.prompt: len(tok(text=s.prompt)["input_ids"]) for s in samples}, bench.group_size)
    clock: dict[str, list] = {"end": [], "gen": []}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clock["end"].append(time.perf_counter())

    dataset = datasets.Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in samples])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tok, callbacks=[StepClock()])
    generation = getattr(trainer, "vllm_generation", None)
    if generation is not None:  # time TRL's vLLM generation call itself
        inner = generation.generate

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = inner(*a, **kw)
            clock["gen"].append(time.perf_counter() - t0)
            return out

        generation.generate = timed
    t_start = time.perf_counter()
    trainer.train()
    starts = [t_start] + clock["end"][:-1]
    gens = clock["gen"] if len(clock["gen"]) == len(starts) else [None] * len(starts)
    steps = [{"s": e - s, "generate_s": g, "tokens": sum(c)} for s, e, g, (_, c) in zip(starts, clock["end"], gens, reward.calls)]
    return {"steps": steps[bench.warmup:], "trl": trl.__version__, **memory.stop()}


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = run_trl(spec) if spec["framework"] == "trl-vllm" else run_assay(spec)
    Path(spec["out"]).write_text(json.dumps(out))


def summarise(result: dict) -> dict:
    """Medians over the timed steps: s/step, generation tokens/s."""
    import statistics

    steps = result["steps"]
    gen = [s["tokens"] / s["generate_s"] for s in steps if s.get("generate_s")]
    return {"s_per_step": statistics.median(s["s"] for s in steps), "gen_tokens_per_s": statistics.median(gen) if gen else None,
            **{k: v for k, v in result.items() if k.startswith("peak_")}}


def run_one(framework: str, model: str, model_dir: Path, args, work: Path) -> dict:
    spec = {"framework": framework, "backend": framework.split("-")[1], "model_dir": str(model_dir), "work_dir": str(work / framework / model),
            "out": str(work / f"{framework}-{model}.json"), "dtype": args.dtype, "device": args.device, "prompts": args.prompts,
            "group": args.group, "max_new_tokens": args.max_new_tokens, "steps": args.steps}
    Path(spec["work_dir"]).mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{framework}-{model}.spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, "--worker", str(spec_path)], capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        where = [line.split("site-packages/")[-1].strip() for line in lines if "site-packages/trl/" in line]
        return {"error": (lines[-1] if lines else f"exit {proc.returncode}") + (f" (in {where[-1]})" if where else "")}
    return summarise(json.loads(Path(spec["out"]).read_text()))


def render(rows: list[dict]) -> None:
    mem = "peak device GiB" if any("peak_device_gib" in r for r in rows) else "peak RSS GiB"
    print(f"\n{'model':>12} {'params':>8} {'framework':>12} {'gen tokens/s':>13} {'s/step':>8} {mem:>16}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:>12} {r['params'] / 1e6:7.1f}M {r['framework']:>12}  failed: {r['error']}")
            continue
        gen = f"{r['gen_tokens_per_s']:.0f}" if r["gen_tokens_per_s"] else "—"
        peak = r.get("peak_device_gib", r.get("peak_rss_gib"))
        torch_peak = f" (torch {r['peak_torch_gib']:.1f})" if "peak_torch_gib" in r else ""
        print(f"{r['model']:>12} {r['params'] / 1e6:7.1f}M {r['framework']:>12} {gen:>13} {r['s_per_step']:8.2f} {peak:16.2f}{torch_peak}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny models in fp32 on the CPU (the check of the script itself)")
    p.add_argument("--models", default=None, help="comma-separated model names (default: qwen2-0.5b,qwen2-100m; tiny-a,tiny-b with --tiny)")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma-separated, from {', '.join(FRAMEWORKS)}")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 16; 4 with --tiny)")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion limit (default 256; 16 with --tiny)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    p.add_argument("--timeout", type=float, default=900, help="seconds one framework run may take (default 900)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker)
    args.device, args.dtype = ("cpu", "float32") if args.tiny else ("cuda", "bfloat16")
    args.prompts = args.prompts or (4 if args.tiny else 16)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 256)
    models = (args.models or ("tiny-a,tiny-b" if args.tiny else "qwen2-0.5b,qwen2-100m")).split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="assay-gpu-check-") as tmp:
        work = Path(tmp)
        for model in models:
            model_dir = work / model
            params = build_model(model, model_dir, args.dtype)
            for framework in args.frameworks.split(","):
                t0 = time.perf_counter()
                row = {"model": model, "params": params, "framework": framework, **run_one(framework, model, model_dir, args, work)}
                rows.append(row)
                print(f"  {model} {framework}: {time.perf_counter() - t0:.0f} s" + (f" (failed: {row['error']})" if "error" in row else ""),
                      flush=True)
    render(rows)


if __name__ == "__main__":
    main()
