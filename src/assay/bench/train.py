"""`assay bench train`: one GRPO step shape under TRL's `GRPOTrainer` and under assay's trainer, side by side.

Builds (or loads) one model, runs the same configuration in each framework in its own
subprocess (`assay.bench.workers`), one after the other, and reports seconds per step,
completions/s, generated tokens/s, peak resident memory, the assay/TRL ratios, and the
compute-bound limit of the step at this machine's measured fp32 matmul rate
(`assay.bench.flops`). Left out on purpose: running frameworks concurrently, GPUs,
other TRL generation backends (vLLM, continuous batching).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from assay.bench.config import BenchConfig
from assay.bench.flops import executed_flops, ideal_step_flops, matmul_rate
from assay.errors import AssayError

FRAMEWORKS = {"trl": "TRL GRPOTrainer", "assay": "assay Trainer"}
#: other processes' average load (cores) above which the figures are flagged as not clean
LOAD_WARNING = 0.2
FORMULA_LINES = (
    "FLOPs/step = 2N·(Σ distinct prompt tokens + Σ generated tokens)   generation, prompts prefilled once",
    "           + 6N·Σ (prompt + completion tokens)                    one forward and backward",
    "           + 2N·F·Σ (prompt + completion tokens)                  F extra forward passes (0 here)",
    "N = matmul parameters; padding and attention scores not counted; limit = FLOPs / matmul rate",
)
FORMULA = (
    "FLOPs/step = 2N·(Σ distinct prompt tokens + Σ generated tokens) + 6N·Σ (prompt + completion tokens)"
    " + 2N·F·Σ (prompt + completion tokens); N = matmul parameters, F = extra forward passes"
    " (0 here: no reference model, the update is on-policy); no padding, attention scores left out"
)


def available_threads() -> int:
    """Cores this process may run on (its affinity mask, so `taskset -c 0` gives 1)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require_trl() -> None:
    missing = [m for m in ("trl", "accelerate") if not installed(m)]
    if missing:
        raise AssayError(f"--vs trl needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not installed: pip install -e .[bench]")


def prepare_model(cfg: BenchConfig, work: Path) -> tuple[str, str]:
    """The model folder both frameworks load, and a one-line description of it."""
    from assay.models import build_char_tokenizer, build_tiny_model, quiet_hf, resolve_model_path

    if cfg.model.path:
        return str(resolve_model_path(cfg.model.path)), cfg.model.path
    quiet_hf()
    m = cfg.model
    folder = work / "model"
    tok = build_char_tokenizer()
    build_tiny_model(tok, hidden=m.hidden, layers=m.layers, heads=m.heads, intermediate=m.intermediate, seed=m.seed).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder), f"random Qwen2, hidden {m.hidden}, {m.layers} layers, {m.heads} heads, intermediate {m.intermediate}"


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (Linux `/proc/stat`; None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def profiler_command(profile_dir: Path | None, name: str) -> list[str]:
    """`py-spy record` in front of the worker command when profiling, else nothing."""
    if profile_dir is None:
        return []
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).is_file():
        raise AssayError("--profile needs py-spy, which is not installed: pip install -e .[bench]")
    profile_dir.mkdir(parents=True, exist_ok=True)
    return [spy, "record", "--format", "raw", "--rate", "100", "--nonblocking", "-o", str(profile_dir / f"{name}.txt"), "--"]


