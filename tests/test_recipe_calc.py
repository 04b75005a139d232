"""The tiny-calc recipe: its tool-call demonstrations are what the calculator environment shows, token for token,
and the committed warm-up model calls the tool.
"""

import random

import pytest
import torch

from assay.config import EnvConfig
from assay.data.tasks import make_task
from assay.envs import Calculator, env_factory
from assay.models import load_policy
from assay.recipes.build import load_recipe
from assay.recipes.demos import Script, episode_rows, tool_demos
from assay.rollout.base import SamplingParams
from assay.rollout.multiturn import Budget, MultiTurn, episode_sampler
from assay.rollout.torch_sampler import TorchSampler

RECIPE = load_recipe("tiny-calc")


@pytest.fixture(scope="module")
def calc_model():
    model, tok = load_policy("tiny-calc")
    return model.eval(), tok


def encode(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_demonstrations_are_the_environments_episodes(calc_model):
    _, tok = calc_model
    task = make_task(RECIPE["task"], **RECIPE["task_args"])
    samples = [s for s, _ in zip(task.stream("train", 0), range(40))]
    demos = tool_demos(samples, tok, env_factory("calculator", {"syntax": "bracket"}), 0.5, "offset", random.Random(0))
    eos = tok.eos_token_id
    used = 0
    for s, t in zip(samples, demos):
        env = Calculator()  # the episode by hand: the environment's own observations, encoded as the loop encodes them
        assert t.prompt_ids == encode(tok, env.reset(s)) == encode(tok, s.prompt)
        if t.info["tool_calls"]:
            used += 1
            call = f"[calc:{s.prompt[:-1]}]"
            obs = env.step(call).observation
            assert obs == f"={s.answer}"
            want = [(encode(tok, call) + [eos], 1), (encode(tok, obs), 0), (encode(tok, str(s.answer)) + [eos], 1)]
            assert t.info["reward"] == 1.0 and t.info["tool_calls"] == [("calc", "ok")]
        else:  # answered at once, carelessly (off by 1, 2 or 10)
            answer = t.completion
            assert int(answer) - int(s.answer) in (-10, -2, -1, 1, 2, 10) and t.info["reward"] == 0.0
            want = [(encode(tok, answer) + [eos], 1)]
        assert t.completion_ids == [i for ids, _ in want for i in ids]
        assert t.loss_mask == [m for ids, m in want for _ in ids]
        ids, labels = episode_rows([t])[0]
        assert ids == t.prompt_ids + t.completion_ids
        assert [i for i, l in zip(ids, labels) if l != -100] == [i for i, m in zip(t.completion_ids, t.loss_mask) if m]
    assert 10 < used < 30  # tool_rate 0.5 of 40


def test_a_sampled_episode_is_its_own_demonstration(calc_model):
    """An RL episode of the committed model, replayed as a script, gives the same tokens and mask (the layout RL trains on)."""
    model, tok = calc_model
    task = make_task(RECIPE["task"], **RECIPE["task_args"])
    env = EnvConfig(**RECIPE["env"])
    loop = episode_sampler(TorchSampler(model, tok), model, tok, env, 256)
    episodes = loop.generate(task.heldout(32), 1, SamplingParams(20, temperature=1.0), torch.Generator().manual_seed(0))
    ended = lambda t: all(t.completion_ids[b - 1] == tok.eos_token_id for _, b in t.turns)  # every turn ended on EOS, as scripted ones do
    called = [t for t in episodes if t.info["tool_calls"] and ended(t)]
    assert called
    for t in called:
        turns = {t.sample.id: [tok.decode(t.completion_ids[a:b], skip_special_tokens=True) for a, b in t.turns]}
        replay = MultiTurn(Script(tok, turns), tok, env_factory("calculator", env.args), Budget(env.max_turns, 256)).run(
            [t.sample], 1, SamplingParams(20, temperature=0.0))[0]
        assert (replay.prompt_ids, replay.completion_ids, replay.loss_mask) == (t.prompt_ids, t.completion_ids, t.loss_mask)


def test_the_warm_up_model_calls_the_tool_on_held_out_prompts(calc_model):
    model, tok = calc_model
    task = make_task(RECIPE["task"], **RECIPE["task_args"])
    heldout = task.heldout(RECIPE["eval"]["n"])
    assert not {s.prompt for s in heldout} & {s.prompt for s, _ in zip(task.stream("train", 0), range(2000))}
    loop = episode_sampler(TorchSampler(model, tok), model, tok, EnvConfig(**RECIPE["env"]), 256)
    episodes = loop.generate(heldout[:64], 1, SamplingParams(20, temperature=1.0), torch.Generator().manual_seed(0))
    calls = [c for t in episodes for c in t.info["tool_calls"]]
    assert sum(1 for _, outcome in calls if outcome == "ok") >= 5  # it calls the tool, well formed, on some prompts
    assert any(t.info["tool_calls"] and t.info["reward"] == 1.0 for t in episodes)  # and copies a result as its answer
    assert sum(1 for t in episodes if not t.info["tool_calls"]) >= 5  # but not always: RL has a rate to raise
