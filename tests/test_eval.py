"""Evaluation measures what it says: greedy is the argmax decode, pass@k is a real pass@k,
and the bundled model scores what its recipe recorded."""

import json
from pathlib import Path

import pytest
import torch

from assay.data.tasks import make_task
from assay.eval.policy import evaluate, pass_at_k
from assay.models import BUNDLED_DIR, load_policy
from assay.rewards.base import REWARDS
from assay.rewards.spec import load_builtins
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.types import RewardResult

load_builtins()
RECIPE_TASK = {"terms": 2, "max_value": 99, "ops": "+"}  # recipes/tiny-arith/recipe.yaml


@pytest.fixture(scope="module")
def bundled():
    model, tok = load_policy("tiny-arith")
    task = make_task("arithmetic", **RECIPE_TASK)
    return model, tok, task, REWARDS.get(task.reward)()


def argmax_decode(model, tok, prompt: str, max_new: int) -> list[int]:
    """Greedy decoding written out: the whole sequence through the model at every step, no cache."""
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(input_ids=torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] == tok.eos_token_id:
                break
    return out


def test_greedy_is_deterministic_and_is_the_argmax_decode(bundled):
    model, tok, task, reward = bundled
    problems = task.heldout(60)
    sampler = TorchSampler(model, tok)
    greedy = SamplingParams(6, temperature=0.0)
    runs = [sampler.generate(problems, 1, greedy, torch.Generator().manual_seed(s)) for s in (0, 1)]
    assert [t.completion_ids for t in runs[0]] == [t.completion_ids for t in runs[1]]
    by_hand = [argmax_decode(model, tok, p.prompt, 6) for p in problems]
    assert [t.completion_ids for t in runs[0]] == by_hand
    # evaluate() reports the accuracy of exactly these completions
    want = sum(r.score >= 1.0 for r in reward(runs[0])) / len(problems)
    assert 0.0 < want < 1.0
    assert evaluate(sampler, reward, problems, 6).accuracy == want


def test_pass_at_k_is_at_least_the_per_sample_accuracy_and_grows_with_k(bundled):
    model, tok, task, reward = bundled
    problems = task.heldout(40)
    sampler = TorchSampler(model, tok)
    samples = sampler.generate(problems, 8, SamplingParams(6, 1.0), torch.Generator().manual_seed(0))
    correct = [r.score >= 1.0 for r in reward(samples)]
    per_sample = sum(correct) / len(correct)
    by_problem = [sum(correct[8 * i : 8 * i + 8]) for i in range(len(problems))]
    at = {k: sum(pass_at_k(8, c, k) for c in by_problem) / len(problems) for k in (1, 2, 4, 8)}
    assert at[1] == pytest.approx(per_sample)  # pass@1 is the mean sample accuracy
    assert at[1] <= at[2] <= at[4] <= at[8]
    assert at[8] == sum(c > 0 for c in by_problem) / len(problems)  # pass@n: any of the n right
    r = evaluate(sampler, reward, problems, 6, k=8, seed=0)
    assert r.pass_at_k >= r.accuracy and r.pass_at_k > per_sample
    # the sampled accuracy is the share of exactly the pass@k draws the verifier accepts (one chunk of 40 problems × 8
    # here, so the draws are those of one generate call), and pass@1 of those draws; the same seed, the same draws
    one = evaluate(sampler, reward, problems, 6, k=8, seed=0, batch_size=8 * len(problems))
    drawn = [x.score >= 1.0 for x in reward(sampler.generate(problems, 8, SamplingParams(6, 1.0), torch.Generator().manual_seed(0)))]
    groups = [sum(drawn[8 * i : 8 * i + 8]) for i in range(len(problems))]
    assert one.sampled == sum(drawn) / len(drawn) == pytest.approx(sum(pass_at_k(8, c, 1) for c in groups) / len(problems))
    assert one.pass_at_k == pytest.approx(sum(pass_at_k(8, c, 8) for c in groups) / len(problems))
    assert evaluate(sampler, reward, problems, 6, k=8, seed=0, batch_size=8 * len(problems)).sampled == one.sampled
    assert r.as_dict()["sampled_accuracy"] == r.sampled and "sampled_accuracy" not in evaluate(sampler, reward, problems, 6).as_dict()


