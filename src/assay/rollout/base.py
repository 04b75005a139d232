"""The sampler interface: what every generation backend implements, and how one is chosen.

A *sampler* turns prompts into trajectories. The trainer, `assay eval`, ground-truth
injection and every other caller go through this interface only, so a new backend (an
inference engine, a remote server) is one new class registered in `SAMPLERS` and chosen
with `rollout.backend=NAME`. `tests/test_sampler_contract.py` is the suite every backend
must pass:

- `generate(samples, n, params, generator)` returns `n` trajectories per prompt, grouped
  prompt by prompt, each with the token ids the backend actually sampled (no detokenise and
  retokenise round trip), their logprobs under the sampling temperature (the learner
  recomputes the same numbers on the first update), a finish reason, and the policy
  version of the weights that sampled it.
- `update_weights(model, version)` after each optimizer step: afterwards the backend
  samples from `model`'s weights and stamps trajectories with `version`.
- `sleep()` / `wake()` release and take back memory between rollouts (engines on a GPU);
  `close()` releases everything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from assay.errors import AssayError
from assay.registry import Registry
from assay.types import Sample, Trajectory


@dataclass
class SamplingParams:
    """How to sample.

    Attributes:
        max_new_tokens: length limit of a completion, in tokens (EOS included).
        temperature: logits are divided by this before sampling; 0 means greedy.
        top_p: nucleus sampling threshold (1.0 keeps the whole distribution).
    """

    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0


@runtime_checkable
class Sampler(Protocol):
    """A generation backend (see the module docstring for the contract)."""

    #: the policy version of the weights it samples from (optimizer steps taken)
    version: int

    def generate(self, samples: list[Sample], n: int, params: SamplingParams, generator: Any = None) -> list[Trajectory]:
        """`n` completions of each prompt, grouped prompt by prompt (`Trajectory.group` = prompt index)."""
        ...

    def update_weights(self, model: Any, version: int) -> None:
        """Take the learner's new weights; later trajectories carry `version`."""
        ...

    def sleep(self) -> None:
        """Release memory held between rollouts (a no-op where nothing is held)."""
        ...

    def wake(self) -> None:
        """Take back what `sleep` released."""
        ...

    def close(self) -> None:
        """Release everything; the sampler is not used again."""
        ...


#: `rollout.backend` name → factory `(model, tokenizer, rollout config, device) -> Sampler`
SAMPLERS: Registry[Callable[..., Sampler]] = Registry("rollout backend")


def check_backend(backend: str) -> Callable[..., Sampler]:
    """The factory of `rollout.backend`; one line naming the known backends for anything else."""
    from assay.rollout import engines, torch_sampler  # noqa: F401  (register "torch", "vllm", "openai"; no engine is imported)

    if backend not in SAMPLERS and ":" not in backend:
        raise AssayError(f"unknown rollout.backend {backend!r}; known: {', '.join(SAMPLERS.names())} (or a module:attr factory)")
    return SAMPLERS.get(backend)


def make_sampler(backend: str, model: Any, tokenizer: Any, rollout: Any = None, device: Any = "cpu") -> Sampler:
    """The sampler called `backend` (`rollout.backend`), built for `model`."""
    return check_backend(backend)(model, tokenizer, rollout, device)


def encode_prompt(tokenizer: Any, sample: Sample) -> list[int]:
    """The token ids a sampler gives the policy for `sample`: its `prompt_ids` when set, else its prompt encoded.

    Every backend and every length check goes through this one function, so what is
    measured is what is sampled.
    """
    if sample.prompt_ids is not None:
        return list(sample.prompt_ids)
    return tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]


def pad_id(tokenizer: Any) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
