"""Break one thing at a time in a copy of the tree; show which breakages the test suite catches.

Each mutation is a small deliberate bug: a file, the exact text to replace and its
replacement. For each one the script copies the tracked files to a temporary folder,
applies the bug, and runs the default suite there (`pytest -x`, the tests most likely to
catch it first). A mutation is *caught* when a test fails that passes on the unmutated tree,
*missed* when none does, and *stale* when its text is no longer in the file (update the
list). A test that fails on the unmutated tree too (the machine, not the mutation: another
user's sandbox, a full disk) catches nothing: it is deselected, named in the output, and
the search goes on. The exit status is 0 only when every mutation is caught.

    scripts/mutation-check.sh                 # all of them
    scripts/mutation-check.sh kl_bonus ...    # some, by name
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Mutation:
    name: str
    what: str
    file: str
    edits: list[tuple[str, str]]
    first: tuple[str, ...] = ()  # test files to run before the rest (a quick verdict)


MUTATIONS = [
    Mutation("kl_bonus", "the KL penalty turned into a bonus", "src/assay/training/learner.py",
             [("loss_mat = loss_mat + algo.kl_coef * kl", "loss_mat = loss_mat - algo.kl_coef * kl")], ("tests/test_loss_terms.py",)),
    Mutation("entropy_penalty", "the entropy bonus turned into a penalty", "src/assay/training/learner.py",
             [("loss_mat = loss_mat - algo.entropy_coef * entropy", "loss_mat = loss_mat + algo.entropy_coef * entropy")], ("tests/test_loss_terms.py",)),
    Mutation("greedy_sampled", "\"greedy\" evaluation sampling at temperature 1", "src/assay/eval/policy.py",
             [("SamplingParams(max_new_tokens, temperature=0.0)", "SamplingParams(max_new_tokens, temperature=1.0)")], ("tests/test_eval.py",)),
    Mutation("eval_zero", "evaluation accuracy always 0", "src/assay/eval/policy.py",
             [("sum(greedy) / max(1, len(greedy))", "0.0 * sum(greedy)")], ("tests/test_eval.py",)),
    Mutation("heldout_trained", "held-out rows of user data also used for training", "src/assay/data/datasets.py",
             [("train = [s for s in shuffled if prompt_key(s) not in held]", "train = shuffled")], ("tests/test_data_splits.py",)),
    Mutation("heldout_trained_task", "a built-in task's training stream includes held-out problems", "src/assay/data/tasks/base.py",
             [("if in_heldout(s.prompt, self.heldout_fraction) != want_heldout:", "if want_heldout and not in_heldout(s.prompt, self.heldout_fraction):")],
             ("tests/test_data_splits.py",)),
    Mutation("micro_batch_share", "the micro-batch share dropped", "src/assay/training/learner.py",
             [("(loss * share).backward()", "loss.backward()")], ("tests/test_train_e2e.py",)),
    Mutation("resume_no_restore", "resume skips the model and optimizer restore", "src/assay/training/rl.py",
             [('self.model.load_state_dict(load_file(ckpt / "model.safetensors"), strict=False)', "pass"),
              ('self.opt.load_state_dict(state["optimizer"])', "pass")], ("tests/test_train_e2e.py",)),
    Mutation("resume_ignores_config", "--resume ignores the saved config", "src/assay/training/runs.py",
             [('data = read_record(ckpt)["config"]', "data = {}")], ("tests/test_cli_runs.py",)),
    Mutation("rng_not_restored", "resume skips the RNG restore", "src/assay/training/checkpoint.py",
             [('generator.set_state(state["sampler"])', "pass")], ("tests/test_train_e2e.py",)),
    Mutation("interrupt_mid_rollout_kept", "an interrupted step's prompts are not put back", "src/assay/training/rl.py",
             [("self._restore(snapshot)  # no weight changed", "pass  # no weight changed")], ("tests/test_train_e2e.py",)),
    Mutation("grpo_norm_flipped", "GRPO's normalisation flipped", "src/assay/algos/advantages.py",
             [("return _broadcast((rewards - mean) / (std + eps), rewards, mask)", "return _broadcast((mean - rewards) / (std + eps), rewards, mask)")],
             ("tests/test_grpo_math.py",)),
    Mutation("ppo_no_clip", "PPO's clip dropped", "src/assay/algos/losses.py",
             [("clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)", "clipped = -advantages * ratio")], ("tests/test_algos_losses.py",)),
    Mutation("sampler_temperature", "the sampler's logprobs ignore the temperature", "src/assay/rollout/torch_sampler.py",
             [("logp = torch.log_softmax(logits / params.temperature, dim=-1)  # [A, V]", "logp = torch.log_softmax(logits, dim=-1)  # [A, V]")],
             ("tests/test_sampler_contract.py",)),
    Mutation("skip_live_rows", "rows with a non-zero advantage left out of the update", "src/assay/training/learner.py",
             [("live = ((advantages != 0) & batch.mask.bool()).any(-1)", "live = ((advantages == 0) & batch.mask.bool()).any(-1)")],
             ("tests/test_numerics.py",)),
    Mutation("math_any_answer", "the math verifier accepts any extracted answer", "src/assay/rewards/math/reward.py",
             [('return RewardResult(1.0 if verdict == "correct" else 0.0, components={"correct": float(verdict == "correct")}, info=info)',
               'return RewardResult(1.0, components={"correct": 1.0}, info=info)')], ("tests/test_rewards_math.py",)),
    Mutation("math_thinking_read", "the math verifier reads the answer inside the thinking section", "src/assay/rewards/math/extract.py",
             [("    start, stop = response_span(text, think_tags(thinking))", "    start, stop = 0, len(text)")], ("tests/test_rewards_math_classes.py",)),
    Mutation("sandbox_no_cpu_limit", "no CPU-time limit in the sandbox", "src/assay/sandbox/harness.py",
             [("resource.setrlimit(resource.RLIMIT_CPU, (limit, limit + 1))", "pass")], ("tests/test_sandbox.py",)),
    Mutation("sandbox_network", "the sandbox shares the host's network", "src/assay/sandbox/isolation.py",
             [('args = [bwrap, "--unshare-all",', 'args = [bwrap, "--unshare-all", "--share-net",')], ("tests/test_sandbox.py",)),
]


def copy_tree(dest: Path) -> None:
    """The tracked and untracked-but-not-ignored files of the repository, copied to `dest`."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(m: Mutation, tree: Path) -> bool:
    path = tree / m.file
    text = path.read_text()
    for old, new in m.edits:
        if text.count(old) != 1:
            return False
        text = text.replace(old, new)
    path.write_text(text)
    return True


