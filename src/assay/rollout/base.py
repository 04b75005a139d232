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
from assay.vision.inputs import encode_sample, has_images


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

    if backend == "image":
        from assay.images import sampler  # noqa: F401  (registers "image")
    if backend not in SAMPLERS and ":" not in backend:
        raise AssayError(f"unknown rollout.backend {backend!r}; known: {', '.join(SAMPLERS.names())} (or a module:attr factory)")
    return SAMPLERS.get(backend)


def make_sampler(backend: str, model: Any, tokenizer: Any, rollout: Any = None, device: Any = "cpu") -> Sampler:
    """The sampler called `backend` (`rollout.backend`), built for `model`; an image policy's is always `image`."""
    if getattr(model, "policy_kind", "text") == "image":
        if backend not in ("torch", "image"):
            raise AssayError(f"rollout.backend={backend!r} samples language models; an image policy samples in process (leave rollout.backend at torch, or image)")
        backend = "image"
    if getattr(model, "policy_kind", "text") == "vision" and backend == "openai":
        raise AssayError("rollout.backend=openai sends token ids to a server, and a prompt's pictures have no place in that request yet; "
                         "a vision-language policy samples with rollout.backend=torch or vllm (docs/multimodal.md)")
    return check_backend(backend)(model, tokenizer, rollout, device)


def encode_prompt(tokenizer: Any, sample: Sample) -> list[int]:
    """The token ids a sampler gives the policy for `sample` `[P]`.

    Its `prompt_ids` when set; a conversation (a list of messages) rendered by the
    tokenizer's own chat template with the generation prompt added (`apply_chat_template`,
    with `sample.template_args`; a final assistant message is continued instead); plain
    text encoded as it is, with no special tokens added; a conversation with pictures through the
    tokenizer's processor (`assay.vision.inputs.encode_sample`). Every backend and every length
    check goes through this one function, so what is measured is what is sampled.
    """
    if sample.prompt_ids is not None:
        return list(sample.prompt_ids)
    if has_images(sample):  # pictures go through the model's processor, which expands each into its image tokens
        return encode_sample(tokenizer, sample)[0]
    if isinstance(sample.prompt, str):
        return tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    return render_chat(tokenizer, sample.prompt, sample.template_args or {}, sample.id)


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], template_args: dict[str, Any], sid: str = "?") -> list[int]:
    """`messages` through the tokenizer's chat template: `[P]` ids ending where the assistant's reply begins."""
    if not getattr(tokenizer, "chat_template", None):
        raise AssayError(f"prompt id {sid!r} is a conversation (a list of messages) but the model's tokenizer has no chat template; "
                         "give one with model.chat_template=FILE.jinja, or use plain-text prompts")
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    try:
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=not prefill, continue_final_message=prefill,
                                            tokenize=True, return_dict=True, **template_args)
    except Exception as e:  # a template raises jinja's own errors (raise_exception in the template, a bad message)
        raise AssayError(f"prompt id {sid!r}: the chat template failed on this conversation: {type(e).__name__}: {e}") from None
    return list(out["input_ids"])


def stop_ids(model: Any, tokenizer: Any) -> list[int]:
    """The token ids that end a completion: the tokenizer's EOS and the model's `generation_config.eos_token_id`
    (an instruct model's end-of-turn token, such as `<|im_end|>` or `<|eot_id|>`), EOS first."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in gen if isinstance(gen, (list, tuple)) else [gen]:
        if i is not None and i not in ids:
            ids.append(int(i))
    return ids


def pad_id(tokenizer: Any) -> int:
    """The id that pads batches: the tokenizer's pad token, else its EOS."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def sampler_metrics(sampler) -> dict[str, float]:
    """What a backend reports about itself since it was last asked (`engine/*`: sync time and
    probe agreement, staleness); nothing for a backend without a `metrics()` method."""
    report = getattr(sampler, "metrics", None)
    return report() if callable(report) else {}
