"""`assay po train`: offline preference training on a pair file, with checkpoints and exact resume.

The loop reads top to bottom, as `assay rm train`'s does: take the step's rows (a function
of the seed and the step), run the named loss over them (`assay.po.step.Objective`), clip,
step AdamW; every `eval_every` steps measure the held-out pairs (loss, implicit-reward
accuracy and margin) and, with `eval.task`, greedy accuracy on the task's held-out problems;
every `save_every` steps write a checkpoint. The reference's log-probabilities of every row
are computed once, before the first step, and kept in `RUN_DIR/reference.safetensors`: the
reference model is then let go, and a resumed run reads them back instead of recomputing.
The run folder mirrors `assay train`'s: `config.yaml`, `metrics.jsonl`, `checkpoints/`,
`report.html` and `final/`, the trained policy as a Hugging Face folder.
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
from assay.po.config import SAFE_ON_RESUME, POConfig, validate
from assay.po.data import PairText, encode, read_preferences
from assay.po.losses import loss_args
from assay.po.step import Objective
from assay.report.metrics import JsonlSink
from assay.report.run_report import write_report
from assay.rm.data import batch_indices, prompt_key, split_by_prompt
from assay.threads import ThreadGovernor
from assay.training.checkpoint import clean_leftovers, load_state, prune_checkpoints, rng_state, save_checkpoint, set_rng_state
from assay.training.interrupt import Preempted, StopSignals
from assay.training.precision import MasterWeights, lr_schedule
from assay.training.progress import RunProgress, _f
from assay.training.runs import RUN_FILE, RunFolderLock, clear_outputs, new_run_dir, restart_data, resumed_config, write_config

REFERENCE_FILE = "reference.safetensors"
PLOTS = {
    "po_loss.png": ("Training loss and implicit-reward accuracy", [("po/loss", "loss"), ("po/reward_accuracy", "batch reward accuracy")]),
    "po_heldout.png": ("Held-out", [("eval/accuracy", "greedy accuracy (task)"), ("eval/reward_accuracy", "pair reward accuracy")]),
}


@dataclass
class POResult:
    """What a finished run returns: its folder, the trained policy's folder and the last metric row."""

    run_dir: Path
    model_dir: Path
    final: dict[str, Any]


class POProgress(RunProgress):
    """The run's progress bar: loss, batch reward accuracy, held-out figures."""

    def update(self, step: int, m: dict[str, Any]) -> None:
        held = f"held-out acc {_f(m['eval/accuracy'])}" if "eval/accuracy" in m else f"held-out pairs {_f(m.get('eval/reward_accuracy'))}"
        info = f"loss {_f(m.get('po/loss'))}  reward acc {_f(m.get('po/reward_accuracy'))}  {held}"
        self.progress.update(self.task, completed=step, info=info)


def resume_po_config(run_dir: str | Path, overrides: list[str] | None = None) -> tuple[POConfig, Path]:
    """The config of a run folder's newest checkpoint plus the overrides allowed on resume, and that checkpoint."""
    data, ckpt = resumed_config(run_dir, overrides, SAFE_ON_RESUME)
    return validate(data), ckpt


def load_rows(cfg: POConfig, tokenizer, context: int | None) -> tuple[list, list]:
    """`(training rows, held-out rows)`, tokenised; a prompt goes wholly to one side."""
    items = read_preferences(cfg.data.path, cfg.data.fields)  # type: ignore[arg-type]
    if cfg.data.eval_path:
        heldout = read_preferences(cfg.data.eval_path, cfg.data.fields)
        keys = {prompt_key(h.prompt) for h in heldout}
        train = [it for it in items if prompt_key(it.prompt) not in keys]
        if len(train) < len(items):
            log.warning(f"{cfg.data.path}: {len(items) - len(train)} rows share a prompt with data.eval_path and are left out of training")
    else:
        train, heldout = split_by_prompt(items, cfg.data.eval_fraction, cfg.seed)  # type: ignore[arg-type]
    if not train:
        raise AssayError(f"{cfg.data.path}: no training rows left after holding out {len(heldout)} (lower data.eval_fraction)")
    if isinstance(train[0], PairText) != isinstance(heldout[0] if heldout else train[0], PairText):
        raise AssayError(f"{cfg.data.eval_path}: held-out rows must have the training file's layout (pairs, or completion and label)")
    limit = cfg.data.max_length or context or 1 << 30
    rows = encode(train, tokenizer, limit, str(cfg.data.path))
    held = encode(heldout, tokenizer, limit, str(cfg.data.eval_path or cfg.data.path)) if heldout else []
    return rows, held


