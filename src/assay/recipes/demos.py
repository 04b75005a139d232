"""Tool-call demonstrations, rendered by the multi-turn loop itself (token-exact with what RL sees).

A demonstration is an episode whose model turns are scripted: `Script` is a `Sampler` that
returns the next scripted turn (its text encoded, then EOS) instead of sampling, and
`assay.rollout.multiturn.MultiTurn` runs the environment around it. So the prompt, the
observations and the layout of a demonstration are exactly what the environment shows the
model during RL, and its `loss_mask` marks the model's turns. Which demonstrations call the
tool and which answer at once (with a careless answer) is the recipe's `demos:` block.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any, Callable, Iterable

from assay.recipes.noisy import CORRUPTIONS
from assay.rollout.base import SamplingParams
from assay.rollout.multiturn import Budget, MultiTurn
from assay.types import Sample, Trajectory


class Script:
    """A `Sampler` that plays scripted turns: `turns[sample.id][k]` is the k-th model turn of that episode."""

    version = 0

    def __init__(self, tokenizer: Any, turns: dict[str, list[str]]):
        self.tokenizer, self.turns = tokenizer, turns
        self.eos = tokenizer.eos_token_id

    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: Any = None) -> list[Trajectory]:
        out = []
        for s in samples:
            k = list(s.prompt_ids).count(self.eos)  # model turns so far (each ended with EOS)
            text = self.turns[s.id][k]
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [self.eos]
            out.extend(Trajectory(s, text, list(s.prompt_ids), ids, [0.0] * len(ids), True) for _ in range(n))
        return out


def calc_turns(s: Sample, use_tool: bool, corruption: str, rng: random.Random) -> list[str]:
    """The model turns of one calculator demonstration: `[calc:EXPR]` then the result, or a careless answer at once.

    The call is written `[calc:EXPR]`: the bundled tokenizer drops spaces, so `[calc EXPR]`
    would reach the environment as `[calcEXPR]`, which is no call.
    """
    if use_tool:
        return [f"[calc:{s.prompt.rstrip('=')}]", str(s.answer)]
    return [CORRUPTIONS[corruption](s, rng)]


def tool_demos(samples: Iterable[Sample], tokenizer: Any, make_env: Callable[[], Any], tool_rate: float, corruption: str,
               rng: random.Random, max_tokens: int = 256) -> list[Trajectory]:
    """Episodes of `make_env()` in which a fraction `tool_rate` of demonstrations call the tool, the rest answer carelessly."""
    samples = [replace(s, id=f"demo-{i}") for i, s in enumerate(samples)]  # unique ids: one script per episode
    turns = {s.id: calc_turns(s, rng.random() < tool_rate, corruption, rng) for s in samples}
    loop = MultiTurn(Script(tokenizer, turns), tokenizer, make_env, Budget(max_turns=max(map(len, turns.values())), max_tokens=max_tokens))
    return loop.run(samples, 1, SamplingParams(max_tokens, temperature=0.0))


def episode_rows(trajs: list[Trajectory]) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of each episode for SFT: labels are the model's tokens, −100 on the prompt and observations."""
    return [(t.prompt_ids + t.completion_ids, [-100] * len(t.prompt_ids) + [i if m else -100 for i, m in zip(t.completion_ids, t.loss_mask)])
            for t in trajs]
