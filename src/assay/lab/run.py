"""Train an experiment's arms, then its plot (`lab.png`), `summary.json` and page (`index.html`)."""

from __future__ import annotations

import base64
import html
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from assay.errors import AssayError
from assay.lab.experiments import EXPERIMENTS, Claim, Experiment
from assay.training.hacking import HELD_OUT_KEYS


def run_lab(name: str, out: str | Path = "runs/lab", steps: int | None = None, seed: int = 0, progress: bool = True,
            log: Callable[[str], None] = lambda s: print(s, file=sys.stderr), arms: Sequence[str] | None = None) -> Path:
    """Train every arm of experiment `name` into `out/name/ARM/` and write its plot, summary and page; the page's path.

    `steps` replaces the experiment's own budget (a shorter run for a quick look or a test); `arms` trains only
    those (the claims, which compare arms, are then not judged). An arm's folder is replaced, so a rerun never mixes in
    an older run's rows.
    """
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    if name not in EXPERIMENTS:
        raise AssayError(f"unknown lab experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    exp = EXPERIMENTS[name]
    known = [a.name for a in exp.arms]
    if arms is not None and (not arms or set(arms) - set(known)):
        raise AssayError(f"lab {name}: arms {list(arms)}; choose from {', '.join(known)}")
    chosen = [a for a in exp.arms if arms is None or a.name in arms]
    folder = Path(out) / name
    folder.mkdir(parents=True, exist_ok=True)
    steps = steps or exp.steps
    made = exp.prepare(folder, seed, log) if exp.prepare is not None else {}
    rows: dict[str, list[dict[str, Any]]] = {}
    seconds: dict[str, float] = {}
    for i, arm in enumerate(chosen, 1):
        shutil.rmtree(folder / arm.name, ignore_errors=True)
        cfg = load_config(None, [*exp.base, *(_fill(o, made) for o in arm.overrides), f"train.steps={steps}", f"seed={seed}", f"output_dir={folder}",
                                 f"run_name={arm.name}", "train.save_every=0"])
        log(f"lab {name}: arm {i}/{len(chosen)} {arm.name}: {arm.label}")
        t0 = time.perf_counter()
        Trainer(cfg).fit(progress=progress)
        seconds[arm.name] = round(time.perf_counter() - t0, 1)
        rows[arm.name] = read_metrics(folder / arm.name / "metrics.jsonl")
        s = summarise(rows[arm.name])
        log(f"lab {name}: {arm.name}: held-out accuracy {_fmt(s['accuracy_start'])} → {_fmt(s['accuracy_end'])}, length "
            f"{_fmt(s['length_start'])} → {_fmt(s['length_end'])}, alarms {', '.join(f'{m}@{st}' for m, st in s['alarms']) or 'none'} "
            f"({seconds[arm.name]} s)")
    summaries = {arm: {**summarise(r), "seconds": seconds[arm], "last_sample": last_sample(folder / arm)} for arm, r in rows.items()}
    claims = exp.claims(summaries) if len(chosen) == len(exp.arms) else []
    plot = plot_lab(exp, rows, folder / "lab.png")
    (folder / "summary.json").write_text(json.dumps({"experiment": name, "steps": steps, "seed": seed, "arms": summaries,
                                                     "claims": [c.__dict__ for c in claims]}, indent=1) + "\n")
    page = write_page(exp, summaries, claims, plot, folder, steps, seed, made)
    for c in claims:
        log(f"lab {name}: [{'seen' if c.seen else 'NOT seen'}] {c.text} ({c.figures})")
    return page


def _fill(override: str, made: dict[str, str]) -> str:
    for k, v in made.items():
        override = override.replace("${" + k + "}", v)
    return override


def _window(xs: list[float], first: bool, n: int = 10) -> float | None:
    if not xs:
        return None
    part = xs[:n] if first else xs[-n:]
    return sum(part) / len(part)


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """An arm's figures: held-out accuracy, length, repetition, reward and the canary at the start and end (means of the
    first and last 10 steps for per-step series), the alarms that fired (monitor, step), and how far the verified
    accuracy (best evaluation so far minus the last one) and the canary (10-step means) had fallen when the first alarm
    fired, the largest such fall over the run and the step it had fallen 5 points (`fall_step`). The verified accuracy
    is the held-out accuracy sampled at the training temperature when the run logs it (`train.eval_samples`), else
    greedy, as the monitors read it (`assay.training.hacking.HELD_OUT_KEYS`)."""
    def points(key: str) -> list[tuple[int, float]]:
        return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]

    def series(key: str) -> list[float]:
        return [v for _, v in points(key)]

    acc = series("eval/accuracy")
    out: dict[str, Any] = {"accuracy_start": acc[0] if acc else None, "accuracy_end": acc[-1] if acc else None,
                           "accuracy_best": max(acc) if acc else None}
    for key, short in (("rollout/response_length", "length"), ("rollout/repetition", "repetition"), ("reward/mean", "reward"),
                       ("canary/mean", "canary")):
        xs = series(key)
        out[f"{short}_start"], out[f"{short}_end"] = _window(xs, True), _window(xs, False)
    out["accuracy_gain"] = None if not acc else acc[-1] - acc[0]
    out["reward_gain"] = None if out["reward_start"] is None else out["reward_end"] - out["reward_start"]
    out["length_growth"] = None if not out["length_start"] else out["length_end"] / out["length_start"] - 1.0
    out["repetition_rise"] = None if out["repetition_start"] is None else out["repetition_end"] - out["repetition_start"]
    alarms = [(k.split("/", 1)[1], r["step"]) for r in rows for k in r if k.startswith("alarm/")]
    out["alarms"] = alarms
    out["first_alarm"] = alarms[0] if alarms else None
    out["canary_drop_at_alarm"] = _canary_drop(rows, alarms[0][1]) if alarms else None
    key = HELD_OUT_KEYS[0] if points(HELD_OUT_KEYS[0]) else HELD_OUT_KEYS[1]
    evals = points(key)
    out["verified"] = "sampled" if key == HELD_OUT_KEYS[0] else "greedy"
    out["verified_start"], out["verified_best"] = (evals[0][1], max(a for _, a in evals)) if evals else (None, None)
    before = [a for st, a in evals if alarms and st <= alarms[0][1]]
    out["accuracy_drop_at_alarm"] = max(before) - before[-1] if before else None
    falls = [(st, max(a for _, a in evals[: i + 1]) - a) for i, (st, a) in enumerate(evals)]
    out["accuracy_fall_max"] = max((f for _, f in falls), default=None)
    out["accuracy_fall_step"] = fall_step(evals)
    return out


