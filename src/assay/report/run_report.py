"""The end-of-run report: PNG plots of reward and held-out accuracy (and, for a run with an
environment, turns and tool calls per episode), and an HTML page."""

from __future__ import annotations

import base64
import html
import os
from pathlib import Path
from typing import Any

import yaml

from assay.report.metrics import read_metrics

PLOTS = {
    "reward.png": ("Training reward", [("reward/mean", "reward mean"), ("train/accuracy", "train accuracy")]),
    "heldout_accuracy.png": ("Held-out accuracy (verified) and mean reward",
                             [("eval/accuracy", "held-out accuracy (greedy)"), ("eval/sampled_accuracy", "held-out accuracy, sampled (train.eval_samples)"),
                              ("eval/mean_reward", "held-out mean reward (a learned reward's scale)")]),
}
#: drawn only for a run whose rows have `agent/*` metrics (an `env:` block)
AGENT_PLOTS = {
    "agents.png": ("Episodes", [("agent/turns_mean", "turns per episode"), ("agent/tool_calls_per_episode", "tool calls per episode")]),
}


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metrics(rows: list[dict[str, Any]], out_dir: Path, plots: dict[str, tuple[str, list[tuple[str, str]]]] | None = None) -> list[Path]:
    """One PNG per entry of `plots` (file name → (title, [(key, label)]); default `PLOTS`, with `AGENT_PLOTS` when the run logged `agent/turns_mean`); returns the files written.

    A per-step series longer than 60 points (any key outside `eval/`) is drawn as a moving mean.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    if plots is None:
        plots = {**PLOTS, **(AGENT_PLOTS if any("agent/turns_mean" in r for r in rows) else {})}
    for name, (title, keys) in plots.items():
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for key, label in keys:
            x, y = _series(rows, key)
            if len(x) > 60 and not key.startswith("eval/"):
                w = max(1, len(y) // 40)
                y = [sum(y[max(0, i - w + 1) : i + 1]) / len(y[max(0, i - w + 1) : i + 1]) for i in range(len(y))]
                label += f" (moving mean of {w})"
            if x:
                ax.plot(x, y, marker="o" if len(x) < 30 else None, label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(loc="best")
        else:  # nothing was measured (no held-out data, or no step scored)
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        fig.tight_layout()
        fig.savefig(out_dir / f".{name}.tmp", format="png")
        os.replace(out_dir / f".{name}.tmp", out_dir / name)  # never a half-written plot
        plt.close(fig)
        written.append(out_dir / name)
    return written


def _warnings_html(rows: list[dict[str, Any]]) -> str:
    """The run's hacking alarms (docs/integrity.md) and health warnings, each with the step it fired."""
    out = ""
    for key, title in (("alarm", "Hacking alarms"), ("warning", "Warnings")):
        items = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), str)]
        if items:
            lis = "".join(f"<li>step {s}: {html.escape(w)}</li>" for s, w in items)
            out += f'<h2>{title}</h2><ul class="warn">{lis}</ul>'
    return out


def _samples_html(run_dir: Path, dumps: int = 2) -> str:
    """The last `dumps` sample dumps of `samples.jsonl`: prompt, answer, completions with reward and reason."""
    path = run_dir / "samples.jsonl"
    rows = read_metrics(path) if path.exists() else []
    steps = sorted({r["step"] for r in rows})[-dumps:]
    body = ""
    for r in (r for r in rows if r["step"] in steps):
        comps = "".join(f"<tr><td><code>{html.escape(repr(c.get('text')))}</code></td><td>{html.escape(_fmt(c.get('reward')))}</td>"
                        f"<td>{html.escape(str(c.get('reason') or c.get('error') or ''))}</td></tr>" for c in r.get("completions", []))
        prompt = r.get("prompt_text", r.get("prompt"))  # a conversation as the model saw it, through the chat template
        shown = f"<pre>{html.escape(prompt)}</pre>" if isinstance(prompt, str) and "\n" in prompt else f"<code>{html.escape(repr(prompt))}</code>"
        body += (f"<h3>step {r['step']} (answer {html.escape(str(r.get('answer')))})</h3>{shown}"
                 f"<table><tr><th>completion</th><th>reward</th><th>reason</th></tr>{comps}</table>")
    return f"<h2>Sample completions</h2>{body}" if body else ""


def write_report(run_dir: Path, config: dict[str, Any], summary: dict[str, Any],
                 plots: dict[str, tuple[str, list[tuple[str, str]]]] | None = None) -> Path:
    """Plots (`plots`, default `PLOTS`) plus `report.html` (config, final figures, warnings, plots, sample completions) in `run_dir`;
    the page embeds its plots, so it can be mailed or moved on its own."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
    files = plot_metrics(rows, run_dir, plots)
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in summary.items())
    imgs = "".join(f'<img src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}" alt="{p.stem}" title="{p.name}">'
                   for p in files)  # embedded: the page alone is the whole report (the PNG files stay beside it)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>assay run {html.escape(run_dir.name)}</title>
<style>body{{font-family:system-ui,sans-serif;margin:2em;max-width:70em}}table{{border-collapse:collapse}}
th,td{{border:1px solid #ccc;padding:.3em .7em;text-align:left}}img{{max-width:48%;margin:.5em}}.warn{{color:#a40}}pre{{background:#f5f5f5;padding:1em}}</style>
</head><body><h1>assay run <code>{html.escape(run_dir.name)}</code></h1>
<h2>Final figures</h2><table>{cells}</table>{_warnings_html(rows)}<h2>Curves</h2>{imgs}
{_pictures_html(run_dir)}{_samples_html(run_dir)}<h2>Configuration</h2><pre>{html.escape(yaml.safe_dump(config, sort_keys=False))}</pre></body></html>"""
    out = run_dir / "report.html"
    tmp = run_dir / ".report.html.tmp"
    tmp.write_text(page)
    os.replace(tmp, out)
    return out


def _pictures_html(run_dir: Path) -> str:
    """An image policy's held-out pictures at the first and the last evaluation (`images/heldout_step*.png`), side by side."""
    grids = sorted((run_dir / "images").glob("heldout_step*.png"))
    if not grids:
        return ""
    shown = [grids[0], grids[-1]] if len(grids) > 1 else grids
    figs = "".join(f'<figure style="display:inline-block;margin:.5em"><img style="max-width:100%;image-rendering:pixelated" '
                   f'src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}" alt="{p.stem}">'
                   f"<figcaption>step {int(p.stem.removeprefix('heldout_step'))}</figcaption></figure>" for p in shown)
    return ("<h2>Held-out pictures</h2><p>The same prompts and starting noise at each evaluation; framed green where the checker "
            f"finds the picture right, red where not.</p>{figs}")


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