def test_the_sampled_accuracy_leaves_out_what_the_verifier_cannot_score(bundled):
    """A sample the verifier cannot score is not counted as wrong; with nothing scored there is no figure (not a 0 that
    the `divergence` monitor would read as a fall)."""
    model, tok, task, reward = bundled
    problems = task.heldout(12)
    sampler = TorchSampler(model, tok)

    def every_other(trajs):  # the real verifier on every other sample, "cannot score" on the rest
        return [r if i % 2 == 0 else RewardResult(None) for i, r in enumerate(reward(trajs))]

    full = evaluate(sampler, reward, problems, 6, k=4, seed=0, batch_size=48)
    half = evaluate(sampler, every_other, problems, 6, k=4, seed=0, batch_size=48)
    drawn = [r.score >= 1.0 for r in reward(sampler.generate(problems, 4, SamplingParams(6, 1.0), torch.Generator().manual_seed(0)))]
    assert full.sampled == sum(drawn) / len(drawn) and half.sampled == sum(drawn[0::2]) / len(drawn[0::2])
    assert half.pass_at_k == 0.0  # no problem had all four samples scored: an empty pass@k, as before
    nothing = evaluate(sampler, lambda trajs: [RewardResult(None) for _ in trajs], problems, 6, k=4, seed=0)
    assert nothing.sampled is None and "sampled_accuracy" not in nothing.as_dict()


def test_the_bundled_model_scores_what_its_recipe_recorded(bundled):
    model, tok, task, reward = bundled
    pinned = json.loads((BUNDLED_DIR / "tiny-arith" / "model" / "eval.json").read_text())
    r = evaluate(TorchSampler(model, tok), reward, task.heldout(pinned["n"]), 6, k=pinned["k"] if "k" in pinned else 8, seed=pinned["seed"])
    assert r.accuracy == pytest.approx(pinned["accuracy"], abs=2 / pinned["n"])  # greedy: to a problem or two of rounding
    assert r.pass_at_k == pytest.approx(pinned["pass@8"], abs=0.01)
    assert r.mean_length == pytest.approx(pinned["mean_length"], abs=0.01)


def test_the_trainers_held_out_accuracy_is_evaluate(bundled, tmp_path):
    """Row 0 of a run is the untouched model's held-out greedy accuracy, the same figure `evaluate` gives."""
    from assay.config import load_config
    from assay.report.metrics import read_metrics
    from assay.training.rl import Trainer

    model, tok, task, reward = bundled
    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=e", "train.steps=1", "train.eval_n=120", "train.eval_every=0",
                             "train.save_every=0", "reward_workers=0", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             f"data.task_args={json.dumps(RECIPE_TASK)}"])
    rows = read_metrics(Trainer(cfg).fit(progress=False).run_dir / "metrics.jsonl")
    want = evaluate(TorchSampler(model, tok), reward, task.heldout(120), 6).accuracy
    assert rows[0]["step"] == 0 and rows[0]["eval/accuracy"] == want > 0


def _assay(*args):
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "assay.cli", *args], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_eval_a_data_file_with_the_training_field_mapping_and_any_reward(bundled, tmp_path):
    model, tok, task, reward = bundled
    problems = task.heldout(40)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"q": p.prompt, "sol": p.answer}) + "\n" for p in problems))
    out = _assay("eval", "--data", str(data), "--fields", "{prompt: q, answer: sol}", "--reward", "{name: arithmetic}", "--k", "0", "--json",
                 "--workers", "0")
    want = evaluate(TorchSampler(model, tok), reward, problems, 6).accuracy
    assert out["data"] == str(data) and out["n"] == 40 and out["accuracy"] == want


