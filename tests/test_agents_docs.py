"""docs/agents.md's example environment, run as written: in the loop on the bundled model, and by `assay train`."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from assay.report.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
SRC = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "agents.md").read_text(), re.DOTALL).group(1)


def test_the_example_is_about_30_lines():
    assert 25 <= len(SRC.strip().splitlines()) <= 35


def test_the_example_plays_episodes_on_the_bundled_model(bundled):
    from assay.rollout.base import SamplingParams, make_sampler
    from assay.rollout.multiturn import Budget, MultiTurn
    from assay.types import Sample

    scope: dict = {}
    exec(compile(SRC, "guess.py", "exec"), scope)
    model, tok = bundled
    loop = MultiTurn(make_sampler("torch", model, tok), tok, scope["Guess"], Budget(max_turns=3, max_tokens=256))
    trajs = loop.run([Sample("a", "1+2=", answer="3"), Sample("b", "4+4=", answer="8")], 4, SamplingParams(2, 1.0),
                     torch.Generator().manual_seed(0))
    assert len(trajs) == 8
    for t in trajs:
        assert t.finish_reason in ("found", "out_of_tries", "max_turns") and t.info["reward"] in (0.0, 1.0)
        assert tok.decode(t.prompt_ids) == "Guessadigit:"  # the bundled tokenizer drops spaces when it encodes text
        for (_, end), (start, _) in zip(t.turns, t.turns[1:]):  # every hint, as the model was shown it
            assert tok.decode(t.completion_ids[end:start]) in ("higher:", "lower:", "adigitplease:")


def test_assay_train_runs_the_example_by_module_path(tmp_path):
    (tmp_path / "guess.py").write_text(SRC)
    args = ["env.name=guess:Guess", "env.max_turns=3", "rollout.max_new_tokens=2", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "train.steps=2", "train.eval_n=4", "reward_workers=0", "train.threads=1", f"output_dir={tmp_path}", "run_name=g"]
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r for r in read_metrics(tmp_path / "g" / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and all(r["agent/turns_mean"] >= 1 for r in rows)
