"""The multi-turn rollout loop: generation and environment steps, interleaved, token-exact.

Each episode is one environment instance and one growing token sequence. A turn gives the
sampler (any backend, through the `Sampler` interface) the sequence so far as `prompt_ids`;
the tokens it samples are appended exactly as sampled (loss mask 1, their logprobs); the
environment reads the decoded turn and answers; the answer's tokens, encoded once, are
appended after them (loss mask 0, logprob 0.0). Nothing the model produced is ever decoded
and encoded again, and every turn checks that the sampler was given, and kept, exactly the
sequence so far.

How an observation becomes tokens:

- plain text (a model without a chat template, such as the bundled one): the observation
  text, encoded with no special tokens;
- chat (`chat=True`): the conversation is also kept as messages; the observation is a
  message (role `Environment.chat_role`), and its tokens are the difference between the
  template's rendering of the conversation with it (and the generation prompt) and without
  it, plus whatever the template puts after the model's end-of-turn token (the separator a
  naive concatenation drops). When the template does not render the conversation so far
  as a prefix of the one with the observation (a template that rewrites history, such as
  one that strips earlier reasoning), the episode cannot continue token for token: it is
  split explicitly, the part so far becomes one trajectory and the rest starts a new one
  whose prompt is the template's new rendering. Each part carries the episode's reward
  (`info["segment"]`, `info["segments"]`), so a split episode counts once per part in its
  group's baseline; `agent/splits` counts them.

Pictures (a vision-language policy, docs/multimodal.md): in chat, an observation — the first one
(`reset`) or any later one (`step`) — may be a list of content parts, text and
`{"type": "image", "image": PIL image}`. The conversation is then rendered by the model's processor
(`assay.vision.inputs.render_pictures`), which expands each picture into its image tokens (shown
tokens: loss mask 0, counted in the token budget); the episode keeps the processor's outputs for
every picture so far, gives them to the sampler with the next turn's `prompt_ids`
(`Sample.vision`) and to the learner in its trajectory's `info["vision"]`. Such episodes run on the
torch backend; a plain-text episode, or a model without a processor, refuses a picture in one line.

Budgets: `max_turns` model turns, `max_tokens` for the whole sequence (prompt included;
the model's context), `max_seconds` of wall time per episode (checked between turns, so every episode has one; a
tool's own deadline bounds a step). Every episode ends with a `finish_reason`: the
environment's (`answer`, `done`), `max_turns`, `context`, `time` or `env_error` (the
environment itself raised: the episode scores None and the run goes on).

Each trajectory's `info` holds the episode's `reward`, `turn_rewards` (each step's reward),
`turn_progress` (each step's `info["progress"]`, None where it gave none; read by the
`turn_progress` estimator), `tool_calls`, `turns_total`, and `first_turn`: the episode turn of the part's
first span in `turns` (0 unless a split episode's later part).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from assay.envs.base import Environment
from assay.envs.tools import OUTCOMES
from assay.errors import AssayError
from assay.rollout.base import SamplingParams, render_chat
from assay.types import Sample, Trajectory
from assay.vision.inputs import image_parts, render_pictures


@dataclass
class Budget:
    """Limits of one episode.

    Attributes:
        max_turns: model turns at most.
        max_tokens: prompt plus every turn and observation, in tokens (the model's context).
        max_seconds: wall time of an episode, checked before each turn.
    """

    max_turns: int = 4
    max_tokens: int = 256
    max_seconds: float = 60.0


@dataclass
class _Episode:
    sample: Sample
    group: int
    env: Environment
    prompt_ids: list[int]
    messages: list[dict[str, Any]] | None
    started: float
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    progress: list[float | None] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    parts: list[Trajectory] = field(default_factory=list)
    vision: dict[str, Any] | None = None  # the processor's outputs for every picture in the sequence so far
    n_turns: int = 0
    finish: str = ""
    outcome: str | None = None  # the environment's own word on the final turn (`info["reason"]`), if it gave one
    error: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


class MultiTurn:
    """Runs episodes of an environment with any sampler.

    Args:
        sampler: the generation backend (`assay.rollout.base.Sampler`).
        tokenizer: the policy's tokenizer (observations are encoded with it).
        make_env: a function returning a fresh `Environment` (`assay.envs.env_factory`).
        budget: turn, token and time limits.
        chat: prompt and observations through the tokenizer's chat template (see the module docstring).
        stop: the ids that end a model's turn (`assay.rollout.base.stop_ids`; default: the tokenizer's EOS).
    """

    def __init__(self, sampler: Any, tokenizer: Any, make_env: Callable[[], Environment], budget: Budget, chat: bool = False,
                 stop: list[int] | None = None):
        self.sampler, self.tokenizer, self.make_env, self.budget, self.chat = sampler, tokenizer, make_env, budget, chat
        self.stop_ids = set(stop or [tokenizer.eos_token_id])

    def run(self, samples: list[Sample], n: int, params: SamplingParams, generator: Any = None) -> list[Trajectory]:
        """`n` episodes of each sample; one trajectory per episode (more when a chat episode splits), grouped by sample."""
        episodes = [self._start(s, g) for g, s in enumerate(samples) for _ in range(n)]
        while True:
            active = [e for e in episodes if self._within_budget(e)]
            if not active:
                break
            by_room: dict[int, list[_Episode]] = {}
            for e in active:  # a turn may not run past the token budget
                by_room.setdefault(min(params.max_new_tokens, self.budget.max_tokens - e.length), []).append(e)
            for room, group in by_room.items():
                turn = [replace(e.sample, prompt_ids=e.prompt_ids + e.ids, vision=e.vision) for e in group]
                trajs = self.sampler.generate(turn, 1, replace(params, max_new_tokens=room), generator)
                for e, t in zip(group, trajs):
                    if list(t.prompt_ids) != e.prompt_ids + e.ids:
                        raise AssayError(f"rollout backend {type(self.sampler).__name__} did not keep the episode's tokens as given "
                                         "(prompt_ids changed): multi-turn rollouts need a backend that honours Sample.prompt_ids")
                    self._turn(e, t)
        return [part for e in episodes for part in self._close(e)]

    # -- one episode ---------------------------------------------------------------------

    def _start(self, sample: Sample, group: int) -> _Episode:
        env = self.make_env()
        obs = env.reset(sample)
        vision = None
        if self.chat:
            messages = [*(sample.prompt[:-1] if isinstance(sample.prompt, list) else []), {"role": "user", "content": obs}]
            ids, vision = self._render(messages, env, generation=True, sid=sample.id)
        else:
            messages, ids = None, self._encode(self._text(obs, sample.id))
        return _Episode(sample, group, env, ids, messages, time.monotonic(), vision=vision)

    def _within_budget(self, e: _Episode) -> bool:
        """False (and the episode finished) when it may not take another turn."""
        if e.finish:
            return False
        if e.n_turns >= self.budget.max_turns:
            e.finish = "max_turns"
        elif e.length >= self.budget.max_tokens:
            e.finish = "context"
        elif e.n_turns and time.monotonic() - e.started > self.budget.max_seconds:  # every episode gets one turn
            e.finish = "time"
        return not e.finish

    def _turn(self, e: _Episode, t: Trajectory) -> None:
        start = len(e.ids)
        e.ids += t.completion_ids
        e.logprobs += t.logprobs
        e.mask += [1] * len(t.completion_ids)
        e.turns.append((start, len(e.ids)))
        e.versions.append(t.version)
        e.n_turns += 1
        action = self.tokenizer.decode(t.completion_ids, skip_special_tokens=True)  # a turn cut by max_new_tokens is given as it is
        try:
            obs, reward, done, info = e.env.step(action)
        except Exception as err:  # the environment's own bug: this episode cannot be scored, the run goes on
            e.rewards.append(None)
            e.progress.append(None)
            e.finish, e.error = "env_error", f"{type(err).__name__}: {err}"[:300]
            return
        e.rewards.append(reward)
        e.progress.append(info.get("progress"))
        e.calls += [(c.name, c.outcome) for c in info.get("tool_calls", [])]
        if done:
            e.finish, e.outcome = info.get("finish_reason", "done"), info.get("reason")
            return
        if self.chat:
            e.messages.append({"role": "assistant", "content": action})
            shown = self._chat_observation(e, t, obs)
        else:
            shown = self._encode(self._text(obs, e.sample.id)), e.vision
        if shown is None:
            return
        obs_ids, vision = shown
        if e.length + len(obs_ids) >= self.budget.max_tokens:
            e.finish = "context"  # the observation does not fit: the episode ends before it (and without its pictures)
            return
        e.vision = vision
        e.ids += obs_ids
        e.logprobs += [0.0] * len(obs_ids)
        e.mask += [0] * len(obs_ids)

    def _chat_observation(self, e: _Episode, t: Trajectory, obs: Any) -> tuple[list[int], dict[str, Any] | None] | None:
        """The observation's tokens after the sampled turn, and the pictures of the conversation with it; None when the
        episode had to split (see the module docstring)."""
        before, _ = self._render(e.messages, e.env, generation=False, sid=e.sample.id)
        e.messages.append({"role": e.env.chat_role, "content": obs})
        after, vision = self._render(e.messages, e.env, generation=True, sid=e.sample.id)
        if after[: len(before)] != before:
            e.parts.append(self._trajectory(e, "split"))
            e.prompt_ids, e.ids, e.logprobs, e.mask, e.turns, e.vision = after, [], [], [], [], vision
            return None
        ends = [i for i, tok in enumerate(before) if tok in self.stop_ids]
        ended = bool(t.completion_ids) and t.completion_ids[-1] in self.stop_ids
        tail = before[ends[-1] + 1 if ended else ends[-1]:] if ends else []  # what the template puts after the turn's end
        return tail + after[len(before):], vision

    def _close(self, e: _Episode) -> list[Trajectory]:
        if e.turns or not e.parts:
            parts = [*e.parts, self._trajectory(e, e.finish or "max_turns")]
        else:  # split, then the episode ended before another turn: the last part ends it
            parts = e.parts
            parts[-1].finish_reason, parts[-1].finished = e.finish, e.finish not in ("max_turns", "context", "time")
        scored = [r for r in e.rewards if r is not None]
        reward = None if (not scored or e.rewards[-1:] == [None]) else float(sum(scored))
        for i, p in enumerate(parts):
            p.info.update(reward=reward, turn_rewards=list(e.rewards), turn_progress=list(e.progress), tool_calls=list(e.calls), turns_total=e.n_turns,
                          segment=i, segments=len(parts), env_error=e.error, outcome=e.outcome)
        return parts

    def _trajectory(self, e: _Episode, finish: str) -> Trajectory:
        completion = self.tokenizer.decode(e.ids, skip_special_tokens=True)
        done = finish not in ("max_turns", "context", "time", "split")
        info: dict[str, Any] = {"first_turn": e.n_turns - len(e.turns)}
        if e.vision is not None:
            info["vision"] = e.vision
        return Trajectory(e.sample, completion, list(e.prompt_ids), list(e.ids), list(e.logprobs), done, group=e.group,
                          loss_mask=list(e.mask), turns=list(e.turns), version=min(e.versions, default=0), finish_reason=finish, info=info)

    # -- tokens --------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @staticmethod
    def _text(obs: Any, sid: str) -> str:
        """A plain-text episode's observation; a picture there is one line (pictures need the chat template's processor)."""
        if isinstance(obs, str):
            return obs
        raise AssayError(f"prompt id {sid!r}: the environment returned {type(obs).__name__} as an observation; a plain-text episode "
                         "takes text (pictures need env.chat=true and a vision-language model)")

    def _render(self, messages: list[dict[str, Any]], env: Environment, generation: bool, sid: str) -> tuple[list[int], dict[str, Any] | None]:
        """The conversation's ids, and the processor's outputs when it holds pictures (None otherwise)."""
        args: dict[str, Any] = {}
        if env.tool_schemas():
            args["tools"] = env.tool_schemas()
        if image_parts(messages):
            return render_pictures(self.tokenizer, messages, generation, args, sid)
        if generation:
            return render_chat(self.tokenizer, messages, args, sid), None
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True, **args)
        return list(out["input_ids"]), None


def episode_metrics(trajs: list[Trajectory]) -> dict[str, float]:
    """`agent/*` metrics of a step's episodes (docs/metrics.md); the first part of a split episode counts it."""
    firsts = [t for t in trajs if t.info.get("segment", 0) == 0]
    calls = [c for t in firsts for c in t.info.get("tool_calls", [])]
    m: dict[str, float] = {
        "agent/turns_mean": sum(t.info.get("turns_total", 1) for t in firsts) / max(1, len(firsts)),
        "agent/model_tokens": float(sum(t.sampled_tokens for t in trajs)),
        "agent/env_tokens": float(sum(len(t.completion_ids) - t.sampled_tokens for t in trajs)),
        "agent/splits": float(sum(1 for t in trajs if t.finish_reason == "split")),
        "agent/tool_calls_per_episode": len(calls) / max(1, len(firsts)),
    }
    for outcome in OUTCOMES:
        m[f"agent/tool_calls/{outcome}"] = float(sum(1 for _, o in calls if o == outcome))
    for name in sorted({n for n, _ in calls}):
        m[f"agent/tool/{name}"] = float(sum(1 for n, _ in calls if n == name))
    m["agent/env_errors"] = float(sum(1 for t in firsts if t.finish_reason == "env_error"))
    lasts = [t for t in trajs if t.info.get("segment", 0) == t.info.get("segments", 1) - 1]  # how each episode ended
    for reason in sorted({t.finish_reason for t in lasts}):
        m[f"agent/finish/{reason}"] = sum(1 for t in lasts if t.finish_reason == reason) / len(lasts)
    return m