def test_eval_a_run_on_its_own_held_out_data(tiny_model_dir, tmp_path):
    from assay.config import load_config
    from assay.training.rl import Trainer

    rows = [{"question": f"{i}+{i}=", "solution": str(2 * i)} for i in range(60)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, [f"model.path={tiny_model_dir}", f"output_dir={tmp_path}", "run_name=r", "train.steps=1", "data.task=null",
                             f"data.path={data}", "data.fields={prompt: question, answer: solution}", "reward=arithmetic",
                             "data.eval_fraction=0.25", "reward_workers=0", "rollout.max_new_tokens=4"])
    run = Trainer(cfg).fit(progress=False).run_dir
    out = _assay("eval", "--run", str(run), "--k", "2", "--json", "--workers", "0")
    assert out["model"] == str(run / "final") and out["run"] == str(run) and out["n"] == 15  # its 25% held out, with its reward
    assert 0.0 <= out["accuracy"] <= 1.0 and 0.0 <= out["pass@2"] <= 1.0


def test_a_learned_reward_is_a_mean_beside_the_verified_accuracy(bundled, tmp_path):
    """A reward model's scores are no verdicts: `assay eval --reward rm` reports their mean, and accuracy and pass@k
    from the task's own verifier (the same figures as `--reward arithmetic`), never "scores ≥ 1" as accuracy."""
    from assay.rm.model import build_rm, save_rm

    model, tok = build_rm("tiny-arith", seed=1)
    with torch.no_grad():
        model.score.weight.mul_(1e3)  # scores far from 0/1, so "≥ 1" would be a number unrelated to right answers
    save_rm(tmp_path / "rm", model, tok, {"max_length": 64})
    from assay.api import evaluate as evaluate_api

    rm = f"{{name: rm, args: {{path: {tmp_path / 'rm'}}}}}"
    out = evaluate_api(n=20, k=2, workers=0, reward=rm)
    checked = evaluate_api(n=20, k=2, workers=0, reward="arithmetic")
    assert out["verifier"] == "arithmetic" and out["accuracy"] == checked["accuracy"] and out["pass@2"] == checked["pass@2"]
    assert isinstance(out["mean_reward"], float) and "mean_reward" not in checked
    nothing_checks = tmp_path / "plain.jsonl"  # data with no verifier of its own: the mean alone
    nothing_checks.write_text("".join(json.dumps({"prompt": p.prompt}) + "\n" for p in make_task("arithmetic").heldout(5)))
    alone = _assay("eval", "--n", "5", "--k", "2", "--json", "--workers", "0", "--data", str(nothing_checks), "--reward", rm)
    assert "accuracy" not in alone and "pass@2" not in alone and alone["verifier"] is None and isinstance(alone["mean_reward"], float)


CALC = "{parts: [{task: arithmetic, args: {min_value: 1000, max_value: 9999, ops: '+'}}, {task: arithmetic, args: {min_value: 10, max_value: 99, ops: '*'}}]}"