def fall_step(evals: list[tuple[int, float]], by: float = 0.05) -> int | None:
    """The step of the first evaluation that is `by` or more below the best one before it, with the next evaluation
    (if any) as low: when held-out accuracy *has fallen*. One low evaluation followed by a recovery is the evaluation's
    own noise, as the `divergence` monitor also holds (docs/integrity.md); a run's last evaluation counts alone."""
    for i in range(1, len(evals)):
        best = max(a for _, a in evals[:i])
        if all(a <= best - by for _, a in evals[i : i + 2]):
            return evals[i][0]
    return None


def last_sample(run_dir: Path) -> dict[str, Any] | None:
    """The first prompt of the run's last sample dump with its first completion and reward: what the policy writes at the end."""
    path = run_dir / "samples.jsonl"
    if not path.exists():
        return None
    from assay.report.metrics import read_metrics

    rows = read_metrics(path)
    if not rows or not rows[-1].get("completions"):
        return None
    r, c = rows[-1], rows[-1]["completions"][0]
    return {"step": r["step"], "prompt": r.get("prompt"), "answer": r.get("answer"), "completion": c.get("text"), "reward": c.get("reward")}


def _canary_drop(rows: list[dict[str, Any]], step: int, n: int = 10) -> float | None:
    """Best 10-step mean of `canary/mean` up to `step` minus its 10-step mean ending at `step` (None without a canary)."""
    xs = [r["canary/mean"] for r in rows if r["step"] <= step and isinstance(r.get("canary/mean"), (int, float))]
    if not xs:
        return None
    means = [sum(xs[max(0, i - n + 1) : i + 1]) / len(xs[max(0, i - n + 1) : i + 1]) for i in range(len(xs))]
    return max(means) - means[-1]


