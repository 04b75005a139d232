"""A run's final figures, read from its metric rows (`metrics.jsonl`): what the report, the command and the model card show."""

from __future__ import annotations

from typing import Any


def recent_reward(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The training reward averaged over the last tenth of the steps (at least 1, at most 20)."""
    vals = [r["reward/mean"] for r in rows if r.get("reward/mean") is not None]
    n = min(20, max(1, len(vals) // 10))
    return {f"train reward (mean of the last {n} steps)": sum(vals[-n:]) / n if vals else None}


def heldout_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out figures at the first and last evaluation: verified accuracy when a verifier checked the answers
    (always, with a verifier as the reward), the mean of a learned reward when the run's reward gives no verdicts."""
    out: dict[str, Any] = {}
    for key, name in (("eval/accuracy", "held-out accuracy"), ("eval/sampled_accuracy", "held-out sampled accuracy"),
                      ("eval/mean_reward", "held-out mean reward")):
        vals = [r[key] for r in rows if r.get(key) is not None]
        if vals or key == "eval/accuracy" and not any("eval/mean_reward" in r for r in rows):
            out[f"{name} at start"], out[f"{name} at end"] = (vals[0], vals[-1]) if vals else (None, None)
    return out


def time_to_accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's wall time, and when held-out accuracy first reached its value at the end (`perf/wall_s`: since the run
    began, evaluations included; nothing for rows written before that key existed)."""
    evals = [r for r in rows if r.get("eval/accuracy") is not None and r.get("perf/wall_s") is not None]
    if not evals:
        return {}
    final = evals[-1]["eval/accuracy"]
    first = next(r for r in evals if r["eval/accuracy"] >= final)
    return {"wall time (s)": round(rows[-1].get("perf/wall_s", evals[-1]["perf/wall_s"]), 1),
            "time to held-out accuracy at end (s)": round(first["perf/wall_s"], 1), "steps to held-out accuracy at end": first["step"]}