def partners(rows: list) -> list:
    """Each row's partner for an unpaired loss's mismatched responses: the row before it (the first's, the last row)."""
    return rows[-1:] + rows[:-1]


def reference_values(run_dir: Path, cfg: POConfig, objective: Objective, model, rows: list, held: list) -> dict[str, torch.Tensor]:
    """`{"train": [R, k], "heldout": [H, k]}`: read from the run folder, else computed once with the reference and written there."""
    from safetensors.torch import load_file, save_file

    path = run_dir / REFERENCE_FILE
    want = {"train": (len(rows), objective.columns(rows) if objective.uses_ref else 0),
            "heldout": (len(held), objective.columns(held) if objective.uses_ref and held else 0)}
    if path.is_file():
        saved = load_file(path)
        if {k: tuple(v.shape) for k, v in saved.items()} != want:
            raise AssayError(f"{path}: the cached reference log-probabilities do not match the run's rows (was the data file changed?)")
        return saved
    t0 = time.perf_counter()
    ref_model = model
    if cfg.reference is not None and objective.uses_ref:
        from assay.models import load_policy

        ref_model, _ = load_policy(cfg.reference, cfg.device, cfg.dtype, cfg.chat_template)
    ref_model.eval()
    out = {"train": objective.reference(ref_model, rows, partners(rows)),
           "heldout": objective.reference(ref_model, held, partners(held)) if held else torch.zeros(0, 0, device="cpu")}
    out = {k: v.reshape(want[k]).contiguous() for k, v in out.items()}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(out, tmp)
    tmp.replace(path)
    if objective.uses_ref:
        log.info(f"reference log-probabilities of {len(rows)} + {len(held)} rows in {time.perf_counter() - t0:.1f}s -> {path}")
    return out


class HeldOut:
    """Held-out figures: the pairs' loss and reward accuracy, and greedy accuracy on `eval.task`'s held-out problems."""

    def __init__(self, cfg: POConfig, objective: Objective, model, tokenizer, rows: list, ref: torch.Tensor, device):
        self.objective, self.model, self.rows, self.ref = objective, model, rows, ref
        self.problems, self.sampler, self.verifier = [], None, None
        self.max_new_tokens = cfg.eval.max_new_tokens
        if cfg.eval.task:
            from assay.config import RolloutConfig
            from assay.data.tasks import make_task
            from assay.rewards.executor import RewardExecutor
            from assay.rewards.spec import build_reward
            from assay.rollout.base import make_sampler

            task = make_task(cfg.eval.task, **cfg.eval.task_args)
            self.problems = task.heldout(cfg.eval.n)
            self.verifier = RewardExecutor(build_reward(task.reward), workers=0)
            self.sampler = make_sampler("torch", model, tokenizer, RolloutConfig(), device)

    def __call__(self) -> dict[str, float]:
        out: dict[str, float] = {}
        was = self.model.training
        self.model.eval()
        if self.rows:
            with torch.no_grad():
                m = self.objective.step(self.model, self.rows, self.ref, partners(self.rows), backward=False, prefix="eval/", micro=64)
            out.update(m)
            out["eval/rows"] = float(len(self.rows))
        if self.sampler is not None:
            from assay.eval.policy import evaluate

            r = evaluate(self.sampler, self.verifier.score, self.problems, self.max_new_tokens)  # type: ignore[union-attr]
            out.update({"eval/accuracy": r.accuracy, "eval/mean_length": r.mean_length})
        self.model.train(was)
        return out

    def close(self) -> None:
        if self.verifier is not None:
            self.verifier.close()