class EpisodeSampler:
    """A `Sampler` whose `generate` runs whole episodes of an environment through another sampler.

    The trainer and `assay eval` use it as any backend: each trajectory is an episode (its
    reward in `info["reward"]`, scored by the `episode` reward). Weight updates, sleep and
    wake go to the wrapped backend. `metrics()` returns the `agent/*` metrics of the
    episodes generated since it was last asked, except while `counting` is False (held-out
    evaluation).
    """

    def __init__(self, inner: Any, loop: MultiTurn):
        self.inner, self.loop = inner, loop
        self.counting = True
        self._trajs: list[Trajectory] = []

    @property
    def version(self) -> int:
        return self.inner.version

    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: Any = None) -> list[Trajectory]:
        trajs = self.loop.run(samples, n, params, generator)
        if self.counting:
            self._trajs += trajs
        return trajs

    def metrics(self) -> dict[str, float]:
        inner = getattr(self.inner, "metrics", None)
        m = dict(inner()) if callable(inner) else {}
        if self._trajs:
            m.update(episode_metrics(self._trajs))
        self._trajs = []
        return m

    def update_weights(self, model: Any, version: int) -> None:
        self.inner.update_weights(model, version)

    def sleep(self) -> None:
        self.inner.sleep()

    def wake(self) -> None:
        self.inner.wake()

    def close(self) -> None:
        self.inner.close()


def episode_sampler(inner: Any, model: Any, tokenizer: Any, env: Any, context: int | None) -> EpisodeSampler:
    """The run's sampler for an `env:` block (`assay.config.EnvConfig`): episodes of that environment through `inner`."""
    from assay.envs.base import env_factory
    from assay.rollout.base import stop_ids

    budget = Budget(env.max_turns, env.max_tokens or context or 4096, env.max_seconds)
    if context and budget.max_tokens > context:
        raise AssayError(f"env.max_tokens={budget.max_tokens} is more than the model's context ({context} positions)")
    return EpisodeSampler(inner, MultiTurn(inner, tokenizer, env_factory(env.name, env.args), budget, env.chat, stop_ids(model, tokenizer)))


@contextlib.contextmanager
def counting_off(sampler: Any) -> Iterator[None]:
    """While inside, an `EpisodeSampler`'s episodes stay out of its metrics (any other sampler: nothing changes)."""
    was = getattr(sampler, "counting", None)
    if was is not None:
        sampler.counting = False
    try:
        yield
    finally:
        if was is not None:
            sampler.counting = was
