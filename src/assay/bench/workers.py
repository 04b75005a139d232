"""The child side of `assay bench train`: one framework, one process, timed step by step.

Run as `python -m assay.bench.workers SPEC.json`; SPEC names the framework (`assay` or
`trl`), the bench config, the model folder and where to write the result JSON. Each
framework runs in its own process so its peak resident memory is its own.

A result holds, for every step (warm-up included, in order): wall seconds, the completions
and their token counts, the distinct prompts' token counts, and the rows × positions the
model processed with and without grad.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from assay.bench.config import BenchConfig
from assay.bench.flops import TokenCounter, matmul_params


def _proc_status_mib(field: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:  # no /proc (not Linux)
        return None
    return None


def peak_rss_mib() -> float:
    """This process's peak resident memory, MiB.

    Linux: `VmHWM`, the high-water mark of this process's own address space; `ru_maxrss`
    can carry the parent's resident size across `exec`, so it is only the fallback.
    """
    hwm = _proc_status_mib("VmHWM")
    if hwm is not None:
        return hwm
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


def rss_mib() -> float | None:
    """This process's resident memory now, MiB (None where it cannot be read)."""
    now = _proc_status_mib("VmRSS")
    if now is not None:
        return now
    try:
        import psutil
    except ImportError:  # neither /proc nor psutil: unknown
        return None
    return psutil.Process().memory_info().rss / 2**20


def step_record(seconds: float, prompt_lens: list[int], completion_lens: list[int], tokens: dict[str, int]) -> dict[str, Any]:
    return {
        "s": seconds, "completions": len(completion_lens), "completion_tokens": sum(completion_lens),
        "prompt_lens": prompt_lens, "completion_lens": completion_lens,
        "nograd_tokens": tokens.get("nograd", 0), "grad_tokens": tokens.get("grad", 0),
    }


def train_samples(cfg: BenchConfig, n: int):
    """The first `n` training problems of the task, in the order assay's `PromptSource` hands them out."""
    from assay.data.tasks import make_task

    task = make_task(cfg.task, **cfg.task_args)
    return task, list(itertools.islice(task.stream("train", cfg.seed), n))


# -- assay ------------------------------------------------------------------------------
def assay_run_config(cfg: BenchConfig, model_dir: str, work_dir: str, threads: int):
    """The `RunConfig` of the bench's step shape: no reference model, one update, no eval, no checkpoints."""
    from assay.config import RunConfig

    return RunConfig.model_validate({
        "seed": cfg.seed, "output_dir": work_dir, "run_name": "assay", "reward_workers": cfg.reward_workers,
        "model": {"path": model_dir, "dtype": "float32"},
        "data": {"task": cfg.task, "task_args": cfg.task_args},
        "rollout": {"prompts_per_step": cfg.prompts_per_step, "group_size": cfg.group_size, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": 1.0},
        "algo": {"kl_coef": 0.0, "epochs": 1, "minibatches": 1},
        "optim": {"lr": cfg.lr, "warmup_steps": 0},
        "train": {"steps": cfg.warmup + cfg.steps, "eval_every": 0, "save_every": 0, "eval_n": 1, "threads": threads,
                  "skip_zero_advantage": False},  # the bench's random model scores 0 everywhere: every row would be skipped
    })


def run_assay(cfg: BenchConfig, model_dir: str, work_dir: str, threads: int) -> dict[str, Any]:
    """Time `Trainer.train_step()` alone; the sampler is wrapped only to read back what it drew."""
    from importlib.metadata import version

    import torch

    from assay.training.rl import Trainer

    trainer = Trainer(assay_run_config(cfg, model_dir, work_dir, threads))
    drawn: list[list] = []
    generate = trainer.sampler.generate

    def recording_generate(*args, **kwargs):
        trajs = generate(*args, **kwargs)
        drawn.append(trajs)
        return trajs

    trainer.sampler.generate = recording_generate
    counter = TokenCounter(trainer.model)
    rss_start, steps = rss_mib(), []
    for _ in range(cfg.warmup + cfg.steps):
        drawn.clear()
        counter.reset()
        t0 = time.perf_counter()
        trainer.train_step()
        seconds = time.perf_counter() - t0
        trajs = drawn[0]
        prompt_lens = [n for _, n in sorted({t.group: len(t.prompt_ids) for t in trajs}.items())]
        steps.append(step_record(seconds, prompt_lens, [len(t.completion_ids) for t in trajs], counter.reset()))
    trainer.executor.close()
    return {
        "framework": "assay", "version": version("assay"), "threads": torch.get_num_threads(), "n_params": matmul_params(trainer.model),
        "extra_forwards": int(trainer.ref is not None), "recompute_forwards": int(getattr(trainer.model, "is_gradient_checkpointing", False)), "rss_start_mib": rss_start, "peak_rss_mib": peak_rss_mib(), "steps": steps,
    }


# -- TRL --------------------------------------------------------------------------------
class RecordingReward:
    """TRL reward function: the task's verifier (through `to_trl`), recording what it was asked to score."""

    def __init__(self, reward_name: str, prompt_lens: dict[str, int], group_size: int):
        from assay.rewards.trl_adapter import to_trl

        self.inner = to_trl(reward_name, workers=0)
        self.__name__ = reward_name
        self.prompt_lens, self.group_size = prompt_lens, group_size
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, prompts=None, completions=None, completion_ids=None, **kwargs):
        groups = prompts[:: self.group_size]  # TRL's sampler repeats each prompt G times in a row
        self.calls.append(([self.prompt_lens[p] for p in groups], [len(ids) for ids in completion_ids]))
        return self.inner(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)