def _restore(ckpt: Path, model, opt, sched) -> int:
    from assay.training.checkpoint import load_weights

    load_weights(model, ckpt)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    state = load_state(ckpt)
    opt.load_master(state.get("master_weights"))
    opt.optimizer.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return int(state["step"])


def _save(run_dir: Path, step: int, model, tok, opt, sched, cfg: POConfig, sink: JsonlSink) -> None:
    sink.sync()
    state = {"step": step, "optimizer": opt.optimizer.state_dict(), "master_weights": opt.master_state(), "scheduler": sched.state_dict(),
             "rng": rng_state()}
    ckpt_dir = run_dir / "checkpoints"
    save_checkpoint(ckpt_dir / f"step_{step:06d}", model, tok, state,
                    files={RUN_FILE: json.dumps({"step": step, "config": cfg.model_dump(mode="json")}, indent=1)})
    prune_checkpoints(ckpt_dir, cfg.train.keep_checkpoints, step)


def _folder(cfg: POConfig | None, resume, restart, overrides) -> tuple[POConfig, Path, Path | None, RunFolderLock]:
    """`(config, run folder, checkpoint to resume from, the folder's lock)` for a new, resumed or restarted run."""
    if resume is not None:
        cfg, ckpt = resume_po_config(resume, overrides)
        lock = RunFolderLock(resume)  # one process trains in a folder
        clean_leftovers(Path(resume) / "checkpoints")
        return cfg, Path(resume), ckpt, lock
    if restart is not None:
        cfg = validate(restart_data(restart, overrides))
        loss_args(cfg.loss, cfg.loss_args)
        check_device(cfg.device)  # a device this machine lacks is one line before the folder is touched
        lock = RunFolderLock(restart)
        clear_outputs(restart)
        run_dir = new_run_dir(cfg, folder=restart)
    else:
        if cfg is None:
            raise AssayError("train_po: give a config or a run folder to resume")
        loss_args(cfg.loss, cfg.loss_args)  # a bad loss or argument is one line before any folder is made
        check_device(cfg.device)
        run_dir = new_run_dir(cfg, default_name=f"po-{datetime.now():%Y%m%d-%H%M%S}")
        lock = RunFolderLock(run_dir)
    write_config(run_dir, cfg)
    return cfg, run_dir, None, lock


