"""The compute-bound limit of one RL step: FLOPs from parameters and tokens, and this machine's matmul rate.

The estimate is the usual dense-transformer count (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", §2.1): a forward pass costs 2·N FLOPs per token and a forward
plus backward pass 6·N, where N counts the parameters that multiply activations. What it
deliberately leaves out: attention scores (4·layers·context·hidden per token, about 2% of
2·N at this project's context of ~40 tokens), norms, softmax and sampling.

For one GRPO step with U prompts of p_u tokens, G completions each (B = U·G), completion
i of c_i tokens and prompt p(i):

    generate = 2·N · (Σ_u p_u + Σ_i c_i)         each prompt prefilled once, each drawn token decoded once
    train    = 6·N · Σ_i (p(i) + c_i)            one forward and backward over every sequence
    extra    = 2·N · Σ_i (p(i) + c_i) · F        F further forward passes (reference model, old logprobs)

No padding is counted and no finished sequence keeps running: this is the least work any
implementation of the step must do, so `limit_s = (generate + train + extra) / matmul rate`
is a lower bound on its time.

    >>> ideal_step_flops(1000, prompt_lens=[3, 5], completion_lens=[2, 4, 1, 3], group_size=2)["total"]
    192000
"""

from __future__ import annotations

import time
from typing import Any


def matmul_params(model) -> int:
    """N: parameters that multiply activations (all unique parameters, less an untied input embedding).

    With tied embeddings the one matrix is counted once, as the LM head; an untied input
    embedding is a table lookup and is left out. Norm weights are counted (a rounding error).
    """
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    if head is not None and head.weight is not emb.weight:
        n -= emb.weight.numel()
    return n


def ideal_step_flops(n_params: int, prompt_lens: list[int], completion_lens: list[int], group_size: int, extra_forwards: int = 0) -> dict[str, int]:
    """FLOPs of one step by the formula above.

    Args:
        n_params: N, from `matmul_params`.
        prompt_lens: p_u, tokens of each of the U distinct prompts.
        completion_lens: c_i, tokens of each of the B = U·G completions (EOS included), grouped prompt by prompt.
        group_size: G.
        extra_forwards: F, forward passes beyond the one the update needs.

    Returns:
        `{"generate", "train", "extra", "total"}` in FLOPs.
    """
    if len(completion_lens) != len(prompt_lens) * group_size:
        raise ValueError(f"{len(completion_lens)} completions for {len(prompt_lens)} prompts of group size {group_size}")
    seq_tokens = sum(prompt_lens[i // group_size] + c for i, c in enumerate(completion_lens))
    out = {
        "generate": 2 * n_params * (sum(prompt_lens) + sum(completion_lens)),
        "train": 6 * n_params * seq_tokens,
        "extra": 2 * n_params * seq_tokens * extra_forwards,
    }
    out["total"] = sum(out.values())
    return out


def executed_flops(n_params: int, nograd_tokens: int, grad_tokens: int, recompute: int = 0) -> int:
    """FLOPs of the forward passes a framework actually ran: 2·N per token without grad, 6·N with.

    Token counts are rows × positions of every model call, padding and finished rows
    included (counted by `TokenCounter`), so the gap to `ideal_step_flops` is work wasted.
    `recompute` forwards per grad token are added for gradient checkpointing, which reruns
    each layer's forward inside the backward pass, where no embedding call shows it.
    """
    return 2 * n_params * nograd_tokens + (6 + 2 * recompute) * n_params * grad_tokens


def matmul_rate(sizes: tuple[int, ...] = (1024, 1536, 2048), repeats: int = 3) -> dict[str, Any]:
    """Best fp32 square-matmul rate on this machine with torch's current thread setting.

    Each size is run once to warm up, then `repeats` times; the rate of the fastest run
    over all sizes is returned, in GFLOP/s (a matmul of n×n by n×n is 2·n³ FLOPs).
    """
    import torch

    per_size: dict[str, float] = {}
    for n in sizes:
        a, b = torch.randn(n, n, device="cpu"), torch.randn(n, n, device="cpu")
        a @ b
        best = min(_timed(lambda: a @ b) for _ in range(repeats))
        per_size[str(n)] = 2 * n**3 / best / 1e9
    return {"gflops": max(per_size.values()), "per_size_gflops": per_size, "threads": torch.get_num_threads(), "dtype": "float32"}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class TokenCounter:
    """Counts the token ids entering the model's input embedding, split by whether grad is enabled.

    Every path that runs the model, `generate()`, a custom decode loop that calls the
    layers' parts directly, a training forward, embeds its token ids first, so a forward
    pre-hook on the embedding sees rows × positions of every call. `reset()` between steps.
    """

    def __init__(self, model):
        import torch

        self._torch = torch
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)
        self.reset()

    def _hook(self, module, args) -> None:
        ids = args[0]  # [rows, positions]
        self.tokens["grad" if self._torch.is_grad_enabled() else "nograd"] += ids.numel()

    def reset(self) -> dict[str, int]:
        """Return the counts so far and start again from zero."""
        counts, self.tokens = getattr(self, "tokens", {}), {"grad": 0, "nograd": 0}
        return counts

    def close(self) -> None:
        self.handle.remove()