def _pytest(tree: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args], cwd=tree, env=env,
                          capture_output=True, text=True)


def first_failure(tree: Path, first: tuple[str, ...], skip: tuple[str, ...] = ()) -> str | None:
    """The node id of the first test that fails on `tree`, outside `skip` (None: the suite passes; `pytest exit N`
    when pytest failed without naming a test)."""
    deselect = [a for node in skip for a in ("--deselect", node)]
    for run in ([["-x", *deselect, *first], ["-x", *deselect]] if first else [["-x", *deselect]]):
        p = _pytest(tree, run)
        if p.returncode != 0:
            lines = [line for line in p.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
            return lines[0].split(" - ")[0].split(" ", 1)[1] if lines else f"pytest exit {p.returncode}"
    return None


def passes(tree: Path, node: str) -> bool:
    """Whether the test `node` passes on `tree` (the unmutated copy): a failure there is the machine's, not a mutation's catch.
    For a pytest failure that names no test (`pytest exit N`: the mutation broke collection), whether the clean tree collects."""
    if node.startswith("pytest exit"):
        return _pytest(tree, ["--collect-only"]).returncode == 0
    return _pytest(tree, [node]).returncode == 0


def catcher(tree: Path, clean: Path, first: tuple[str, ...], tries: int = 5) -> tuple[str | None, list[str]]:
    """`(the first test that fails on the mutated tree and passes on the clean one or None, the tests that failed on both)`."""
    env_failures: list[str] = []
    for _ in range(tries):
        node = first_failure(tree, first, tuple(env_failures))
        if node is None or passes(clean, node):
            return node, env_failures
        env_failures.append(node)
    return None, env_failures


def main(names: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not names or m.name in names]
    results = []
    with tempfile.TemporaryDirectory(prefix="assay-clean-") as clean_dir:
        clean = Path(clean_dir)
        copy_tree(clean)
        for m in chosen:
            results.append(judge(m, clean))
    print("\n| mutation | what | verdict | first failing test |\n|---|---|---|---|")
    for m, verdict, by in results:
        print(f"| `{m.name}` | {m.what} | {verdict} | {by if verdict == 'caught' else ''} |")
    return 0 if all(v == "caught" for _, v, _ in results) else 1


def judge(m: Mutation, clean: Path) -> tuple[Mutation, str, str | None]:
    """`(m, verdict, catching test)` for one mutation, printed as it is known."""
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="assay-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        by, env_failures = catcher(tree, clean, m.first) if apply(m, tree) else ("stale", [])
    verdict = "stale" if by == "stale" else "MISSED" if by is None else "caught"
    env = f"  (failing without the mutation too, not counted: {', '.join(env_failures)})" if env_failures else ""
    print(f"{verdict:>7}  {m.name:<26} {m.what}  ({time.time() - start:.0f}s){'  by ' + by if verdict == 'caught' else ''}{env}", flush=True)
    return m, verdict, by


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
