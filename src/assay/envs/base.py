"""The environment protocol for multi-turn episodes, the `ENVS` registry, and `ToolEnv`.

An environment is Gymnasium-shaped, with text for observations and actions:

- `reset(sample) -> str`: start an episode on one dataset row; the first observation
  (the text the model is prompted with);
- `step(action) -> (observation, reward, done, info)`: the model's turn (decoded text) in,
  what the model is shown next, this turn's reward, whether the episode ended, and `info`
  (`tool_calls`: the `ToolCall`s the turn made; `finish_reason`: why it ended).

The episode's reward is the sum of its turns' rewards; `None` from the last step means
"cannot be scored" (left out of baselines, as a reward's `None`). The rollout loop
(`assay.rollout.multiturn`) owns the budgets (turns, tokens, wall time) and the tokens;
an environment sees and returns text only. One instance serves one episode at a time;
the loop makes one per episode with the registered factory.

Adapters (a few lines each, not shipped):

- Gymnasium: `reset(sample)` → `obs, _ = env.reset(options={"sample": sample})`;
  `step(action)` → `obs, r, terminated, truncated, info = env.step(action)` and return
  `obs, r, terminated or truncated, info` (the observation and action spaces are text).
- TRL (`environment_factory` classes whose public methods are tools) and the verifiers
  library (`ToolEnv(tools=[...])`, `MultiTurnEnv.env_response`): pass the same functions
  to `ToolEnv` below, and put the rubric's scoring in `answer`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, NamedTuple

from assay.envs.tools import ToolBox, ToolCall
from assay.errors import AssayError
from assay.registry import Registry
from assay.rewards.base import REWARDS, Reward
from assay.types import RewardResult, Sample, Trajectory


class Step(NamedTuple):
    """What `Environment.step` returns; unpacks as `observation, reward, done, info`."""

    observation: str
    reward: float | None
    done: bool
    info: dict[str, Any]


class Environment(ABC):
    """Base class of multi-turn environments (see the module docstring); subclasses define `reset` and `step`.

    Attributes:
        chat_role: the chat role an observation is shown under when the model has a chat
            template (`tool` for tool results, `user` for a conversation partner).
    """

    chat_role = "tool"

    @abstractmethod
    def reset(self, sample: Sample) -> str:
        """Start an episode for `sample`; the first observation (usually the prompt)."""

    @abstractmethod
    def step(self, action: str) -> Step:
        """Take the model's turn `action`; the observation, its reward, whether the episode is done, and info."""

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The JSON schemas of the tools, for a chat template's `tools=` argument (None: no tools)."""
        return None


class ToolEnv(Environment):
    """An environment whose turns are tool calls until the model answers.

    A turn with a tool call (well formed or not) runs the calls and shows their
    observations, one per line; a turn without one is the answer: `answer(text)` scores
    it and the episode ends. Subclasses set the tools and write `prompt` and `answer`.

    Args:
        tools: functions or `Tool`s (`assay.envs.tools`).
        syntax: `json` (`<tool_call>` blocks) or `bracket` (`[name args]`).
        timeout_s: deadline of one tool call.
        isolate: run each call in a worker process killed at the deadline (tools must be
            picklable module-level functions); False: a daemon thread.
    """

    def __init__(self, tools: list[Any], syntax: str = "json", timeout_s: float = 5.0, isolate: bool = False) -> None:
        self.box = ToolBox(tools, syntax, timeout_s, isolate=isolate)
        self.sample: Sample | None = None

    def reset(self, sample: Sample) -> str:
        self.sample = sample
        return self.prompt(sample)

    def prompt(self, sample: Sample) -> str:
        """The first observation (default: the sample's prompt text)."""
        return sample.prompt if isinstance(sample.prompt, str) else str(sample.prompt[-1].get("content", ""))

    @abstractmethod
    def answer(self, text: str) -> float | None:
        """The final answer's reward."""

    def step(self, action: str) -> Step:
        if not self.box.has_call(action):
            return Step("", self.answer(action), True, {"tool_calls": [], "finish_reason": "answer"})
        calls = self.box.run(action)
        return Step(self.render(calls), 0.0, False, {"tool_calls": calls})

    def render(self, calls: list[ToolCall]) -> str:
        """The observations of a turn's calls, as the model is shown them."""
        return "".join(c.observation for c in calls) if self.box.syntax == "bracket" else "\n".join(c.observation for c in calls)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.box.schemas


#: environment name → factory `(**args) -> Environment` (a class, or any callable)
ENVS: Registry[Callable[..., Environment]] = Registry("environment")


def env_factory(name: str, args: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A function making a fresh environment `name` (registered, or `module:attr`) with `args`; checked once here."""
    import assay.envs  # noqa: F401  (registers the bundled environments)

    make = ENVS.get(name)
    args = dict(args or {})

    def build() -> Environment:
        try:
            env = make(**args)
        except TypeError as e:
            raise AssayError(f"env {name!r}: {e}") from None
        if not callable(getattr(env, "reset", None)) or not callable(getattr(env, "step", None)):
            raise AssayError(f"env {name!r} made a {type(env).__name__}, which has no reset/step methods")
        return env

    build()  # fail now, in one line, on a bad argument
    return build


#: how an episode can end without the model's final answer: its `finish_reason` is then the outcome
CUT_SHORT = ("max_turns", "context", "time", "split", "env_error")


@REWARDS.register("episode")
class EpisodeReward(Reward):
    """The reward an environment gave the episode (`Trajectory.info["reward"]`, set by the multi-turn loop).

    None (cannot be scored) for a trajectory that is not an episode, or whose environment could not score it.
    `kind` is "io": reading a number needs no worker process. `info["reason"]` is the episode's outcome: the
    environment's own word on its last turn (`info["reason"]` of its step, as `sql-agent` gives one), else
    `correct` (reward ≥ 1), `partial` (between 0 and 1) or `wrong`, or how it was cut short (`max_turns`,
    `context`, `time`, `env_error`); `info["finish"]` is how it ended (`answer`, `submit`, ...).
    """

    kind = "io"

    def score(self, traj: Trajectory) -> RewardResult:
        if "reward" not in traj.info:
            return RewardResult.failed("not an episode of an environment (no info['reward'])", score=None)
        reward = traj.info["reward"]
        return RewardResult(None if reward is None else float(reward),
                            info={"reason": outcome(traj.finish_reason, reward, traj.info.get("outcome")), "finish": traj.finish_reason,
                                  "turns": traj.info.get("turns_total")})


def outcome(finish: str, reward: float | None, said: str | None) -> str:
    """An episode's outcome in a word (`EpisodeReward`): the environment's own, how it was cut short, or its reward read as a verdict."""
    if said:
        return said
    if finish in CUT_SHORT:
        return finish
    if reward is None:
        return "unscored"
    return "correct" if reward >= 1 else "wrong" if reward <= 0 else "partial"