@pytest.mark.slow  # 13-17 s: the default suite stays near ten minutes (CI runs the slow tier)
def test_eval_runs_episodes_with_an_environment_as_training_does(tmp_path):
    """tiny-calc answers right mostly by calling the calculator: scored on plain prompts it looks almost useless."""
    import yaml

    from assay.config import load_config
    from assay.eval.policy import evaluate
    from assay.rewards.executor import RewardExecutor
    from assay.rewards.spec import build_reward
    from assay.rollout.multiturn import episode_sampler

    common = ["--model", "tiny-calc", "--task", "mix", "--task-args", CALC, "--n", "100", "--k", "0", "--max-new-tokens", "20", "--json",
              "--workers", "0"]
    env = "{name: calculator, args: {syntax: bracket}, max_turns: 3}"
    episodes, plain = _assay("eval", *common, "--env", env), _assay("eval", *common)
    assert episodes["env"] == "calculator" and "env" not in plain
    assert episodes["tool_calls_per_episode"] > 0 and episodes["turns_mean"] > 1
    assert episodes["accuracy"] > plain["accuracy"]

    # the same number as training's held-out evaluation: the episode sampler and the episode reward
    cfg = load_config(str(Path(__file__).parents[1] / "examples" / "calculator-agent.yaml"), [f"output_dir={tmp_path}"])
    model, tok = load_policy("tiny-calc")
    problems = make_task("mix", **yaml.safe_load(CALC)).heldout(100)
    sampler = episode_sampler(TorchSampler(model, tok), model, tok, cfg.env, model.config.max_position_embeddings)
    with RewardExecutor(build_reward("episode"), workers=0) as ex:
        assert evaluate(sampler, ex.score, problems, 20).accuracy == episodes["accuracy"]

    # a run folder brings its environment and its reward
    run = tmp_path / "calc-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump()))
    out = _assay("eval", "--run", str(run), "--model", "tiny-calc", "--n", "100", "--k", "0", "--json", "--workers", "0")
    assert out["env"] == "calculator" and out["tool_calls_per_episode"] > 0


def test_eval_with_an_unknown_environment_is_one_line():
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "assay.cli", "eval", "--env", "{name: nowhere}", "--k", "0", "--n", "5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "nowhere" in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "assay.cli", "eval", "--env", "{name: calculator, max_turns: 0}", "--k", "0", "--n", "5"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "max_turns" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_split_episode_counts_once_and_keeps_the_pass_at_k_groups_aligned():
    """A chat episode split in parts (`info["segment"]`/`["segments"]`) is one episode: counting every part
    weighed it twice and shifted every later problem's pass@k group by one."""
    from assay.types import RewardResult, Sample, Trajectory

    class Splitting:  # problem "a": every episode splits in two parts, the last scoring 1; problem "b": one part scoring 0
        def generate(self, samples, n, params, generator=None):
            out = []
            for s in samples:
                for _ in range(n):
                    if s.id == "a":
                        out += [Trajectory(s, "part", [], [], [], True, info={"segment": 0, "segments": 2, "reward": 1.0}),
                                Trajectory(s, "end", [], [], [], True, info={"segment": 1, "segments": 2, "reward": 1.0})]
                    else:
                        out.append(Trajectory(s, "x", [], [], [], True, info={"reward": 0.0}))
            return out

    score = lambda trajs: [RewardResult(t.info["reward"]) for t in trajs]  # noqa: E731
    r = evaluate(Splitting(), score, [Sample("a", "p", None), Sample("b", "p", None)], 4, k=2)
    assert r.accuracy == 0.5 and r.pass_at_k == 0.5 and r.unscored == 0


def test_a_run_logs_the_sampled_accuracy_of_the_same_draws_at_every_evaluation(tmp_path, bundled):
    """`train.eval_samples`: the run's held-out sampled accuracy is `evaluate`'s on the same problems and seed, and an
    unchanged policy evaluated twice gets the same draws (two evaluations differ by what the policy learned)."""
    from assay.config import load_config
    from assay.training.rl import Trainer

    model, tok, _, reward = bundled
    cfg = load_config(None, [f"output_dir={tmp_path}", "run_name=s", "train.steps=1", "train.eval_n=40", "train.eval_samples=4",
                             "train.save_every=0", "reward_workers=0", "train.threads=1"])
    trainer = Trainer(cfg)
    first = trainer.evaluate()
    assert first == trainer.evaluate()
    want = evaluate(TorchSampler(model, tok), reward, trainer.source.heldout, cfg.rollout.max_new_tokens, k=4, seed=cfg.seed,
                    temperature=cfg.rollout.temperature)
    assert 0.0 < want.sampled < 1.0
    assert first["eval/sampled_accuracy"] == want.sampled and first["eval/pass@4"] == want.pass_at_k
    assert first["eval/accuracy"] == want.accuracy
