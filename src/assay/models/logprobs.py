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

`token_logprobs` is the one entry point: a `Batch`'s completion-token logprobs under a model,
through the shared-prefix forward and the chunked head where they apply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from assay.models.llama import FAMILY, batch_supported as forward_supported, prefix_hidden, sharded
from assay.models.lora import AdapterOff
from assay.vision.inputs import placeholder_ids

if TYPE_CHECKING:
    from assay.batch import Batch


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


def _fused_head(model) -> torch.Tensor | None:
    """The LM head's weight when logits are exactly `hidden @ W.T` (no bias, scale or soft-cap), else None."""
    cfg = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if getattr(cfg, "model_type", None) not in FAMILY or not isinstance(head, torch.nn.Linear) or head.bias is not None or sharded(model):
        return None
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None):
        return None
    return head.weight


#: logits of at least this many elements (`B·T·V`; 128 MB in fp32) go through the chunked LM head
CHUNKED_MIN_ELEMENTS = 1 << 25


def token_logprobs(model, batch: "Batch", temperature: float = 1.0, with_entropy: bool = False,
                   entropy_grad: bool = False, fast: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob `[B, T]` of each completion token under `model` (and its entropy `[B, T]`).

    Only the T positions that predict completion tokens go through the LM head. With
    `fast` (the default) a Llama-family model runs assay's shared-prefix forward
    (`assay.models.llama`: each distinct prompt once); otherwise, and for other models,
    the model's own forward runs every row whole. When the logits would be large (at
    least `CHUNKED_MIN_ELEMENTS`) and the LM head is a plain matrix, the head runs in
    chunks (`assay.models.logprobs`), so `[B, T, V]` logits are never held for the backward
    pass; the entropy then comes without a gradient, which is all a metric needs. Below
    that size the plain head is faster (one matmul, no recomputation). `entropy_grad=True`
    (an entropy bonus) always takes the plain head, where the entropy is differentiable.
    `model` may be an `AdapterOff` (a LoRA policy with its adapters off: the KL reference).
    """
    if isinstance(model, AdapterOff):
        with model.model() as base:
            return token_logprobs(base, batch, temperature, with_entropy, entropy_grad, fast)
    own = getattr(model, "action_logprobs", None)
    if own is not None:  # a policy whose actions are not tokens (an image policy's denoising steps): its own likelihoods
        return own(batch, temperature, with_entropy)
    T = batch.response_len
    targets = batch.input_ids[:, -T:]  # [B, T]
    banned = placeholder_ids(model)
    if batch.vision is not None or banned:  # a VLM: its own forward, given the pictures; placeholders masked as the samplers do
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, logits_to_keep=T + 1,
                    **(batch.vision.kwargs() if batch.vision is not None else {}))
        logits = out.logits[:, :-1].float()
        if not banned:
            return _from_logits(logits, targets, temperature, with_entropy, entropy_grad)
        held = torch.tensor(banned, device=logits.device)
        lp, ent = _from_logits(logits.index_fill(-1, held, float("-inf")), targets, temperature, with_entropy, entropy_grad)
        # a placeholder in a completion is a picture an environment showed (loss mask 0): 0.0 there, as the sampler records it
        return lp.masked_fill(torch.isin(targets, held), 0.0), ent
    weight = None if entropy_grad else _fused_head(model)
    if weight is not None and targets.numel() * weight.shape[0] < CHUNKED_MIN_ELEMENTS:
        weight = None
    hidden = prefix_hidden(model, batch) if fast and forward_supported(model, batch) is None else None  # [B, T, H]
    if weight is not None:
        if hidden is None:
            out = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
            hidden = out.last_hidden_state[:, -T - 1 : -1]  # the positions that predict completion tokens
        return token_logprobs_from_hidden(hidden, weight, targets, temperature, with_entropy=with_entropy)
    if hidden is not None:
        logits = model.get_output_embeddings()(hidden).float()
    else:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids, logits_to_keep=T + 1)
        logits = out.logits[:, :-1].float()  # [B, T, V]
    return _from_logits(logits, targets, temperature, with_entropy, entropy_grad)


def _from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool,
                 entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs `[B, T]` of `targets` under `logits [B, T, V]` at `temperature`, and the entropy when asked."""
    logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    lp = logp.gather(-1, targets[..., None])[..., 0]
    ent = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent = -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)  # [B, T]; a masked-out token adds 0, not 0·(−∞)
    return lp, ent
