"""Multi-turn episodes on the bundled model: token-exact trajectories, masks, logprobs, tool failures, budgets, a run.

The model is the real bundled one and the sampler the real torch backend; the environments
are deterministic scripts (their observations do not depend on what a 1M-parameter
arithmetic model says), so every figure below is exact.
"""

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from assay.config import load_config
from assay.envs import Calculator, Environment, Step, ToolBox, ToolEnv, env_factory
from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.rollout.base import SamplingParams, make_sampler
from assay.rollout.multiturn import Budget, MultiTurn, episode_metrics
from assay.training import learner
from assay.types import RewardResult, Sample, Trajectory

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [Sample("a", "57+68="), Sample("b", "12+34="), Sample("c", "99+99=")]


class Recorder:
    """The real torch sampler, with every call's prompts and results kept for the checks."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.version = inner.version

    def generate(self, samples, n, params, generator=None):
        out = self.inner.generate(samples, n, params, generator)
        self.calls.append(([list(s.prompt_ids) for s in samples], out))
        return out


class Echo(Environment):
    """Answers each turn with `|k:<first 3 chars of the turn>|` and ends after `turns` turns with reward = turns taken / 10."""

    def __init__(self, turns: int = 3):
        self.turns, self.shown = turns, []

    def reset(self, sample):
        self.k = 0
        return sample.prompt

    def step(self, action):
        self.k += 1
        if self.k >= self.turns:
            return Step("", self.k / 10, True, {"finish_reason": "answer"})
        obs = f"|{self.k}:{action[:3]}|"
        self.shown.append(obs)
        return Step(obs, 0.0, False, {})


@pytest.fixture(scope="module")
def sampler(bundled):
    model, tok = bundled
    return make_sampler("torch", model, tok)


def run_loop(bundled, sampler, make_env, n=2, budget=None, max_new=6, seed=0):
    tok = bundled[1]
    rec = Recorder(sampler)
    envs = []

    def make():
        envs.append(make_env())
        return envs[-1]

    loop = MultiTurn(rec, tok, make, budget or Budget(max_turns=6, max_tokens=256))
    trajs = loop.run(PROMPTS, n, SamplingParams(max_new, 1.0), torch.Generator().manual_seed(seed))
    return trajs, rec, envs


def test_learner_sees_exactly_what_was_sampled_and_shown(bundled):
    model, tok = bundled
    trajs, rec, envs = run_loop(bundled, make_sampler("torch", model, tok), lambda: Echo(turns=4))
    assert len(trajs) == 6 and [t.group for t in trajs] == [0, 0, 1, 1, 2, 2]
    assert len(rec.calls) == 4  # one batched generate call per turn
    for i, (t, env) in enumerate(zip(trajs, envs)):
        assert len(t.turns) == 4 and t.finish_reason == "answer" and t.info["reward"] == pytest.approx(0.4)
        sampled = [rec.calls[k][1][i] for k in range(4)]  # what the sampler returned for this episode, turn by turn
        want_ids, want_mask, want_lp = [], [], []
        for k, s in enumerate(sampled):
            assert rec.calls[k][0][i] == t.prompt_ids + want_ids  # each turn's prompt extends the last, token for token
            assert t.turns[k] == (len(want_ids), len(want_ids) + len(s.completion_ids))
            want_ids += s.completion_ids
            want_mask += [1] * len(s.completion_ids)
            want_lp += s.logprobs
            if k < 3:
                shown = tok(env.shown[k], add_special_tokens=False)["input_ids"]
                assert len(shown) == len(env.shown[k])  # one token per character: the observation is all there
                want_ids += shown
                want_mask += [0] * len(shown)
                want_lp += [0.0] * len(shown)
        assert t.prompt_ids == tok(PROMPTS[i // 2].prompt, add_special_tokens=False)["input_ids"]
        assert (t.completion_ids, t.loss_mask, t.logprobs) == (want_ids, want_mask, want_lp)
    batch = learner.collate(trajs, [RewardResult(0.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    T = batch.response_len
    for i, t in enumerate(trajs):
        row = batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
        assert row == t.prompt_ids + t.completion_ids  # the learner's input ids
        env_tokens = [j for j, m in enumerate(t.loss_mask) if m == 0]
        assert env_tokens and all(batch.mask[i, j] == 0 for j in env_tokens)
        assert batch.mask[i, : len(t.loss_mask)].tolist() == [float(m) for m in t.loss_mask]
        assert batch.mask[i, len(t.loss_mask):].sum() == 0
    for fast in (False, True):  # the learner's recomputation (first update: the same weights) equals the sampler's
        with torch.no_grad():
            lp, _ = learner.token_logprobs(model, batch, 1.0, fast=fast)
        diff = ((lp - batch.old_logprobs).abs() * batch.mask)  # [B, T]
        # fp32 rounding: each turn's sampler call pads and batches the rows differently from the learner's one pass
        assert float(diff.max()) < 5e-5 and float(diff.sum() / batch.mask.sum()) < 5e-6, (fast, float(diff.max()))
    assert T == max(len(t.completion_ids) for t in trajs)


def test_metrics_count_turns_and_tokens(bundled, sampler):
    trajs, _, _ = run_loop(bundled, sampler, lambda: Echo(turns=3))
    m = episode_metrics(trajs)
    assert m["agent/turns_mean"] == 3.0
    assert m["agent/model_tokens"] == sum(sum(t.loss_mask) for t in trajs)
    assert m["agent/env_tokens"] == sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs) > 0
    assert m["agent/model_tokens"] + m["agent/env_tokens"] == sum(len(t.completion_ids) for t in trajs)
    assert m["agent/finish/answer"] == 1.0


def test_budgets_end_episodes(bundled, sampler):
    trajs, _, _ = run_loop(bundled, sampler, lambda: Echo(turns=99), budget=Budget(max_turns=2, max_tokens=256))
    assert all(t.finish_reason == "max_turns" and len(t.turns) == 2 and not t.finished for t in trajs)
    assert all(t.info["reward"] == 0.0 for t in trajs)
    trajs, _, _ = run_loop(bundled, sampler, lambda: Echo(turns=99), budget=Budget(max_turns=50, max_tokens=40))
    for t in trajs:
        assert t.finish_reason == "context"
        assert len(t.prompt_ids) + len(t.completion_ids) <= 40
    trajs, _, _ = run_loop(bundled, sampler, lambda: Echo(turns=99), budget=Budget(max_turns=50, max_tokens=256, max_seconds=1e-9))
    assert all(t.finish_reason == "time" and len(t.turns) == 1 for t in trajs)  # checked before each turn after the first


def test_an_environment_that_raises_ends_its_episode_unscored(bundled, sampler):
    class Broken(Echo):
        def step(self, action):
            raise RuntimeError("env bug")

    trajs, _, _ = run_loop(bundled, sampler, Broken)
    assert all(t.finish_reason == "env_error" and t.info["reward"] is None and t.info["env_error"] == "RuntimeError: env bug" for t in trajs)
    assert episode_metrics(trajs)["agent/env_errors"] == len(trajs)


# --- tools ---------------------------------------------------------------------------------------

def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def boom(x: str) -> str:
    """Always raises."""
    raise ValueError("kaboom")


_FOREVER = threading.Event()


def hang(x: str) -> str:
    """Never returns."""
    _FOREVER.wait()
    return x


def test_tool_schema_from_signature():
    assert ToolBox([add]).schemas == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


BAD_JSON = [
    ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>', "ok", "42"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2, </tool_call>', "parse_error", "malformed JSON"),
    ('<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>', "parse_error", "needs argument 'b'"),
    ('<tool_call>{"name": "add"', "parse_error", "unterminated"),
    ('<tool_call>{"name": "sub", "arguments": {}}</tool_call>', "unknown_tool", "unknown tool 'sub'"),
    ('<tool_call>{"name": "boom", "arguments": {"x": "1"}}</tool_call>', "tool_error", "ValueError: kaboom"),
    ('<tool_call>{"name": "hang", "arguments": {"x": "1"}}</tool_call>', "timeout", "ran past 0.2s"),
]
BAD_BRACKET = [("[add 2 40]", "ok", "=42"), ("[add:2 40]", "ok", "=42"), ("[add 2]", "parse_error", "needs argument 'b'"), ("[add two 40]", "parse_error", "invalid literal"),
               ("[add 2 40", "parse_error", "a call is [name arguments]"), ("[sub 1 2]", "unknown_tool", "unknown tool"),
               ("[boom 1]", "tool_error", "kaboom"), ("[hang 1]", "timeout", "ran past")]


@pytest.mark.parametrize("syntax,cases", [("json", BAD_JSON), ("bracket", BAD_BRACKET)])
def test_every_bad_call_is_an_observation_and_an_outcome(syntax, cases):
    box = ToolBox([add, boom, hang], syntax=syntax, timeout_s=0.2)
    for text, outcome, says in cases:
        (call,) = box.run(text)
        assert call.outcome == outcome and says in call.observation, (text, call)


class ScriptedTools(ToolEnv):
    """Tools `add`, `boom`, `hang`; turn k runs the script's k-th call whatever the model wrote (then the model's text is the answer)."""

    SCRIPT = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>',
              '<tool_call>{"name": "add", "arguments": {"a": 2, </tool_call>',
              '<tool_call>{"name": "sub", "arguments": {}}</tool_call>',
              '<tool_call>{"name": "boom", "arguments": {"x": "1"}}</tool_call>',
              '<tool_call>{"name": "hang", "arguments": {"x": "1"}}</tool_call>']

    def __init__(self):
        super().__init__([add, boom, hang], "json", timeout_s=0.2)
        self.k = 0

    def step(self, action):
        self.k += 1
        return super().step(self.SCRIPT[self.k - 1] if self.k <= len(self.SCRIPT) else action)

    def answer(self, text):
        return 1.0


def test_bad_calls_inside_episodes_are_counted_and_survived(bundled, sampler):
    trajs, _, _ = run_loop(bundled, sampler, ScriptedTools, n=1, budget=Budget(max_turns=8, max_tokens=256))
    assert all(t.finish_reason == "answer" and len(t.turns) == 6 and t.info["reward"] == 1.0 for t in trajs)
    m = episode_metrics(trajs)
    assert {k: m[f"agent/tool_calls/{k}"] for k in ("ok", "parse_error", "unknown_tool", "tool_error", "timeout")} == \
        {"ok": 3, "parse_error": 3, "unknown_tool": 3, "tool_error": 3, "timeout": 3}
    assert m["agent/tool/add"] == 3 and m["agent/tool/hang"] == 3


def test_calculator_env():
    env = Calculator()
    assert env.reset(Sample("q", "1234+5678=", answer="6912")) == "1234+5678="
    assert env.step("[calc 1234+5678]") == Step("=6912", 0.0, False, env.step("[calc 1234+5678]").info)
    assert env.step("[calc __import__('os')]").info["tool_calls"][0].outcome == "tool_error"
    assert env.step("6912").reward == 1.0
    assert env.step("6913").reward == 0.0


def test_envs_by_name_and_by_path():
    assert isinstance(env_factory("calculator")(), Calculator)
    assert isinstance(env_factory("assay.envs.calculator:Calculator", {"syntax": "json"})(), Calculator)
    with pytest.raises(AssayError, match="unknown environment 'nope'; known: calculator"):
        env_factory("nope")
    with pytest.raises(AssayError, match="env 'calculator': .*unexpected keyword argument 'bogus'"):
        env_factory("calculator", {"bogus": 1})


def test_config_block_is_validated():
    cfg = load_config(None, ["env.name=calculator", "env.max_turns=3"])
    assert cfg.env.name == "calculator" and cfg.env.max_turns == 3 and load_config(None, []).env is None
    with pytest.raises(AssayError, match="env.max_turns=0"):
        load_config(None, ["env.name=calculator", "env.max_turns=0"])
    with pytest.raises(AssayError, match="unknown config key 'env.turns'"):
        load_config(None, ["env.name=calculator", "env.turns=3"])
    with pytest.raises(AssayError, match="inject_gold"):
        load_config(None, ["env.name=calculator", "selection.inject_gold=true"])
    for example in ("calculator-agent", "sql-agent"):  # the examples are valid configs (sql-agent also runs in test_agents_sql)
        assert load_config(str(ROOT / "examples" / f"{example}.yaml")).env.max_turns == 3


def test_assay_train_with_an_env_runs_end_to_end(tmp_path):
    args = ["env.name=calculator", "env.max_turns=3", "rollout.prompts_per_step=4", "rollout.group_size=4", "train.steps=2",
            "train.eval_n=6", "rollout.max_new_tokens=8", "reward_workers=0", "train.threads=1", f"output_dir={tmp_path}", "run_name=r"]
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = read_metrics(tmp_path / "r" / "metrics.jsonl")
    steps = [r for r in rows if "actor/loss" in r]
    assert len(steps) == 2 and (tmp_path / "r" / "final" / "model.safetensors").is_file()
    for r in steps:
        assert r["agent/turns_mean"] >= 1 and r["agent/model_tokens"] > 0 and "agent/tool_calls/timeout" in r
        assert r["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and r["actor/logprob_diff"] < 1e-5
        assert r["reward/count"] == 16
    docs = (ROOT / "docs" / "metrics.md").read_text()
    agent_keys = {k for r in steps for k in r if k.startswith("agent/")}
    families = [re.compile(re.sub(r"<[a-z_]+>", "[^/]+", k) + "$") for k in re.findall(r"`(agent/[a-z_<>/]+)`", docs)]
    assert agent_keys and all(any(f.match(k) for f in families) for k in agent_keys)  # every agent metric is defined
    assert (tmp_path / "r" / "agents.png").is_file() and 'alt="agents" title="agents.png"' in (tmp_path / "r" / "report.html").read_text()
    # each sampled episode says how it went, not how it ended: a right and a wrong answer are not both "answer"
    done = [c for row in read_metrics(tmp_path / "r" / "samples.jsonl") for c in row["completions"]]
    assert done and all(c["reason"] == ("correct" if c["reward"] >= 1 else "wrong") for c in done if c["reason"] not in ("max_turns", "context"))
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", "env.name=nope", f"output_dir={tmp_path}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1].startswith("assay: error: unknown environment 'nope'")


def test_the_episode_reward_gives_the_episodes_outcome():
    """`reason` is the outcome: the environment's own word, else correct / partial / wrong by the reward, or how the episode
    was cut short; how it ended stays in `finish`."""
    from assay.envs.base import EpisodeReward

    def ep(reward, finish="answer", said=None):
        return Trajectory(Sample("0", "p", None), "x", [], [], [], True, finish_reason=finish, info={"reward": reward, "outcome": said})

    got = [(r.info["reason"], r.info["finish"]) for r in EpisodeReward()([ep(1.0), ep(0.0), ep(0.5), ep(0.0, "max_turns"), ep(None),
                                                                        ep(0.0, "submit", "wrong rows"), ep(1.0, "pass")])]
    assert got == [("correct", "answer"), ("wrong", "answer"), ("partial", "answer"), ("max_turns", "max_turns"), ("unscored", "answer"),
                   ("wrong rows", "submit"), ("correct", "pass")]


def test_an_env_run_resumes_bit_for_bit(tmp_path):
    from _train_helpers import weights

    from assay.training.rl import Trainer

    def cfg(name, steps):
        return load_config(None, [f"output_dir={tmp_path}", f"run_name={name}", f"train.steps={steps}", "train.eval_every=0",
                                  "train.eval_n=8", "train.save_every=1", "reward_workers=0", "rollout.prompts_per_step=4",
                                  "rollout.group_size=4", "train.threads=1", "optim.warmup_steps=0", "optim.lr=1e-3",
                                  "env.name=_agents_env:Retry", "env.max_turns=3"])

    full = Trainer(cfg("full", 4)).fit(progress=False).run_dir
    cut = Trainer(cfg("cut", 2)).fit(progress=False).run_dir
    Trainer(cfg("cut", 4), run_dir=cut, resume=True).fit(progress=False)

    def steps(d):
        return [{k: v for k, v in r.items() if not k.startswith("perf/") and not k.endswith("_per_s")}
                for r in read_metrics(d / "metrics.jsonl") if "actor/loss" in r]

    assert steps(full) == steps(cut) and len(steps(full)) == 4
    assert any(r["agent/turns_mean"] > 1 and r["agent/env_tokens"] > 0 for r in steps(full))  # retries happened
    wf, wc = weights(full / "final"), weights(cut / "final")
    assert all(wf[k].equal(wc[k]) for k in wf)
    assert all(r["actor/grad_norm"] > 0 for r in steps(full))


def test_isolated_tools_are_killed_at_their_deadline():
    from _agents_env import crash, double, fail, hang_forever

    box = ToolBox([double, hang_forever, crash, fail], syntax="bracket", timeout_s=1.0, isolate=True, workers=1)
    assert [c.observation for c in box.run("[double 21]")] == ["=42"]
    start = time.monotonic()
    (call,) = box.run("[hang_forever x]")
    assert call.outcome == "timeout" and time.monotonic() - start < 6.0  # a 1 s deadline; unstopped the tool hangs for ever
    (call,) = box.run("[crash x]")
    assert call.outcome == "tool_error" and "crashed" in call.observation
    (call,) = box.run("[fail x]")
    assert call.outcome == "tool_error" and "ValueError: kaboom" in call.observation
    assert [c.observation for c in box.run("[double 4]")] == ["=8"]  # the replaced worker answers


@pytest.mark.parametrize("module", ["assay.envs.tools", "assay.envs.calculator"])
def test_docstring_examples(module):
    import doctest
    import importlib

    assert doctest.testmod(importlib.import_module(module)).failed == 0


def test_held_out_episodes_stay_out_of_the_step_metrics(bundled, sampler):
    from assay.rollout.multiturn import EpisodeSampler, counting_off

    episodes = EpisodeSampler(sampler, MultiTurn(sampler, bundled[1], lambda: Echo(turns=2), Budget(4, 256)))
    with counting_off(episodes):
        episodes.generate(PROMPTS, 2, SamplingParams(4, 0.0))
    assert episodes.metrics() == {} and episodes.counting
    episodes.generate(PROMPTS, 2, SamplingParams(4, 1.0), torch.Generator().manual_seed(0))
    assert episodes.metrics()["agent/turns_mean"] == 2.0 and episodes.metrics() == {}  # asked once, then empty