def run_worker(name: str, cfg: BenchConfig, model_dir: str, work: Path, threads: int, profile_dir: Path | None = None,
               env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one framework in a fresh Python process and return its result (`threads=0`: assay's own choice, `train.threads=0`)."""
    spec = {"framework": name, "config": cfg.model_dump(mode="json"), "model_dir": model_dir, "work_dir": str(work / name),
            "threads": threads, "out": str(work / f"{name}.json")}
    spec_path = work / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    omp = str(threads or available_threads())
    env = {**os.environ, "OMP_NUM_THREADS": omp, "MKL_NUM_THREADS": omp, "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1", **(env_extra or {})}
    log = work / f"{name}.log"
    cmd = [*profiler_command(profile_dir, name), sys.executable, "-m", "assay.bench.workers", str(spec_path)]
    busy0, own0, t0 = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    busy1, own1, wall = busy_cpu_seconds(), children_cpu_seconds(), time.perf_counter() - t0
    out = Path(spec["out"])
    if rc != 0 or not out.is_file():
        lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
        raise AssayError(f"the {FRAMEWORKS[name]} run failed (exit {rc}): {lines[-1] if lines else 'no output'}; full log: {log}")
    result = json.loads(out.read_text())
    # cores kept busy by anything else while this run lasted: a clean figure needs about 0
    result["other_load_cores"] = None if busy0 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall
    return result


def summarise(result: dict[str, Any], cfg: BenchConfig, gflops: float) -> dict[str, Any]:
    """The reported figures of one framework's run (measured steps only; warm-up reported apart)."""
    warm, measured = result["steps"][: cfg.warmup], result["steps"][cfg.warmup :]
    n, total_s = result["n_params"], sum(s["s"] for s in measured)
    mean = lambda xs: sum(xs) / len(xs)
    ideal = mean([ideal_step_flops(n, s["prompt_lens"], s["completion_lens"], cfg.group_size, result["extra_forwards"])["total"] for s in measured])
    executed = mean([executed_flops(n, s["nograd_tokens"], s["grad_tokens"], result["recompute_forwards"]) for s in measured])
    completions = sum(s["completions"] for s in measured)
    limit_s = ideal / (gflops * 1e9)
    return {
        "version": result["version"], "threads": result["threads"], "steps_measured": len(measured),
        "warmup_s": [s["s"] for s in warm], "s_per_step_mean": total_s / len(measured), "s_per_step_min": min(s["s"] for s in measured),
        "completions_per_step": completions / len(measured), "completions_per_s": completions / total_s,
        "generated_tokens_per_s": sum(s["completion_tokens"] for s in measured) / total_s,
        "mean_completion_tokens": sum(s["completion_tokens"] for s in measured) / completions,
        "peak_rss_mib": result["peak_rss_mib"], "rss_before_steps_mib": result["rss_start_mib"],
        "ideal_gflop_per_step": ideal / 1e9, "limit_s_per_step": limit_s, "limit_completions_per_s": mean([s["completions"] for s in measured]) / limit_s,
        "fraction_of_limit": limit_s / (total_s / len(measured)),
        "model_tokens_per_step": {"nograd": mean([s["nograd_tokens"] for s in measured]), "grad": mean([s["grad_tokens"] for s in measured])},
        "executed_gflop_per_step": executed / 1e9, "executed_gflops_per_s": executed / 1e9 / (total_s / len(measured)),
        "other_load_cores": result.get("other_load_cores"), "extra_forwards": result["extra_forwards"], "gradient_checkpointing": bool(result["recompute_forwards"]), "n_params": n, "steps": result["steps"],
    }


def machine_info(threads: int) -> dict[str, Any]:
    import torch
    import transformers

    return {"cpus": os.cpu_count(), "cpus_available": available_threads(), "threads": threads, "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def run_bench(cfg: BenchConfig, vs: str = "trl", profile_dir: str | None = None) -> dict[str, Any]:
    """Run the benchmark and return every figure (see `render` for the printed form)."""
    import torch

    if vs == "trl":
        require_trl()
    if cfg.model.path:
        from assay.models import resolve_model_path

        resolve_model_path(cfg.model.path)  # a bad path fails here, in one line, before any work
    threads, started = cfg.threads or available_threads(), datetime.now()
    work = Path(tempfile.mkdtemp(prefix="assay-bench-"))
    model_dir, model_desc = prepare_model(cfg, work)
    names = (["trl"] if vs == "trl" else []) + ["assay"]
    torch.set_num_threads(threads)
    before = matmul_rate(tuple(cfg.matmul_sizes))
    results = {name: run_worker(name, cfg, model_dir, work, threads, Path(profile_dir) if profile_dir else None) for name in names}
    after = matmul_rate(tuple(cfg.matmul_sizes))
    # timed before and after the runs, the faster is the machine's rate (other load only slows it)
    rate = {**max(before, after, key=lambda r: r["gflops"]), "gflops_before_after": [before["gflops"], after["gflops"]]}
    shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "date": started.isoformat(timespec="seconds"), "machine": machine_info(threads), "config": cfg.model_dump(mode="json"),
        "model": {"source": model_desc, "n_params": results["assay"]["n_params"]}, "matmul": rate, "formula": FORMULA,
        "frameworks": {name: summarise(r, cfg, rate["gflops"]) for name, r in results.items()},
    }
    fw = report["frameworks"]
    if "trl" in fw:
        report["ratio_assay_over_trl"] = {
            "completions_per_s": fw["assay"]["completions_per_s"] / fw["trl"]["completions_per_s"],
            "peak_rss": fw["assay"]["peak_rss_mib"] / fw["trl"]["peak_rss_mib"],
        }
    if profile_dir:
        from assay.bench.profile import STEP_ROOTS, top_frames

        paths = {name: Path(profile_dir) / f"{name}.txt" for name in names}
        report["profiles"] = {name: {"path": str(p), "top_self": top_frames(p, STEP_ROOTS[name], 10, by="self")} for name, p in paths.items()}
    return report


def render(report: dict[str, Any], file=None) -> None:
    """Print the report as a table and a few lines (rich)."""
    from rich.console import Console
    from rich.table import Table

    con = Console(file=file or sys.stdout, width=100, highlight=False)
    cfg, fw = report["config"], report["frameworks"]
    con.print(f"assay bench train · {report['date']} · {report['machine']['processor']}, {report['machine']['threads']} torch thread(s)")
    con.print(f"model: {report['model']['source']}; N = {report['model']['n_params'] / 1e6:.3g}M matmul parameters")
    con.print(f"step: {cfg['prompts_per_step']} prompts × {cfg['group_size']} generations = {cfg['prompts_per_step'] * cfg['group_size']} completions, "
              f"≤ {cfg['max_new_tokens']} new tokens, temperature {cfg['temperature']}")
    con.print(f"      no reference model, one optimizer update, fp32; {cfg['warmup']} warm-up + {cfg['steps']} timed steps")
    table = Table(show_edge=False)
    table.add_column("")
    for name, s in fw.items():
        table.add_column(f"{FRAMEWORKS[name]} {s['version']}", justify="right")
    rows = [
        ("s/step (mean)", "s_per_step_mean", "{:.3f}"), ("s/step (min)", "s_per_step_min", "{:.3f}"),
        ("completions/step", "completions_per_step", "{:.0f}"), ("completions/s", "completions_per_s", "{:.1f}"),
        ("generated tokens/s", "generated_tokens_per_s", "{:.0f}"), ("mean completion tokens", "mean_completion_tokens", "{:.1f}"),
        ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}"), ("RSS before step 1 (MiB)", "rss_before_steps_mib", "{:.0f}"),
        ("ideal GFLOP/step (formula)", "ideal_gflop_per_step", "{:.3g}"), ("executed GFLOP/step", "executed_gflop_per_step", "{:.3g}"),
        ("executed GFLOP/s", "executed_gflops_per_s", "{:.3g}"), ("limit s/step", "limit_s_per_step", "{:.3g}"),
        ("share of limit", "fraction_of_limit", "{:.1%}"),
    ]
    for label, key, spec in rows:
        table.add_row(label, *("–" if s[key] is None else spec.format(s[key]) for s in fw.values()))
    table.add_row("torch threads", *(str(s["threads"]) for s in fw.values()))
    table.add_row("other load (cores)", *("–" if s["other_load_cores"] is None else f"{s['other_load_cores']:.2f}" for s in fw.values()))
    table.add_row("gradient checkpointing", *("on" if s["gradient_checkpointing"] else "off" for s in fw.values()))
    table.add_row("model tokens/step no-grad / grad", *(f"{s['model_tokens_per_step']['nograd']:.0f} / {s['model_tokens_per_step']['grad']:.0f}" for s in fw.values()))
    con.print(table)
    busy = [FRAMEWORKS[n] for n, s in fw.items() if (s["other_load_cores"] or 0) > LOAD_WARNING]
    if busy:
        con.print(f"[bold]warning:[/bold] other processes used > {LOAD_WARNING} core during the {' and '.join(busy)} run: figures not clean")
    if "ratio_assay_over_trl" in report:
        r = report["ratio_assay_over_trl"]
        con.print(f"assay / TRL: completions/s {r['completions_per_s']:.2f}×, peak RSS {r['peak_rss']:.2f}×")
    m, a = report["matmul"], fw["assay"]
    sizes = ", ".join(f"{n}²: {g:.0f}" for n, g in m["per_size_gflops"].items())
    ba = " and ".join(f"{g:.0f}" for g in m["gflops_before_after"])
    con.print(f"matmul: {m['gflops']:.1f} GFLOP/s fp32, {m['threads']} thread(s); best of sizes {sizes} GFLOP/s")
    con.print(f"        timed before and after the runs: {ba} GFLOP/s, the faster is used")
    for line in FORMULA_LINES:
        con.print(line)
    con.print(f"compute-bound limit (assay's tokens): {a['ideal_gflop_per_step']:.3g} GFLOP/step → {a['limit_s_per_step']:.3g} s/step, "
              f"{a['limit_completions_per_s']:.0f} completions/s")
    con.print(f"assay reaches {a['fraction_of_limit']:.1%} of the compute-bound limit")
    for name, prof in report.get("profiles", {}).items():
        con.print(f"py-spy profile of {FRAMEWORKS[name]}: {prof['path']}; inside the step, by own samples (inclusive share in brackets):")
        for frame, inclusive, own in prof["top_self"]:
            con.print(f"  {own:6.1%}  ({inclusive:6.1%})  {frame}")


def check_json_path(path: str) -> Path:
    """The `--json` output path, refused before the run when its folder does not exist."""
    p = Path(path)
    if not p.parent.is_dir():
        raise AssayError(f"--json: folder {str(p.parent)!r} does not exist")
    return p


def write_json(report: dict[str, Any], path: str) -> None:
    check_json_path(path).write_text(json.dumps(report, indent=2) + "\n")
