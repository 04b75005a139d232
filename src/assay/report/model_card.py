"""The trained model's card: `final/README.md` in the Hugging Face Hub's model-card format.

YAML front matter (rendered by `huggingface_hub.ModelCardData`: library, pipeline tag,
tags, the base model and datasets where they are Hub ids, and a `model-index` with the
held-out accuracy), then the base model, the data, the reward, the algorithm and its
settings, the held-out figures and the plots, and how to load the model with
`transformers` (the weights are `model.safetensors`, as `save_pretrained` writes them).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
PLOTS = ("heldout_accuracy.png", "reward.png")


def hub_id(name: Any) -> str | None:
    """`name` when it reads as a Hub repository id (`org/name`) and is not a path on this machine."""
    return name if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).exists() else None


def base_model_id(model_path: str) -> str | None:
    """The Hub id the starting model came from: its own name, the Hub cache folder it sits in
    (`…/models--ORG--NAME/snapshots/REV`), or `_name_or_path` in its `config.json`."""
    if hub_id(model_path):
        return model_path
    from assay.models import resolve_model_path

    try:
        folder = resolve_model_path(model_path).resolve()
        config = json.loads((folder / "config.json").read_text())
    except Exception:  # a card never fails a finished run
        return None
    for part in folder.parts:
        if part.startswith("models--") and part.count("--") >= 2:
            return part.removeprefix("models--").replace("--", "/", 1)
    return hub_id(config.get("_name_or_path"))


def front_matter(config: dict[str, Any], summary: dict[str, Any], name: str) -> str:
    """The card's YAML front matter (without the `---` lines)."""
    from huggingface_hub import EvalResult, ModelCardData

    data = config["data"]
    source = data.get("task") if not data.get("path") else (data.get("format") or Path(data["path"]).name)
    results = []
    if summary.get("held-out accuracy at end") is not None:
        results.append(EvalResult(task_type="text-generation", dataset_type=str(source), dataset_name=f"{source} (held out)",
                                  metric_type="accuracy", metric_value=float(summary["held-out accuracy at end"]),
                                  metric_name="held-out greedy accuracy"))
    card = ModelCardData(
        library_name="transformers", pipeline_tag="text-generation", base_model=base_model_id(config["model"]["path"]),
        datasets=hub_id(data.get("path")), model_name=name, eval_results=results or None,
        tags=["assay", "reinforcement-learning", config["algo"]["advantage"], *([data["format"]] if data.get("format") else [])],
    )
    return card.to_yaml()


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(f"| {k} | {_fmt(v)} |\n" for k, v in rows.items() if v is not None)
    return "| | |\n|---|---|\n" + cells


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return f"`{v}`" if isinstance(v, (str, dict, list)) else str(v)


def algorithm_rows(config: dict[str, Any]) -> dict[str, Any]:
    """The settings that define the update: estimator, loss, aggregation, their arguments, sampling, optimizer."""
    a, r, o, t = config["algo"], config["rollout"], config["optim"], config["train"]
    return {
        "advantage estimator": a["advantage"], "policy loss": a["loss"], "loss aggregation": a["aggregation"],
        "estimator arguments": a["advantage_args"] or None, "loss arguments": a["loss_args"] or None,
        "clip (low, high)": f"{a['clip_low']}, {a['clip_high']}" if a["clip_low"] is not None or a["clip_high"] is not None else None,
        "KL coefficient": a["kl_coef"], "entropy coefficient": a["entropy_coef"], "epochs × minibatches": f"{a['epochs']} × {a['minibatches']}",
        "mismatch correction": a["mismatch"], "prompts per step × group size": f"{r['prompts_per_step']} × {r['group_size']}",
        "max new tokens": r["max_new_tokens"], "temperature": r["temperature"], "top p": r["top_p"],
        "learning rate": o["lr"], "warm-up steps": o["warmup_steps"], "steps": t["steps"], "seed": config["seed"],
    }


def model_card(config: dict[str, Any], summary: dict[str, Any], name: str, plots: list[str], reward: Any = None) -> str:
    """The text of `README.md` for the trained model (`plots`: image files beside it; `reward`: the reward
    block the run used, default the config's)."""
    data = config["data"]
    base = config["model"]["path"]
    data_rows = {"task": data.get("task") if not data.get("path") else None, "file": data.get("path"), "format": data.get("format"),
                 "held-out file": data.get("eval_path"), "chat template": "yes" if data.get("chat") or data.get("system_prompt") else None,
                 "system prompt": data.get("system_prompt"), "held-out problems": summary.get("held-out problems")}
    results = {k: v for k, v in summary.items() if k.startswith(("held-out accuracy", "held-out mean reward", "train reward"))
               or k in ("steps", "total time (s)")}
    images = "".join(f"![{p.removesuffix('.png').replace('_', ' ')}]({p})\n" for p in plots)
    # as a config writes it: a bare name dumped alone would end in YAML's document marker (`...`)
    reward = yaml.safe_dump({"reward": reward or config.get("reward")}, sort_keys=False).strip()
    return f"""---
{front_matter(config, summary, name)}
---

# {name}

Post-trained with reinforcement learning by assay from `{base}`.

## Training

**Data**

{_table(data_rows)}
**Reward**

```yaml
{reward}
```

**Algorithm**

{_table(algorithm_rows(config))}
## Results

{_table(results)}
{images}
## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("PATH/TO/final")
tokenizer = AutoTokenizer.from_pretrained("PATH/TO/final")
```

## Configuration

```yaml
{yaml.safe_dump(config, sort_keys=False).strip()}
```
"""


def card_files(run_dir: Path, config: dict[str, Any], summary: dict[str, Any], reward: Any = None) -> dict[str, str | bytes]:
    """`README.md` and the report's plots, as the files to write into `final/`."""
    plots = [p for p in PLOTS if (Path(run_dir) / p).is_file()]
    files: dict[str, str | bytes] = {p: (Path(run_dir) / p).read_bytes() for p in plots}
    files["README.md"] = model_card(config, summary, Path(run_dir).name, plots, reward)
    return files
