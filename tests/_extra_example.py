"""The docs' example of a new extra and the estimator that needs it (assay.training.extras)."""

import torch

from assay.algos.advantages import declare, grpo
from assay.training.extras import EXTRAS, Extra

CALLS = {"prompt_len": 0}


@EXTRAS.register("prompt_len")
class PromptLength(Extra):
    doc = "[B] prompt length in tokens"

    def __call__(self, step):
        CALLS["prompt_len"] += 1
        return torch.tensor([len(t.prompt_ids) for t in step.trajs], dtype=torch.float32)


@declare(needs={"prompt_len"})
def shorter_prompts_first(rewards, group, mask, prompt_len, scale: float = 0.01):
    return grpo(rewards - scale * prompt_len, group, mask)
