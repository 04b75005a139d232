"""The engine backends, registered without importing their engines.

`rollout.backend=vllm` and `rollout.backend=openai` are registered here as small
factories that import their implementation (and vLLM) only when called, so importing
assay, listing the backends or checking a config never imports an engine.
`assay.rollout.base.check_backend` imports this module.
"""

from __future__ import annotations

import os
from typing import Any

from assay.errors import AssayError
from assay.rollout.base import SAMPLERS

#: backends whose logprobs come from another engine than the learner's own forward
ENGINE_BACKENDS = ("vllm", "openai")

INSTALL_HINT = "set it up with `ASSAY_ENGINE=vllm scripts/setup.sh` and run `.venv-engine/bin/assay` (docs/engines.md)"


def rollout_or_default(rollout: Any) -> Any:
    """The run's `rollout` section, or the defaults when a caller (`assay eval`) has none."""
    if rollout is not None:
        return rollout
    from assay.config import RolloutConfig

    return RolloutConfig()


def require_vllm() -> None:
    """One line naming the set-up step when vLLM is not importable here.

    vLLM's own log is kept to errors unless `VLLM_LOGGING_LEVEL` is set (its start-up
    messages and warnings about a serving set-up do not apply to a colocated engine).
    """
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise AssayError(f"rollout.backend=vllm needs vLLM, which this Python cannot import ({e}); {INSTALL_HINT}") from None


@SAMPLERS.register("vllm")
def vllm_sampler(model, tokenizer, rollout=None, device="cpu"):
    """A vLLM engine in this process, taking the learner's weights in place after each update."""
    require_vllm()
    from assay.rollout.vllm_sampler import VLLMSampler

    return VLLMSampler(model, tokenizer, rollout_or_default(rollout), device)


@SAMPLERS.register("openai")
def openai_sampler(model, tokenizer, rollout=None, device="cpu"):
    """Any OpenAI-compatible completions server (`rollout.server_url`); weights pushed when it offers vLLM's routes."""
    from assay.rollout.openai_sampler import OpenAISampler

    return OpenAISampler(model, tokenizer, rollout_or_default(rollout), device)
