"""Best-of-N selection: sample N completions per problem, keep the one a reward scores highest, verify it.

For each held-out problem, N completions are sampled once (seeded, at `temperature`) and
scored twice: by the *selector* (any reward spec: a verifier, a reward model `rm`, a
process or judge reward) and by the task's *verifier* (correct: score ≥ 1). For each n in
1, 2, 4, ..., N (and N), on the first n samples of every problem:

    best_of@n   the verifier's verdict on the sample the selector scores highest
                (ties: the earliest sample; a sample the selector cannot score, None, counts lowest)
    pass@n      some sample is correct (an oracle selector; the ceiling of best_of@n)
    maj@n       the most common answer (ties: the one seen first) is correct; majority vote,
                "Self-Consistency Improves Chain of Thought Reasoning in Language Models"
                (Wang et al., 2022)

Every curve reads the same first n samples of each problem, so they compare sample for
sample: with the verifier as selector best_of@n is pass@n exactly, and with a constant
selector it is the first sample's accuracy at every n. The gap between best_of@n and pass@n
is what the selector leaves on the table; a best_of@n that falls as n grows is a selector
being over-optimised (Gao et al., "Scaling Laws for Reward Model Overoptimization", 2022,
measure the same curve against N for reward models). An answer, for majority vote, is the
verifier's `info["extracted"]` when it reports one, else the stripped completion.

    >>> best_of_curve([[False, True, True]], [[0.2, 0.9, None]], [["7", "8", "8"]], [1, 2, 3])[-1]
    {'n': 3, 'best_of': 1.0, 'pass': 1.0, 'majority': 1.0}
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from assay.errors import AssayError
from assay.types import RewardResult, Sample, Trajectory

Score = Callable[[list[Trajectory]], list[RewardResult]]


def sizes(n_max: int) -> list[int]:
    """1, 2, 4, ... up to `n_max`, and `n_max` itself.

    >>> sizes(6)
    [1, 2, 4, 6]
    """
    out = [1 << i for i in range(n_max.bit_length()) if 1 << i <= n_max]
    return out if out[-1] == n_max else [*out, n_max]


def pick(scores: list[float | None]) -> int:
    """Index of the highest score; ties go to the earliest, None counts lowest (index 0 when all are None)."""
    return max(range(len(scores)), key=lambda j: (scores[j] is not None, scores[j] if scores[j] is not None else 0.0, -j))


def majority(answers: list[str]) -> int:
    """Index of the first sample giving the most common answer (ties: the answer seen first)."""
    counts = Counter(answers)
    top = max(counts.values())
    return next(j for j, a in enumerate(answers) if counts[a] == top)


def best_of_curve(correct: list[list[bool]], scores: list[list[float | None]], answers: list[list[str]], ns: list[int]) -> list[dict[str, Any]]:
    """`[{n, best_of, pass, majority}]`: accuracies over problems, each on the first n samples.

    Args:
        correct: per problem, per sample `[P][N]`: the verifier's verdict.
        scores: `[P][N]`: the selector's scores (None: unscored).
        answers: `[P][N]`: the answer each sample gives, for majority vote.
        ns: the sizes n (each at most N).
    """
    rows = []
    for n in ns:
        best = [c[pick(s[:n])] for c, s in zip(correct, scores)]
        maj = [c[majority(a[:n])] for c, a in zip(correct, answers)]
        any_ok = [any(c[:n]) for c in correct]
        m = max(1, len(correct))
        rows.append({"n": n, "best_of": sum(best) / m, "pass": sum(any_ok) / m, "majority": sum(maj) / m})
    return rows


def sample_and_score(sampler: Any, verify: Score, select: Score, problems: list[Sample], n_max: int, max_new_tokens: int,
                     temperature: float = 1.0, seed: int = 0, batch_size: int = 256) -> list[dict[str, Any]]:
    """Per problem `{id, prompt, completions [N], correct [N], scores [N], answers [N]}`: N seeded samples, verified and selector-scored."""
    import torch

    from assay.eval.policy import _episodes
    from assay.rollout.base import SamplingParams

    gen = torch.Generator(device="cpu").manual_seed(seed)  # the caller's stream; a sampler on a device seeds its own from it
    step = max(1, batch_size // n_max)
    out = []
    for i in range(0, len(problems), step):
        chunk = problems[i : i + step]
        trajs = _episodes(sampler.generate(chunk, n_max, SamplingParams(max_new_tokens, temperature=temperature), gen))  # one per episode
        checked, chosen = verify(trajs), select(trajs)
        for j, problem in enumerate(chunk):
            part = slice(j * n_max, (j + 1) * n_max)
            ts, vs, ss = trajs[part], checked[part], chosen[part]
            out.append({"id": problem.id, "prompt": problem.prompt if isinstance(problem.prompt, str) else problem.prompt[-1].get("content"),
                        "completions": [t.completion for t in ts],
                        "correct": [v.score is not None and v.score >= 1.0 for v in vs],
                        "scores": [s.score for s in ss],
                        "answers": [str(v.info.get("extracted", t.completion.strip())) for t, v in zip(ts, vs)],
                        "errors": sorted({s.error for s in ss if s.error})[:3]})
    if out and all(s is None for p in out for s in p["scores"]):
        first = next((e for p in out for e in p["errors"]), "every score was None")
        raise AssayError(f"--reward could not score any of the {len(out) * n_max} completions: {first}")
    return out


def table(curve: list[dict[str, Any]]) -> str:
    """The curve as a printed table."""
    lines = [f"{'n':>5}  {'best_of':>8}  {'pass@n':>8}  {'maj@n':>8}"]
    lines += [f"{r['n']:>5}  {r['best_of']:>8.4f}  {r['pass']:>8.4f}  {r['majority']:>8.4f}" for r in curve]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Verified accuracy of the picked sample against n, with pass@n and maj@n as reference lines; the PNG written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curve = result["curve"]
    ns = [r["n"] for r in curve]
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=110)
    ax.plot(ns, [r["best_of"] for r in curve], marker="o", label=f"best-of-n by {result['selector']}")
    ax.plot(ns, [r["pass"] for r in curve], linestyle="--", color="gray", label="pass@n (oracle pick)")
    ax.plot(ns, [r["majority"] for r in curve], linestyle=":", color="black", label="maj@n (majority vote)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("n (samples per problem)")
    ax.set_ylabel(f"verified accuracy ({result['verifier']})")
    ax.set_title(f"best-of-n on {result['problems']} problems, T={result['temperature']:g}")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write(result: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """`bestof.json` (the curve and every problem's samples) and `bestof.png` in `out_dir`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise AssayError(f"--out: {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bestof.json").write_text(json.dumps(result, indent=1) + "\n")
    return out / "bestof.json", plot(result, out / "bestof.png")


def spec_name(spec: Any) -> str:
    """A short label for a reward spec: its name (of a block, inline or not), or the class of a `Reward` object.

    >>> spec_name("{name: rm, args: {path: runs/rm}}"), spec_name("arithmetic")
    ('rm', 'arithmetic')
    """
    if isinstance(spec, str):
        import yaml

        try:
            block = yaml.safe_load(spec) if spec.lstrip().startswith("{") else None
        except yaml.YAMLError:
            block = None
        spec = block if isinstance(block, dict) else spec.strip().splitlines()[0][:60]
    if isinstance(spec, dict):
        return str(spec.get("name", "?"))
    return spec if isinstance(spec, str) else type(spec).__name__