def train_po(cfg: POConfig | None = None, *, resume: str | Path | None = None, restart: str | Path | None = None,
             overrides: list[str] | None = None, progress: bool = False) -> POResult:
    """Train a policy on preference rows as `cfg` says, continue the run folder `resume` (with `overrides` from
    `SAFE_ON_RESUME`), or start the run in `restart`, one that stopped before its first checkpoint, again."""
    from assay.models import context_length, load_policy
    from assay.rollout.base import pad_id

    started = time.perf_counter()
    cfg, run_dir, ckpt, lock = _folder(cfg, resume, restart, overrides)  # held to the end (or until an error's traceback goes)
    governor = ThreadGovernor(cfg.train.threads)
    torch.manual_seed(cfg.seed)
    model, tok = load_policy(cfg.model, cfg.device, cfg.dtype, cfg.chat_template)
    device = next(model.parameters()).device
    objective = Objective(cfg.loss, cfg.loss_args, pad_id(tok), device, cfg.train.fast_forward, cfg.train.micro_batch)
    rows, held = load_rows(cfg, tok, context_length(model))
    objective.check_rows(rows, str(cfg.data.path))
    weights = MasterWeights(model.parameters(), lambda ps: torch.optim.AdamW(
        ps, lr=cfg.optim.lr, betas=cfg.optim.betas, weight_decay=cfg.optim.weight_decay, fused=cfg.optim.fused and device.type in ("cpu", "cuda")))
    sched = torch.optim.lr_scheduler.LambdaLR(weights.optimizer, lr_schedule(cfg.optim, cfg.train.steps))
    steps = cfg.train.steps
    governor.update()  # the reference pass, too, runs on the cores other processes leave free
    ref = reference_values(run_dir, cfg, objective, model, rows, held)  # before any weight changes
    start = _restore(ckpt, model, weights, sched) if ckpt is not None else 0
    heldout = HeldOut(cfg, objective, model, tok, held, ref["heldout"], device)
    sink = JsonlSink(run_dir / "metrics.jsonl", truncate_after=start if ckpt is not None else None)
    if start >= steps:
        log.warning(f"{run_dir}: already trained {start} of {steps} steps; nothing to do (raise train.steps to go on)")
    if start == 0:
        sink.log(0, heldout())
    model.train()
    last: dict[str, Any] = {}
    done, saved = start, start
    try:
        with POProgress(steps, start, enabled=progress) as bar, StopSignals(notify=bar.note) as signals:
            try:
                for step in range(start + 1, steps + 1):
                    with signals.critical():  # a step is short: a signal waits for it, then the run saves and stops
                        threads = governor.update()
                        t0 = time.perf_counter()
                        idx = batch_indices(len(rows), cfg.train.batch_size, cfg.seed, step - 1)
                        weights.zero_grad()
                        last.clear()
                        last.update(objective.step(model, [rows[i] for i in idx], ref["train"][idx], [rows[i - 1] for i in idx],
                                                                   loss_scale=weights.loss_scale))
                        last["po/lr"] = weights.optimizer.param_groups[0]["lr"]
                        last.update(weights.step_with_metrics(cfg.optim.grad_clip, "po/"))
                        sched.step()
                        last.update({"po/step_seconds": time.perf_counter() - t0, "po/threads": float(threads),
                                     "po/epoch": step * cfg.train.batch_size / len(rows)})
                        out_of_time = bool(cfg.train.time_limit) and time.perf_counter() - started >= cfg.train.time_limit and step < steps
                        end = step == steps or out_of_time
                        if out_of_time:
                            last["po/stopped_early"] = 1.0
                            bar.note(f"train.time_limit={cfg.train.time_limit:g}s reached: stopped after step {step} of {steps}")
                        if (cfg.train.eval_every and step % cfg.train.eval_every == 0) or end:
                            last.update(heldout())
                        last["po/elapsed_seconds"] = time.perf_counter() - started
                        sink.log(step, last)
                        bar.update(step, last)
                        done = step
                        if (cfg.train.save_every and step % cfg.train.save_every == 0) or end:
                            _save(run_dir, step, model, tok, weights, sched, cfg, sink)
                            saved = step
                    signals.raise_pending()
                    if end:
                        steps = step
                        break
            except (KeyboardInterrupt, Preempted) as e:
                if not signals.torn and saved != done:
                    _save(run_dir, done, model, tok, weights, sched, cfg, sink)
                e.run_dir, e.step = run_dir, done  # type: ignore[attr-defined]
                raise
    finally:
        sink.close()
        heldout.close()
    model.eval()
    result = _finish(run_dir, cfg, model, tok, steps, len(rows), len(held), last)
    lock.release()
    return result


def _finish(run_dir: Path, cfg: POConfig, model, tok, steps: int, n_rows: int, n_held: int, last: dict[str, Any]) -> POResult:
    """The report and `final/` (the policy, with a short model card)."""
    from assay.report.metrics import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    first = next((r.get("eval/accuracy") for r in rows if "eval/accuracy" in r), None)
    summary = {"steps": steps, "loss": cfg.loss, "train rows": n_rows, "held-out rows": n_held,
               **({"held-out accuracy at start": first} if first is not None else {}),
               **{k: v for k, v in last.items() if k.startswith("eval/")}, "model": str(run_dir / "final")}
    write_report(run_dir, cfg.model_dump(mode="json"), summary, PLOTS)
    card = (f"# {run_dir.name}\n\nTrained by `assay po train` from `{cfg.model}` with the `{cfg.loss}` preference loss "
            f"({json.dumps(cfg.loss_args)}) on `{cfg.data.path}`, {steps} steps of {cfg.train.batch_size} rows.\n\n"
            + "".join(f"- {k}: {v:.4g}\n" if isinstance(v, float) else f"- {k}: {v}\n" for k, v in summary.items()))
    save_checkpoint(run_dir / "final", model, tok, {"step": steps}, files={"README.md": card})
    return POResult(run_dir, run_dir / "final", last)
