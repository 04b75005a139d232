"""Token logprobs from hidden states without keeping `[B, T, V]` logits for the backward pass.

The trainer needs, for every completion token, log p(token) under the policy — one number
per position — but the usual route (`model(...).logits`, `log_softmax`, `gather`) keeps
the whole `[B, T, V]` logit tensor, and a softmax of the same size, alive until the
backward pass. With a 150k-token vocabulary, 64 sequences of 1,024 tokens that is 39 GB
in fp32. `token_logprobs_from_hidden` runs the LM head over chunks of rows, keeps only
each row's log-normaliser, and in the backward pass recomputes each chunk's logits to
form the gradient `(onehot − softmax) / τ` — the same trade the fused linear-cross-entropy
kernels of Liger-Kernel and verl make. Memory for logits falls from `B·T·V` to
`chunk·V`; the extra cost is one more LM-head matmul per chunk.

The entropy of each position's distribution comes out of the same pass, without a
gradient (it is a metric; an entropy bonus needs its gradient and takes the plain path).
"""

from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = (h @ weight.t()).float()
    return logits / temperature if temperature != 1.0 else logits


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature: float, chunk: int, with_entropy: bool):
        N = hidden.shape[0]
        logprobs = hidden.new_empty(N, dtype=torch.float32)
        lse = hidden.new_empty(N, dtype=torch.float32)
        entropy = hidden.new_zeros(N, dtype=torch.float32)
        for s in range(0, N, chunk):
            logits = _chunk_logits(hidden[s : s + chunk], weight, temperature)
            lse[s : s + chunk] = torch.logsumexp(logits, dim=-1)
            logprobs[s : s + chunk] = logits.gather(-1, targets[s : s + chunk, None])[:, 0] - lse[s : s + chunk]
            if with_entropy:  # H = −Σ p·log p, from log p directly (log Z − Σ p·z cancels badly)
                logp = logits - lse[s : s + chunk, None]
                entropy[s : s + chunk] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, _grad_entropy):
        hidden, weight, targets, lse = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            h, g = hidden[s : s + chunk], grad_logprobs[s : s + chunk].float()
            # d logp / d z = onehot(target) − softmax(z), and z = h·Wᵀ / τ
            dz = torch.exp(_chunk_logits(h, weight, tau) - lse[s : s + chunk, None]).mul_(-g[:, None])
            dz[rows[: h.shape[0]], targets[s : s + chunk]] += g
            if tau != 1.0:
                dz /= tau
            dz = dz.to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s : s + chunk] = dz @ weight
            if grad_weight is not None:
                grad_weight += (dz.t() @ h).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def token_logprobs_from_hidden(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                               chunk: int = 4096, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) `[...]` (and entropy `[...]`, no gradient) for hidden states `[..., H]` under an LM head `weight [V, H]`.

    Equal to `log_softmax(hidden @ weight.T / temperature).gather(targets)` and its gradient,
    with at most `chunk` rows of logits in memory at a time.
    """
    shape = targets.shape
    lp, ent = _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), float(temperature), int(chunk), with_entropy)
    return lp.view(shape), (ent.view(shape) if with_entropy else None)
