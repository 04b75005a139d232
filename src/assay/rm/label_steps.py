"""Monte Carlo step labels from a policy and a task's verifier (`assay rm label-steps`).

The method of "Math-Shepherd: Verify and Reinforce LLMs Step-by-step without Human
Annotations" (Wang et al., arXiv 2312.08935): sample solutions of each problem with the
policy, cut each into steps (`assay.rm.steps.split_steps`), and from the prefix that ends
at step k roll out K completions with the same policy; each finished solution (prefix +
rollout) is checked with the task's verifier, and step k is labelled with the share of
rollouts that are right (soft estimation, `--label soft`) or with whether any is (hard
estimation, `--label hard`). The last step's prefix is the whole solution, so its label is
the verifier's verdict on the solution itself, as in Math-Shepherd.

Generation goes through the sampler interface (`make_sampler`), so `--backend vllm` or
`openai` labels with an engine. A text prompt is continued as the text prompt + prefix; a
conversation as the conversation with the prefix as a final assistant message (the chat
template continues it). Rows are written in the step-labelled format `read_step_rows` reads,
with `split` and `separator` set so that the completion and its steps are exactly the
sampled text: `{id, prompt, answer, steps, labels, separator: "", split, completion, spans,
rollouts}` (`steps[k] == completion[spans[k][0]:spans[k][1]]`, the text between two steps
kept on the step after it). With `keep_rollouts` a row also holds `finished`: every finished
solution its rollouts produced, `[text, verified right]`, so an outcome reward model can be
trained on exactly the text the labels came from (`benchmarks/prm_vs_orm.py`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from assay.errors import AssayError
from assay.rm.steps import check_split, completion_pieces
from assay.types import Sample, Trajectory


def continued(sample: Sample, prefix: str) -> Sample:
    """`sample` with `prefix` already written: appended to a text prompt, or a final assistant message of a conversation."""
    if isinstance(sample.prompt, str):
        prompt: Any = sample.prompt + prefix
    else:
        prompt = [*sample.prompt, {"role": "assistant", "content": prefix}]
    return Sample(sample.id, prompt, sample.answer, dict(sample.fields), template_args=sample.template_args)


def label_steps(model: str = "tiny-arith", task: str = "arithmetic", task_args: dict[str, Any] | None = None, split: str = "train",
                problems: int = 200, samples: int = 2, rollouts: int = 8, steps: str = "newline", label: str = "soft",
                max_new_tokens: int = 8, temperature: float = 1.0, backend: str = "torch", device: str = "cpu", seed: int = 0,
                batch: int = 64, server_url: str | None = None, progress: bool = False, keep_rollouts: bool = False) -> list[dict[str, Any]]:
    """Step-labelled rows for `problems` problems of `task`'s `split`, `samples` solutions each, `rollouts` rollouts per step.

    Args:
        steps: how solutions are cut (`split_steps`: newline, chars:N, a marker, module:function).
        label: `soft` (the share of right rollouts) or `hard` (1.0 when any rollout is right).
        batch: problems whose rollouts go to the sampler in one `generate` call.
        backend, server_url: the generation backend (`rollout.backend`: torch, vllm, openai) and, for `openai`, the server.
        keep_rollouts: also write `finished`, each rollout's finished solution and its verdict.
    Returns:
        One row per sampled solution with at least one step (see the module doc).
    """
    import torch

    from assay.data.tasks import make_task
    from assay.models import load_policy
    from assay.rewards.base import REWARDS
    from assay.rollout.base import SamplingParams, make_sampler
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    if label not in ("soft", "hard"):
        raise AssayError(f"--label {label!r}: use soft (the share of right rollouts) or hard (any right rollout)")
    for name, v in (("--problems", problems), ("--samples", samples), ("--rollouts", rollouts), ("--max-new-tokens", max_new_tokens), ("--batch", batch)):
        if v < 1:
            raise AssayError(f"{name} {v}: must be at least 1")
    check_split(steps)
    t = make_task(task, **(task_args or {}))
    verifier = REWARDS.get(t.reward)()
    stream = t.stream(split, seed)
    chosen = [s for _, s in zip(range(problems), stream)]
    if len(chosen) < problems:
        raise AssayError(f"task {task!r} split {split!r} has only {len(chosen)} problems; ask for fewer (--problems {len(chosen)})")
    policy, tok = load_policy(model, device)
    rollout_cfg = None
    if backend != "torch":
        from assay.config import RolloutConfig

        rollout_cfg = RolloutConfig(backend=backend, server_url=server_url)
    sampler = make_sampler(backend, policy, tok, rollout_cfg, device)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    gen = torch.Generator(device="cpu").manual_seed(seed)  # a sampler on a device seeds its own from it
    rows: list[dict[str, Any]] = []
    bar = Progress(TextColumn("[bold]label-steps"), BarColumn(), MofNCompleteColumn(), TextColumn("problems  {task.fields[info]}"),
                   TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), console=Console(file=sys.stderr), disable=not progress)
    task_id = bar.add_task("label", total=len(chosen), info="")
    try:
        with bar:
            for i in range(0, len(chosen), batch):
                rows += _label_chunk(chosen[i : i + batch], sampler, verifier, params, gen, samples, rollouts, steps, label, keep_rollouts)
                bar.update(task_id, completed=min(i + batch, len(chosen)), info=f"{len(rows)} solutions labelled")
    finally:
        sampler.close()
    for r in rows:
        r["split"] = steps
    return rows


def _verify(verifier, sample: Sample, texts: list[str]) -> list[bool]:
    results = verifier([Trajectory(sample, t, [], [], [], True) for t in texts])
    return [r.error is None and r.score is not None and r.score >= 1.0 for r in results]


def _label_chunk(chunk: list[Sample], sampler, verifier, params, gen, samples: int, rollouts: int, how: str, label: str,
                 keep_rollouts: bool = False) -> list[dict[str, Any]]:
    """Sample solutions of `chunk`, roll out from every step prefix in one `generate` call, and label the steps."""
    solutions = sampler.generate(chunk, samples, params, gen)  # [problems × samples], grouped by problem
    todo = []  # (problem index, completion, pieces, spans, ends)
    for j, traj in enumerate(solutions):
        pieces, spans = completion_pieces(traj.completion, how)
        ends = [e for _, e in spans]
        if pieces:
            todo.append((j, traj.completion, pieces, spans, ends))
    starts = [continued(chunk[j // samples], comp[:e]) for j, comp, _, _, ends in todo for e in ends[:-1]]  # the last step: the solution itself
    outs = sampler.generate(starts, rollouts, params, gen) if starts else []
    rows, k = [], 0
    for j, comp, pieces, spans, ends in todo:
        sample = chunk[j // samples]
        right, finished = [], []
        for e in ends[:-1]:
            texts = [comp[:e] + o.completion for o in outs[k * rollouts : (k + 1) * rollouts]]
            right.append(_verify(verifier, sample, texts))
            finished += [[t, ok] for t, ok in zip(texts, right[-1])]
            k += 1
        right.append(_verify(verifier, sample, [comp[: ends[-1]]]))
        labels = [sum(r) / len(r) if label == "soft" else float(any(r)) for r in right]
        rows.append({"id": f"{sample.id}-{j % samples}", "prompt": sample.prompt, "answer": sample.answer, "steps": pieces, "labels": labels,
                     "separator": "", "completion": comp, "spans": [list(s) for s in spans], "rollouts": [len(r) for r in right]})
        if keep_rollouts:
            rows[-1]["finished"] = finished
    return rows


def write_rows(path: str | Path, rows: list[dict[str, Any]]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
