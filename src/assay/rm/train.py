"""`assay rm train`: a Bradley–Terry reward model on preference pairs, with checkpoints and exact resume.

The loop reads top to bottom: take the step's pairs (a function of the seed and the step),
score chosen and rejected responses in one forward, add the objective's terms
(`assay.rm.losses.rm_loss`), clip, step AdamW; every `eval_every` steps measure held-out
pairwise accuracy; every `save_every` steps write a checkpoint. The run folder mirrors
`assay train`'s: `config.yaml`, `metrics.jsonl`, `checkpoints/step_NNNNNN/` (the model in
Hugging Face format, `run.json`, `trainer_state.pt` with AdamW, the schedule and RNG state)
and `final/`, the reward model (`assay.rm.model`) that `reward: {name: rm, args: {path: RUN_DIR}}`
and `assay rm eval --path RUN_DIR` read.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from assay.devices import check_device
from assay.errors import AssayError
from assay.log import log
from assay.report.metrics import JsonlSink
from assay.report.run_report import write_report
from assay.rm.config import SAFE_ON_RESUME, RMConfig, validate
from assay.rm.data import Comparison, Pair, batch_indices, read_comparisons, split_by_prompt, to_pairs
from assay.rm.eval import evaluate_rm
from assay.rm.losses import rm_loss
from assay.models import resolve_model_path
from assay.models.lora import apply_lora, load_adapter
from assay.rm.model import Encoder, build_rm, encoder_for, forward_scores, save_rm
from assay.threads import ThreadGovernor
from assay.training.interrupt import Preempted, StopSignals
from assay.training.precision import MasterWeights, lr_schedule
from assay.training.checkpoint import clean_leftovers, load_state, prune_checkpoints, rng_state, save_checkpoint, set_rng_state
from assay.training.progress import RunProgress, _f
from assay.training.runs import RUN_FILE, RunFolderLock, clear_outputs, new_run_dir, restart_data, resumed_config, write_config


@dataclass
class RMResult:
    """What a finished run returns: its folder, the reward model's folder and the last metric row."""

    run_dir: Path
    model_dir: Path
    final: dict[str, Any]


class RMProgress(RunProgress):
    """The run's progress bar, showing loss and accuracy."""

    def update(self, step: int, m: dict[str, Any]) -> None:
        held = m.get("eval/pair_accuracy", m.get("eval/step_accuracy"))
        info = f"loss {_f(m.get('rm/loss'))}  acc {_f(m.get('rm/accuracy'))}  held-out {_f(held)}"
        self.progress.update(self.task, completed=step, info=info)


def _objective(cfg: RMConfig) -> tuple[Any, Any, Any]:
    """`(train_step, evaluate, encoder class)` of the config's `kind`: Bradley–Terry pairs, or step labels (`assay.rm.prm`)."""
    if cfg.kind == "prm":
        from assay.rm import prm

        return prm.train_step, prm.evaluate_prm, prm.StepEncoder
    return train_step, evaluate_rm, Encoder


def _encoder(cfg: RMConfig, tok, model):
    """What turns the run's items into model inputs: token ids (text, steps), or prompt ids and pictures (`kind=image`)."""
    if cfg.kind == "image":
        return encoder_for(tok, {"kind": "image", **_picture_shape(model)})
    return _objective(cfg)[2](tok, cfg.data.max_length)


def _picture_shape(model) -> dict[str, int]:
    """What a picture scorer reads, as `assay_rm.json` records it: prompt tokens and picture size."""
    return {"max_length": model.config.max_prompt_tokens, "sample_size": model.config.sample_size}


def load_steps(cfg: RMConfig) -> tuple[list, list]:
    """`kind=prm`: `(training rows, held-out rows)` of step-labelled data, split by prompt like pairs are."""
    from assay.rm.steps import read_step_rows

    rows = read_step_rows(cfg.data.path, cfg.data.step_separator)  # type: ignore[arg-type]
    if cfg.data.eval_path:
        heldout = read_step_rows(cfg.data.eval_path, cfg.data.step_separator)
        keys = {repr(r.prompt) for r in heldout}
        train = [r for r in rows if repr(r.prompt) not in keys]
        if len(train) < len(rows):
            log.warning(f"{cfg.data.path}: {len(rows) - len(train)} rows share a prompt with data.eval_path and are left out of training")
    else:
        train, heldout = split_by_prompt(rows, cfg.data.eval_fraction, cfg.seed)  # type: ignore[arg-type]
    if not train:
        raise AssayError(f"{cfg.data.path}: no training rows left after holding out {len(heldout)} rows (lower data.eval_fraction)")
    return train, heldout