def trl_args(cfg: BenchConfig, work_dir: str, **overrides: Any):
    """`GRPOConfig` of the bench's step shape: B completions generated and one update per step, on the CPU in fp32.

    `overrides` go to the constructor (`use_cpu=False, bf16=True` for a GPU): its `__post_init__` fixes
    the device from them, so setting them on the built config afterwards would leave the run on the CPU.
    """
    from trl import GRPOConfig

    return GRPOConfig(**{
        "output_dir": str(Path(work_dir) / "trl"), "use_cpu": True, "bf16": False, "fp16": False, "seed": cfg.seed, "data_seed": cfg.seed,
        "per_device_train_batch_size": cfg.completions_per_step, "num_generations": cfg.group_size, "gradient_accumulation_steps": 1,
        "num_iterations": 1, "steps_per_generation": 1, "shuffle_dataset": False, "max_steps": cfg.warmup + cfg.steps,
        "max_completion_length": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": 1.0, "top_k": 0, "beta": 0.0, "epsilon": 0.2,
        "learning_rate": cfg.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "adam_beta1": 0.9, "adam_beta2": 0.99, "weight_decay": 0.0,
        "max_grad_norm": 1.0, "gradient_checkpointing": cfg.trl_gradient_checkpointing, "report_to": "none", "save_strategy": "no",
        "eval_strategy": "no", "logging_strategy": "no", "disable_tqdm": True, "log_completions": False, "dataloader_num_workers": 0,
        **overrides,
    })


def run_trl(cfg: BenchConfig, model_dir: str, work_dir: str, threads: int) -> dict[str, Any]:
    """Time `GRPOTrainer.train()` step by step, from one `on_step_end` to the next."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    n_steps = cfg.warmup + cfg.steps
    task, samples = train_samples(cfg, n_steps * cfg.prompts_per_step)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reward = RecordingReward(task.reward, {s.prompt: len(tok(text=s.prompt)["input_ids"]) for s in samples}, cfg.group_size)
    clock: dict[str, list] = {"begin": [], "end": [], "tokens": []}
    counter: TokenCounter | None = None

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            clock["end"].append(time.perf_counter())
            clock["tokens"].append(counter.reset())

    dataset = datasets.Dataset.from_list([{"prompt": s.prompt, "answer": s.answer} for s in samples])
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward], args=trl_args(cfg, work_dir), train_dataset=dataset, processing_class=tok, callbacks=[StepClock()])
    counter = TokenCounter(trainer.model)
    rss_start = rss_mib()
    trainer.train()
    if len(clock["end"]) != n_steps or len(reward.calls) != n_steps:
        raise RuntimeError(f"TRL ran {len(clock['end'])} steps and scored {len(reward.calls)} batches; expected {n_steps}")
    starts = [clock["begin"][0]] + clock["end"][:-1]
    steps = [step_record(e - s, p, c, t) for s, e, (p, c), t in zip(starts, clock["end"], reward.calls, clock["tokens"])]
    extra = int(trainer.beta != 0.0) + int(trainer.args.gradient_accumulation_steps % (trainer.args.steps_per_generation * trainer.num_iterations) != 0)
    return {
        "framework": "trl", "version": trl.__version__, "threads": torch.get_num_threads(), "n_params": matmul_params(trainer.model),
        "extra_forwards": extra, "recompute_forwards": int(getattr(trainer.model, "is_gradient_checkpointing", False)), "rss_start_mib": rss_start, "peak_rss_mib": peak_rss_mib(), "steps": steps,
    }


RUNNERS = {"assay": run_assay, "trl": run_trl}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    from assay.models import quiet_hf

    quiet_hf()
    cfg = BenchConfig.model_validate(spec["config"])
    result = RUNNERS[spec["framework"]](cfg, spec["model_dir"], spec["work_dir"], spec["threads"])
    Path(spec["out"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
