"""A training forward for the Llama family that runs each distinct prompt once.

A GRPO batch holds G completions of every prompt, and the model's own forward runs each
row whole: the prompt is processed G times, padded to the longest prompt every time.
`prefix_hidden` runs every distinct prompt of the batch once, then runs only the
completions, whose queries attend to their own prompt's keys and values (shared, so the
backward pass sums the G rows' gradients into them) and causally to their own tokens.
This is the shared-prefix forward of Prefix Grouper (Liu et al. 2025, "Prefix Grouper:
Efficient GRPO Training through Shared-Prefix Forward", arXiv:2506.05433); the logprobs
and gradients are those of the plain forward, up to rounding (`tests/test_numerics.py`
checks both to 1e-5).

Every token of both streams goes through the token-wise parts of a layer as one flat
matrix — RMSNorm (one `F.rms_norm` in fp32), the q/k/v projections fused into one matmul,
rotary embeddings on queries and keys at once, the gate/up projections fused into one
matmul — and only attention sees the two streams apart (`scaled_dot_product_attention`
on each). Models outside the Llama family (`assay.rollout.decoder.supported`), attention
dropout, and batches with an empty prompt take the model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from assay.rollout.decoder import _cat_bias, _norm, supported as decoder_supported


def supported(model, batch) -> str | None:
    """None when `prefix_hidden` can run `batch` through `model`, else the reason it cannot."""
    why = decoder_supported(model, max_len=batch.input_ids.shape[1])
    if why is not None:
        return why
    if getattr(model.config, "attention_dropout", 0.0) and model.training:
        return "attention dropout"
    T = batch.response_len
    if not bool(batch.attention_mask[:, : batch.input_ids.shape[1] - T].any(1).all()):
        return "an empty prompt"
    return None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _residual(x: torch.Tensor, h: torch.Tensor, linear) -> torch.Tensor:
    """`x + linear(h)` with the add fused into the matmul."""
    out = torch.addmm(x, h, linear.weight.t())
    return out if linear.bias is None else out + linear.bias


def prefix_hidden(model, batch) -> torch.Tensor:
    """Final hidden states `[B, T, H]` at the positions that predict the batch's completion tokens.

    Equal to `model.get_decoder()(...)` over the left-padded rows of `batch`, taken at
    columns `P−1 … P+T−2`, with the final norm applied.
    """
    body, cfg = model.model, model.config
    dtype = next(model.parameters()).dtype
    T = batch.response_len
    P = batch.input_ids.shape[1] - T
    ids_p, mask_p = batch.input_ids[:, :P], batch.attention_mask[:, :P]
    # distinct prompts (pads made equal so only real tokens decide), and each row's prompt
    keyed = torch.cat([ids_p * mask_p, mask_p], dim=1)
    uniq, row_prompt = torch.unique(keyed, dim=0, return_inverse=True)
    start = int(uniq[:, P:].any(0).nonzero()[0])  # leading columns that are padding in every distinct prompt
    prompt_ids, prompt_mask = uniq[:, start:P], uniq[:, P + start :]
    U, Pu = prompt_ids.shape
    B, S = batch.input_ids.shape[0], T - 1  # the completion stream feeds tokens 0 … T−2
    suffix = batch.input_ids[:, P : P + S]

    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn0 = body.layers[0].self_attn
    D = getattr(attn0, "head_dim", None) or cfg.hidden_size // heads
    scale = getattr(attn0, "scaling", D**-0.5)
    dev = batch.input_ids.device

    prompt_len = prompt_mask.sum(1)
    pos = torch.cat([((prompt_mask.cumsum(1) - 1).clamp(min=0)).reshape(-1),
                     (prompt_len[row_prompt][:, None] + torch.arange(S, device=dev)).reshape(-1)])
    x = torch.cat([body.embed_tokens(prompt_ids).flatten(0, 1), body.embed_tokens(suffix).flatten(0, 1)])  # [N, H]: prompts, then completions
    cos, sin = body.rotary_emb(x, pos[None])
    cos, sin = cos[0, :, None].to(x.dtype), sin[0, :, None].to(x.dtype)  # [N, 1, D]
    sin = torch.cat([-sin[..., : D // 2], sin[..., D // 2 :]], dim=-1)  # rotate_half's sign, as in the decoder

    # attention masks (True: may attend). Pad queries also see themselves, so no row is empty;
    # their outputs reach no real token (pad keys are masked for every real query).
    causal_p = torch.ones(Pu, Pu, dtype=torch.bool, device=dev).tril()
    mask_pp = (causal_p & prompt_mask.bool()[:, None, :]) | torch.eye(Pu, dtype=torch.bool, device=dev)
    mask_pp = mask_pp[:, None]  # [U, 1, Pu, Pu]
    mask_s = torch.cat([prompt_mask.bool()[row_prompt][:, None, :].expand(B, S, Pu),
                        torch.ones(S, S, dtype=torch.bool, device=dev).tril().expand(B, S, S)], dim=-1)[:, None]  # [B, 1, S, Pu+S]
    gqa = kv_heads != heads
    NP = U * Pu

    for layer in body.layers:
        a, m = layer.self_attn, layer.mlp
        h = _norm(layer.input_layernorm, dtype)(x)
        qkv = _linear(h, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), _cat_bias(a.q_proj, a.k_proj, a.v_proj))
        qkv = qkv.view(-1, heads + 2 * kv_heads, D)
        if hasattr(a, "q_norm"):
            qk = torch.cat([a.q_norm(qkv[:, :heads]), a.k_norm(qkv[:, heads : heads + kv_heads])], dim=1)
        else:
            qk = qkv[:, : heads + kv_heads]
        qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        qp, kp, vp = (t[:NP].view(U, Pu, -1, D).transpose(1, 2) for t in (q, k, v))
        ctx_p = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask_pp, scale=scale, enable_gqa=gqa)
        parts = [ctx_p.transpose(1, 2).reshape(NP, heads * D)]
        if S:
            qs, ks, vs = (t[NP:].view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
            ks = torch.cat([kp[row_prompt], ks], dim=2)  # [B, Hk, Pu+S, D]: the row's prompt, then its own tokens
            vs = torch.cat([vp[row_prompt], vs], dim=2)
            ctx_s = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask_s, scale=scale, enable_gqa=gqa)
            parts.append(ctx_s.transpose(1, 2).reshape(B * S, heads * D))
        x = _residual(x, torch.cat(parts) if S else parts[0], a.o_proj)
        h = _norm(layer.post_attention_layernorm, dtype)(x)
        gate, up = _linear(h, torch.cat([m.gate_proj.weight, m.up_proj.weight]), _cat_bias(m.gate_proj, m.up_proj)).chunk(2, dim=-1)
        x = _residual(x, m.act_fn(gate) * up, m.down_proj)

    x = _norm(body.norm, dtype)(x)
    first = x[:NP].view(U, Pu, -1)[:, -1][row_prompt]  # the last prompt token predicts completion token 0
    if not S:
        return first[:, None]
    return torch.cat([first[:, None], x[NP:].view(B, S, -1)], dim=1)