def plot_lab(exp: Experiment, rows: dict[str, list[dict[str, Any]]], path: Path) -> Path:
    """Held-out accuracy and the experiment's panels against step, one line per arm; alarms marked with ×."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sampled = any(HELD_OUT_KEYS[0] in r for rs in rows.values() for r in rs)
    panels = (("eval/accuracy", "held-out accuracy, greedy (verified)"), *((HELD_OUT_KEYS[0], "held-out accuracy, sampled (verified)"),) * sampled,
              *exp.panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        for arm, rs in rows.items():
            pts = [(r["step"], r[key]) for r in rs if isinstance(r.get(key), (int, float))]
            if not key.startswith("eval/") and len(pts) > 10:  # per-step series: a 10-step moving mean
                ys = [p[1] for p in pts]
                pts = [(pts[i][0], sum(ys[max(0, i - 9) : i + 1]) / len(ys[max(0, i - 9) : i + 1])) for i in range(len(pts))]
            if not pts:
                continue
            line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], label=arm, marker="o" if key.startswith("eval/") else None, ms=3)
            fired = [r["step"] for r in rs if any(k.startswith("alarm/") for k in r)]
            at = {p[0]: p[1] for p in pts}
            marks = [(s, at[s]) for s in fired if s in at]
            if marks:
                ax.plot([m[0] for m in marks], [m[1] for m in marks], "x", color=line.get_color(), ms=10, mew=2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(exp.title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png", dpi=90)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def write_page(exp: Experiment, summaries: dict[str, dict[str, Any]], claims: list[Claim], plot: Path, folder: Path, steps: int,
               seed: int, made: dict[str, str]) -> Path:
    """`index.html`: the question, what was run, the plot, the figures per arm and the claims, seen or not."""
    labels = {a.name: a for a in exp.arms}
    head = ("<tr><th>arm</th><th>what</th><th>held-out accuracy start → end</th><th>length start → end</th>"
            "<th>repeated 4-grams start → end</th><th>canary start → end</th><th>alarms (monitor@step)</th>"
            "<th>what it writes at the end</th><th>seconds</th></tr>")
    body = "".join(
        f"<tr><td><a href='{html.escape(arm)}/report.html'>{html.escape(arm)}</a></td><td>{html.escape(labels[arm].label)}</td>"
        f"<td>{_fmt(s['accuracy_start'])} → {_fmt(s['accuracy_end'])}</td><td>{_fmt(s['length_start'])} → {_fmt(s['length_end'])}</td>"
        f"<td>{_fmt(s['repetition_start'])} → {_fmt(s['repetition_end'])}</td><td>{_fmt(s['canary_start'])} → {_fmt(s['canary_end'])}</td>"
        f"<td>{html.escape(', '.join(f'{m}@{st}' for m, st in s['alarms']) or '—')}</td><td>{_sample_html(s.get('last_sample'))}</td>"
        f"<td>{s['seconds']}</td></tr>"
        for arm, s in summaries.items())
    runs = "".join(f"<li><code>{html.escape(a.name)}</code>: <code>assay train {html.escape(' '.join(_quote(o) for o in (*exp.base, *a.overrides)))} "
                   f"train.steps={steps} seed={seed}</code></li>" for a in exp.arms if a.name in summaries)
    if made:
        runs += "".join(f"<li><code>${{{html.escape(k)}}}</code> = <code>{html.escape(v)}</code>, made before the arms</li>" for k, v in made.items())
    said = "" if claims else "<li>Only some arms ran (<code>--arms</code>): the claims, which compare arms, were not judged.</li>"
    said += "".join(f"<li class='{'seen' if c.seen else 'not'}'><b>{'Seen' if c.seen else 'Not seen'}:</b> {html.escape(c.text)} "
                   f"<span class='fig'>({html.escape(c.figures)})</span></li>" for c in claims)
    img = base64.b64encode(plot.read_bytes()).decode()
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>assay lab: {html.escape(exp.title)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:80em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:.3em .6em;text-align:left}}img{{max-width:100%}}.seen{{color:#064}}.not{{color:#a40}}
.fig{{color:#555}}code{{font-size:90%}}</style></head><body>
<h1>{html.escape(exp.title)}</h1><p>{html.escape(exp.question)}</p>
<h2>What it shows</h2><ul>{said}</ul>
<p>Each claim is checked against this run's figures; one marked <i>not seen</i> did not reproduce at this scale (one seed,
{steps} steps per arm), and the figures beside it say what happened instead.</p>
<img src="data:image/png;base64,{img}" alt="lab plot"><p>Per-step curves are 10-step moving means; × marks a hacking alarm
(docs/integrity.md).</p>
<h2>Figures per arm</h2><table>{head}{body}</table>
<p>Start and end of per-step series are means of the first and last 10 steps; held-out accuracy is the task's verifier on
greedy answers to held-out problems, whatever the arm trained on.</p>
<h2>What was run</h2><p><code>assay lab {html.escape(exp.name)} --steps {steps} --seed {seed}</code> trained, one after the other:</p>
<ul>{runs}</ul></body></html>"""
    path = folder / "index.html"
    tmp = folder / ".index.html.tmp"
    tmp.write_text(page)
    os.replace(tmp, path)
    return path


def _sample_html(sample: dict[str, Any] | None) -> str:
    if not sample:
        return "—"
    return (f"<code>{html.escape(repr(sample['prompt']))}</code> → <pre>{html.escape(str(sample['completion']))}</pre>"
            f"reward {_fmt(sample['reward'])}, answer {html.escape(str(sample['answer']))} (step {sample['step']})")


def _quote(override: str) -> str:
    return f"'{override}'" if any(c in override for c in " {}[]'") and "'" not in override else (f'"{override}"' if " " in override else override)


def _fmt(x: Any) -> str:
    return "—" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)