def load_data(cfg: RMConfig) -> tuple[list[Pair], list[Comparison]]:
    """`(training pairs, held-out comparisons)` as the config says (step-labelled rows for `kind=prm`)."""
    if cfg.kind == "prm":
        return load_steps(cfg)
    comps = _comparisons(cfg, cfg.data.path)  # type: ignore[arg-type]
    if cfg.data.eval_path:
        heldout = _comparisons(cfg, cfg.data.eval_path)
        keys = {repr(c.prompt) for c in heldout}
        train = [c for c in comps if repr(c.prompt) not in keys]
        if len(train) < len(comps):
            log.warning(f"{cfg.data.path}: {len(comps) - len(train)} rows share a prompt with data.eval_path and are left out of training")
    else:
        train, heldout = split_by_prompt(comps, cfg.data.eval_fraction, cfg.seed)
    pairs = to_pairs(train)
    if not pairs:
        raise AssayError(f"{cfg.data.path}: no training pairs left after holding out {len(heldout)} rows (lower data.eval_fraction)")
    return pairs, heldout


def _comparisons(cfg: RMConfig, path: str) -> list[Comparison]:
    """The comparisons of `path`; for `kind=image` with their pictures decoded (paths read relative to the file)."""
    comps = read_comparisons(path, cfg.data.fields)
    if cfg.kind == "image":
        from assay.images.scorer import decode_comparisons

        decode_comparisons(comps, None, path)
    return comps


