"""Policy entropy from logits, for the entropy bonus and for the per-step entropy metric.

The bonus is a loss term: `loss = pg_loss − coef · aggregate(entropy, mask, mode)`; the
metric is `entropy_stats(entropy, mask)`.
"""

from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the softmax over the last axis: H = logsumexp(z) − Σ_v softmax(z)_v z_v.

    Differentiable (use it for the bonus; detach it for logging). `chunk_size` computes
    the `[*, V]` softmax a few rows at a time to bound memory on long responses; −inf
    logits (a masked vocabulary) count as probability 0.

    Args:
        logits: `[B, T, V]` (or any `[..., V]`).
    Returns:
        `[B, T]` in nats.

    >>> entropy_from_logits(torch.zeros(1, 1, 4))
    tensor([[1.3863]])
    """
    def _h(z: torch.Tensor) -> torch.Tensor:
        z = z.float()
        finite = torch.where(torch.isinf(z), torch.zeros_like(z), z)  # −inf logits (masked vocab) have p = 0
        return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * finite).sum(-1)

    if chunk_size is None:
        return _h(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.cat([_h(c) for c in flat.split(chunk_size)])
    return out.reshape(logits.shape[:-1])


def entropy_stats(entropy: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """`{"entropy": mean over response tokens, "entropy_seq_min": lowest per-response mean}`."""
    m = mask.to(entropy.dtype)
    e = torch.where(mask.bool(), entropy.detach(), torch.zeros_like(entropy))
    per_seq = e.sum(-1) / m.sum(-1).clamp(min=1)
    has = m.sum(-1) > 0
    return {
        "entropy": float(e.sum() / m.sum().clamp(min=1)),
        "entropy_seq_min": float(per_seq[has].min()) if has.any() else 0.0,
    }
