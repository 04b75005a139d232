"""The Python API (`from assay import train, evaluate, score, RunConfig`) and the model card of `final/`.

The README's Python example is extracted from README.md and run as written, as a script
(so worker processes must not run it again); `final/` loads in `transformers` as it is and
its README.md is a Hub model card.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import assay
from _train_helpers import LEARNING_SIGNAL
from assay import AssayError, RunConfig, evaluate, score, train
from assay.api import _progress, run_config

ROOT = Path(__file__).resolve().parents[1]
SRC = str(Path(assay.__file__).resolve().parents[1])


def readme_example() -> str:
    """The first Python block of the README's `## Python` section."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Python\n"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_python_example_runs_as_written(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600, env={"PYTHONPATH": SRC, "PATH": ""})
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 4, lines  # each print once: the script ran once, not again in a worker
    run_dir, accuracy = lines[0].rsplit(" ", 1)
    assert Path(tmp_path, run_dir, "final", "model.safetensors").is_file() and 0.0 <= float(accuracy) <= 1.0
    assert "'pass@4'" in lines[1] and lines[2:] == ["1.0 correct", "0.0 wrong"]
    assert "run folder:" in p.stderr and "\x1b[" not in p.stderr  # no live bar drawn into a pipe


def test_import_assay_is_light_and_exports_the_api():
    code = "import sys, assay; assert 'torch' not in sys.modules; from assay import train, evaluate, score, RunConfig, Reward, Extra, declare; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={"PYTHONPATH": SRC, "PATH": ""})
    assert p.stdout.strip() == "ok", p.stderr
    assert {"train", "evaluate", "score", "RunConfig", "Reward", "AdvantageEstimator", "Sampler", "Extra"} <= set(dir(assay))


def test_mistakes_raise_one_line_errors_and_never_exit(tmp_path):
    with pytest.raises(AssayError, match="is not a directory"):
        train({"model": {"path": str(tmp_path / "nope")}})
    with pytest.raises(AssayError, match=r"invalid config value rollout.group_size=0"):
        run_config(RunConfig(), ["rollout.group_size=0"])
    with pytest.raises(AssayError, match="unknown reward"):
        score("no-such-reward", [{"completion": "1"}])
    assert _progress(None) is False  # stderr is not a terminal here, as in a notebook
    results = score("math", [{"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}], "answer": "4"}])
    assert results[0].score == 1.0  # TRL's conversational rows score as they are


def test_final_is_a_transformers_model_with_a_hub_model_card(tiny_model_dir, tmp_path):
    from huggingface_hub import ModelCard
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cached = tmp_path / "hub" / "models--assay-test--tiny-qwen2" / "snapshots" / "0123abc"  # a model in the Hub cache layout
    cached.mkdir(parents=True)
    for f in Path(tiny_model_dir).iterdir():
        (cached / f.name).write_bytes(f.read_bytes())
    result = train({"model": {"path": str(cached)}, "output_dir": str(tmp_path), "run_name": "card"}, "train.steps=2", "train.eval_n=8",
                   "rollout.prompts_per_step=4", "rollout.group_size=2", "reward_workers=0", "train.threads=1", LEARNING_SIGNAL)
    final = result.model
    model, tok = AutoModelForCausalLM.from_pretrained(final), AutoTokenizer.from_pretrained(final)
    saved = load_file(final / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved) and tok("1+1=")["input_ids"]
    card = ModelCard.load(final / "README.md")
    meta = card.data.to_dict()
    assert meta["base_model"] == "assay-test/tiny-qwen2" and meta["library_name"] == "transformers" and "grpo" in meta["tags"]
    metric = meta["model-index"][0]["results"][0]["metrics"][0]
    assert metric["value"] == result.final["held-out accuracy at end"] and metric["name"] == "held-out greedy accuracy"
    body = card.text
    assert "| advantage estimator | `grpo` |" in body and "| policy loss | `ppo_clip` |" in body and "name: random" in body
    assert "![heldout accuracy](heldout_accuracy.png)" in body and (final / "heldout_accuracy.png").is_file()
    front = yaml.safe_load((final / "README.md").read_text().split("---")[1])
    assert front == meta
    out = evaluate(str(final), task="arithmetic", n=8, k=0, workers=0)
    assert out["n"] == 8 and out["model"] == str(final)


@pytest.mark.slow
def test_the_readme_example_runs_in_a_jupyter_kernel(tmp_path, monkeypatch):
    """In a real kernel (`__main__` without a file, stderr a kernel stream): plain output, no bar, errors catchable, the kernel lives on."""
    nbformat = pytest.importorskip("nbformat", reason="pip install 'assay[notebook]'")
    nbclient = pytest.importorskip("nbclient", reason="pip install 'assay[notebook]'")
    pytest.importorskip("ipykernel", reason="pip install 'assay[notebook]'")
    cells = [readme_example(), "from assay import AssayError\ntry:\n    train({'model': {'path': 'no/such/model'}})\nexcept AssayError as e:\n"
             "    print('caught:', e)", "print('still alive')"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    monkeypatch.setenv("PYTHONPATH", SRC)  # the kernel is a child of this process: this checkout's assay
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    streams = [[(o.name, o.text) for o in c.outputs if o.output_type == "stream"] for c in nb.cells]
    assert all(o.output_type == "stream" for c in nb.cells for o in c.outputs)  # no error output, no rich widget
    out = "".join(t for n, t in streams[0] if n == "stdout").strip().splitlines()
    err = "".join(t for n, t in streams[0] if n == "stderr")
    assert len(out) == 4 and out[2:] == ["1.0 correct", "0.0 wrong"] and "run folder:" in err and "\x1b[" not in err
    assert "caught: model path 'no/such/model' is not a directory" in streams[1][0][1] and streams[2] == [("stdout", "still alive\n")]


def test_the_model_cards_reward_block_is_the_configs_yaml():
    """A reward named by a string was dumped as a YAML document of its own, with its end marker (`...`) in the card."""
    from assay.config import RunConfig
    from assay.report.model_card import model_card

    config = RunConfig().model_dump(mode="json")
    for reward, block in (("arithmetic", "reward: arithmetic"), ({"name": "rm", "args": {"path": "runs/rm"}}, "reward:\n  name: rm\n  args:\n    path: runs/rm")):
        card = model_card(config, {}, "m", [], reward=reward)
        assert f"**Reward**\n\n```yaml\n{block}\n```" in card and "\n..." not in card
        assert yaml.safe_load(block) == {"reward": reward}