def resume_rm_config(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[RMConfig, Path]:
    """The config of a run folder's newest checkpoint plus the overrides allowed on resume, and that checkpoint."""
    data, ckpt = resumed_config(run_dir, overrides, SAFE_ON_RESUME)
    return validate(data), ckpt


def train_step(model, encoder: Encoder, pairs: list[Pair], cfg: RMConfig, weights, sched) -> dict[str, float]:
    """One optimizer step (`weights`: the run's `MasterWeights`) on `pairs`; returns its `rm/*` metrics."""
    device = next(model.parameters()).device
    items = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    inputs, lengths = encoder.inputs(items, device)  # {input_ids [2N, L], attention_mask [2N, L], ...}, [2N]
    scores = forward_scores(model, inputs)  # [2N]
    n = len(pairs)
    loss, metrics = rm_loss(scores[:n], scores[n:], lengths[:n].to(device), lengths[n:].to(device), margin=cfg.loss.margin,
                            center_coef=cfg.loss.center_coef, length_coef=cfg.loss.length_coef)
    weights.zero_grad()
    weights.backward(loss)
    metrics["rm/lr"] = weights.optimizer.param_groups[0]["lr"]
    metrics.update(weights.step_with_metrics(cfg.optim.grad_clip, "rm/"))
    sched.step()
    return metrics


def _run_step(step: int, steps: int, started: float, model, encoder: Encoder, pairs: list[Pair], heldout: list[Comparison], cfg: RMConfig,
              opt, sched, sink: JsonlSink, bar: RMProgress, last: dict[str, Any], governor: ThreadGovernor) -> bool:
    """Train step `step`, evaluate when due, log its row into `last` and the sink; True when it is the run's last step."""
    threads = governor.update()  # first, the cores other processes left free
    t0 = time.perf_counter()
    batch = [pairs[i] for i in batch_indices(len(pairs), cfg.train.batch_size, cfg.seed, step - 1)]
    step_fn, eval_fn, _ = _objective(cfg)
    last.clear()
    last.update(step_fn(model, encoder, batch, cfg, opt, sched))
    last["rm/step_seconds"] = time.perf_counter() - t0
    last["rm/threads"] = float(threads)
    last["rm/epoch"] = (step * cfg.train.batch_size) / len(pairs)
    out_of_time = bool(cfg.train.time_limit) and time.perf_counter() - started >= cfg.train.time_limit and step < steps
    end = step == steps or out_of_time
    if out_of_time:
        last["rm/stopped_early"] = 1.0
    every = cfg.train.eval_every
    if heldout and ((every and step % every == 0) or end):
        last.update(eval_fn(model, encoder, heldout))
    last["rm/elapsed_seconds"] = time.perf_counter() - started
    sink.log(step, last)
    bar.update(step, last)
    if out_of_time:
        bar.note(f"train.time_limit={cfg.train.time_limit:g}s reached: stopped after step {step} of {steps}")
    return end


def _build(cfg: RMConfig) -> tuple[Any, Any, Any]:
    """`(model, tokenizer, adapter)`: the reward model to train and, with `lora`, peft's wrapper of it (adapters and the score
    head train; checkpoints save the wrapper, `final/` the merged model), else None."""
    if cfg.kind == "image":
        from assay.images.scorer import build_scorer

        return (*build_scorer(cfg.model, seed=cfg.seed, device=cfg.device), None)
    model, tok = build_rm(cfg.model, seed=cfg.seed, dtype=cfg.dtype, device=cfg.device)
    if cfg.lora is None:
        return model, tok, None
    model, adapter = apply_lora(model, cfg.lora, str(resolve_model_path(cfg.model).resolve()), task="SEQ_CLS", seed=cfg.seed)
    return model, tok, adapter


def _restore(ckpt: Path, model, opt, sched, adapter=None) -> int:
    """Load a checkpoint's weights (a LoRA run's adapters and head into `adapter`), AdamW, schedule and RNG state; returns its step."""
    from safetensors.torch import load_file

    if adapter is not None:
        load_adapter(adapter, ckpt)
    else:
        model.load_state_dict(load_file(ckpt / "model.safetensors"))
    state = load_state(ckpt)
    opt.load_master(state.get("master_weights"))
    opt.optimizer.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


def _save(run_dir: Path, step: int, model, tok, opt, sched, cfg: RMConfig, sink: JsonlSink) -> None:
    sink.sync()
    state = {"step": step, "optimizer": opt.optimizer.state_dict(), "master_weights": opt.master_state(), "scheduler": sched.state_dict(),
             "rng": rng_state()}
    record = {"step": step, "config": cfg.model_dump(mode="json")}
    ckpt_dir = run_dir / "checkpoints"
    save_checkpoint(ckpt_dir / f"step_{step:06d}", model, tok, state, files={RUN_FILE: json.dumps(record, indent=1)})
    prune_checkpoints(ckpt_dir, cfg.train.keep_checkpoints, step)


def train_rm(cfg: RMConfig | None = None, *, resume: str | Path | None = None, restart: str | Path | None = None,
             overrides: list[str] | None = None, progress: bool = False) -> RMResult:
    """Train a reward model as `cfg` says, continue the run folder `resume` (with `overrides` from `SAFE_ON_RESUME`),
    or start the run in `restart`, one that stopped before its first checkpoint, again with its config and `overrides`."""
    started = time.perf_counter()
    ckpt = None
    if resume is not None:
        cfg, ckpt = resume_rm_config(resume, overrides)
        run_dir = Path(resume)
        lock = RunFolderLock(run_dir)  # held to the end (or until an error's traceback goes): one process trains in a folder
        clean_leftovers(run_dir / "checkpoints")
    elif restart is not None:
        cfg = validate(restart_data(restart, overrides))
        check_device(cfg.device)  # a device this machine lacks is one line before the folder is touched
        lock = RunFolderLock(restart)
        clear_outputs(restart)
        run_dir = new_run_dir(cfg, folder=restart)
        write_config(run_dir, cfg)
    else:
        if cfg is None:
            raise AssayError("train_rm: give a config or a run folder to resume")
        check_device(cfg.device)
        run_dir = new_run_dir(cfg, default_name=f"rm-{datetime.now():%Y%m%d-%H%M%S}")
        lock = RunFolderLock(run_dir)
        write_config(run_dir, cfg)
    governor = ThreadGovernor(cfg.train.threads)  # 0: the cores other processes leave free, re-read before every step
    pairs, heldout = load_data(cfg)
    model, tok, adapter = _build(cfg)
    saved_model = model if adapter is None else adapter
    _, eval_fn, _ = _objective(cfg)
    encoder = _encoder(cfg, tok, model)
    fused = cfg.optim.fused and next(model.parameters()).device.type in ("cpu", "cuda")
    opt = MasterWeights(model.parameters(), lambda ps: torch.optim.AdamW(  # fp32 masters for a bf16 model (assay.training.precision)
        ps, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay, fused=fused))
    sched = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, lr_schedule(cfg.optim, cfg.train.steps))
    start = _restore(ckpt, model, opt, sched, adapter) if ckpt is not None else 0
    sink = JsonlSink(run_dir / "metrics.jsonl", truncate_after=start if ckpt is not None else None)
    steps = cfg.train.steps
    if start >= steps:
        log.warning(f"{run_dir}: already trained {start} of {steps} steps; nothing to do (raise train.steps to go on)")
    if start == 0 and heldout:
        sink.log(0, eval_fn(model, encoder, heldout))
    model.train()
    last: dict[str, Any] = {}
    done, saved = start, start
    with RMProgress(steps, start, enabled=progress) as bar, StopSignals(notify=bar.note) as signals:
        try:
            for step in range(start + 1, steps + 1):
                with signals.critical():  # a step is short: a signal waits for it, then the run saves and stops
                    end = _run_step(step, steps, started, model, encoder, pairs, heldout, cfg, opt, sched, sink, bar, last, governor)
                    done = step
                    if (cfg.train.save_every and step % cfg.train.save_every == 0) or end:
                        _save(run_dir, step, saved_model, tok, opt, sched, cfg, sink)
                        saved = step
                signals.raise_pending()
                if end:
                    steps = step
                    break
        except (KeyboardInterrupt, Preempted) as e:
            if not signals.torn and saved != done:
                _save(run_dir, done, saved_model, tok, opt, sched, cfg, sink)
            e.run_dir, e.step = run_dir, done  # type: ignore[attr-defined]
            raise
        finally:
            sink.close()
    model.eval()
    if adapter is not None:  # one plain sequence classifier, what `rm eval` and the `rm` reward read
        model = adapter.merge_and_unload()
    final = run_dir / "final"
    meta = {"max_length": cfg.data.max_length, "base_model": cfg.model, "steps": steps, "heldout_rows": len(heldout), "kind": cfg.kind,
            "train_rows" if cfg.kind == "prm" else "train_pairs": len(pairs)}
    if cfg.kind in ("orm", "image"):
        meta["loss"] = cfg.loss.model_dump()
    if cfg.kind == "image":  # what the `rm` reward reads pictures and prompts with
        meta.update(_picture_shape(model))
    if cfg.kind == "prm":  # how the rows were cut, so the `prm` reward cuts completions the same way
        splits = {r.split for r in pairs}
        meta.update(step_separator=cfg.data.step_separator, split=splits.pop() if len(splits) == 1 else None)
    save_rm(final, model, tok, meta)
    summary = {"steps": steps, f"train {'rows' if cfg.kind == 'prm' else 'pairs'}": len(pairs), "held-out rows": len(heldout),
               **{k: v for k, v in last.items() if k.startswith("eval/")}, "reward model": str(final)}
    write_report(run_dir, cfg.model_dump(mode="json"), summary, report_plots(run_dir))
    lock.release()
    return RMResult(run_dir, final, last)


def report_plots(run_dir: Path) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """The run report's plots: training loss and batch accuracy; held-out pairwise accuracy, overall and per subset
    (for `kind=prm`: held-out step accuracy and first-error F1)."""
    from assay.report.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    if any("eval/step_accuracy" in r for r in rows):  # kind=prm
        return {"rm_loss.png": ("Training step BCE and batch step accuracy", [("rm/loss", "BCE"), ("rm/accuracy", "batch step accuracy")]),
                "heldout_step_accuracy.png": ("Held-out step accuracy and first-error F1",
                                              [("eval/step_accuracy", "step accuracy"), ("eval/first_error_f1", "first-error F1")])}
    subsets = sorted({k for r in rows for k in r if k.startswith("eval/pair_accuracy/")})
    return {
        "rm_loss.png": ("Training loss and batch accuracy", [("rm/loss", "loss"), ("rm/accuracy", "batch pairwise accuracy")]),
        "heldout_pair_accuracy.png": ("Held-out pairwise accuracy",
                                      [("eval/pair_accuracy", "all"), *((k, k.rsplit("/", 1)[1]) for k in subsets)]),
    }
