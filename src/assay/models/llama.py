"""assay's own forward for the Llama family (Llama, Mistral, Qwen2, Qwen3), from the model's own weights.

Hugging Face's modules run a layer as a dozen small operations per token stream and
always over whole padded rows. For decoder-only models laid out like Llama's
(`q/k/v/o_proj`, `gate/up/down_proj`, pre-norm residual blocks, rotary embeddings from the
model's own `rotary_emb`) this module runs the same computation with fewer, larger
operations: every token as one flat matrix through the token-wise parts of a layer —
RMSNorm as one `F.rms_norm` (in fp32), the q/k/v projections fused into one matmul,
rotary embeddings on queries and keys at once (`x·cos + roll(x)·sin`, rotate_half's sign
folded into the table), the gate/up projections fused into one matmul — with attention
the only place where sequences are seen apart. `supported()` says when a model can take
it (and why not otherwise).

Training (`prefix_hidden`): a GRPO batch holds G completions of every prompt, and the
model's own forward runs each row whole, the prompt G times, padded to the longest
prompt every time. Here each distinct prompt runs once and the completions' queries
attend to their own prompt's keys and values (shared, so the backward pass sums the G
rows' gradients into them) and causally to their own tokens: the shared-prefix forward
of Prefix Grouper (Liu et al. 2025, "Prefix Grouper: Efficient GRPO Training through
Shared-Prefix Forward", arXiv:2506.05433). The logprobs and gradients are those of the
plain forward up to rounding (`tests/test_numerics.py` checks both to 1e-5).

Sampling (`prompt_cache`): the same prompt stream fills the decoder's KV cache
(`assay.rollout.decoder`).
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn.functional as F

from assay.models.lora import bias_of, unsupported as lora_unsupported, weight_of

FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def supported(model, max_len: int | None = None) -> str | None:
    """None when assay's own forward (this module, and `StaticDecoder`) can run `model` on sequences of up to `max_len` tokens, else the reason it cannot.

    A sliding attention window is fine when every sequence fits in it (`max_len` given and
    no longer than the window): attention then sees the whole sequence either way.
    """
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILY:
        return f"model_type {kind!r} is not one of {', '.join(FAMILY)}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ["full_attention"]):
        return "sliding-window attention layers"
    window = getattr(cfg, "sliding_window", None)
    if window and getattr(cfg, "use_sliding_window", True) and (max_len is None or max_len > window):  # Mistral has no switch
        return f"sliding-window attention (window {window}, sequences up to {max_len or 'unknown'} tokens)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "tensor-parallel pretraining layout (pretraining_tp > 1)"
    body = getattr(model, "model", None)
    if body is None or not all(hasattr(body, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "the model does not expose embed_tokens/layers/norm/rotary_emb"
    layer = body.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention without q/k/v/o projections"
    if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj", "act_fn")):
        return "MLP without gate/up/down projections"
    rope = getattr(body.rotary_emb, "rope_type", "default")
    if rope in ("dynamic", "longrope"):  # their frequencies depend on the sequence length of each call
        return f"rope_type {rope!r}"
    return lora_unsupported(model)


def _cat_bias(*linears) -> torch.Tensor | None:
    biases = [bias_of(lin) for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else weight_of(lin).new_zeros(weight_of(lin).shape[0]) for b, lin in zip(biases, linears)])


def fused_weight(*linears) -> torch.Tensor:
    """The weights of `linears` stacked into one `[Σout, in]` matrix, each as it applies (a LoRA layer's with its delta: `weight_of`)."""
    return torch.cat([weight_of(lin) for lin in linears])


def _norm(module, dtype: torch.dtype):
    """An RMSNorm module (`variance_epsilon`, `weight`: Llama's, Qwen2's, Mistral's) as a fused `F.rms_norm` call.

    In fp32 one call. In bf16 or fp16 the module normalises in fp32, rounds to its dtype and
    only then multiplies by its weight, where `F.rms_norm` with the weight multiplies before
    rounding (the two differ in the last bit of about a quarter of the values): so the norm
    without its weight, then the weight: two kernels on a GPU for the module's eight, the
    module's own values on a CPU (the same operations), on a GPU to the fp32 sum's order.
    """
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if weight is None or eps is None:
        return module
    shape = tuple(weight.shape)
    if dtype == torch.float32:
        return lambda x: F.rms_norm(x, shape, weight, eps)
    return lambda x: F.rms_norm(x, shape, None, eps) * weight


def rotary_table(model, like: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[N, D]` of the model's rotary embedding at positions `pos [N]`, with rotate_half's sign folded into sin.

    Then `rope(x) = x·cos + roll(x, D/2)·sin`: `roll` gives `(x₂, x₁)` where rotate_half
    gives `(−x₂, x₁)`, and the sign lives in the first half of sin.
    """
    cos, sin = model.model.rotary_emb(like, pos[None])
    cos, sin = cos[0].to(like.dtype), sin[0].to(like.dtype)
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)


def enable_checkpointing(model) -> None:
    """Turn on `model`'s own activation checkpointing, non-reentrant (`train.activation_checkpointing`); assay's forward
    (`prefix_hidden`) reads the same flag (`checkpointing`). By whichever name this transformers has it."""
    if hasattr(type(model), "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing(model) -> bool:
    """Whether `model`'s activation checkpointing is on."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return False


def sharded(model) -> bool:
    """Whether `model`'s weights are shards (FSDP2's DTensors), which only its own forward gathers. Any of them: after a
    forward FSDP2 leaves the root's own weights (embeddings, final norm) whole, the layers' sharded."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def batch_supported(model, batch) -> str | None:
    """None when `prefix_hidden` can run `batch` through `model`, else the reason it cannot."""
    why = supported(model, max_len=batch.input_ids.shape[1])
    if why is not None:
        return why
    if sharded(model):
        return "sharded weights (FSDP2): the model's own forward gathers them"
    if getattr(model.config, "attention_dropout", 0.0) and model.training:
        return "attention dropout"
    why = lora_unsupported(model, training=model.training)
    if why is not None:
        return why
    T = batch.response_len
    if not bool(batch.attention_mask[:, : batch.input_ids.shape[1] - T].any(1).all()):
        return "an empty prompt"
    return None


def _residual(x: torch.Tensor, h: torch.Tensor, linear) -> torch.Tensor:
    """`x + linear(h)` with the add fused into the matmul."""
    out = torch.addmm(x, h, weight_of(linear).t())
    bias = bias_of(linear)
    return out if bias is None else out + bias


def prefix_hidden(model, batch) -> torch.Tensor:
    """Final hidden states `[B, T, H]` at the positions that predict the batch's completion tokens.

    Equal to `model.get_decoder()(...)` over the left-padded rows of `batch`, taken at
    columns `P−1 … P+T−2`, with the final norm applied.
    """
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
    x = run(model, prompt_ids, prompt_mask, row_prompt, batch.input_ids[:, P : P + S])
    first = x[: U * Pu].view(U, Pu, -1)[:, -1][row_prompt]  # the last prompt token predicts completion token 0
    if not S:
        return first[:, None]
    return torch.cat([first[:, None], x[U * Pu :].view(B, S, -1)], dim=1)


def prompt_cache(model, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill left-padded prompts `[U, P]`: the last position's final hidden state `[U, H]` and each layer's keys and values `[U, Hk, P, D]`."""
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    U, P = ids.shape
    x = run(model, ids, mask, ids.new_zeros(0), ids.new_zeros((0, 0)), kv_out=(keys, values))
    return x.view(U, P, -1)[:, -1], keys, values


def run(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, row_prompt: torch.Tensor, suffix: torch.Tensor,
        kv_out: tuple[list, list] | None = None) -> torch.Tensor:
    """The decoder over two streams: prompts `[U, Pu]` (left-padded) and completion tokens `suffix [B, S]`, row b continuing prompt `row_prompt[b]`.

    Returns the final-normed hidden states as one flat matrix: the U·Pu prompt positions,
    then the B·S completion positions. `kv_out` collects each layer's prompt keys (after
    rotary) and values, `[U, Hk, Pu, D]`.
    """
    body, cfg = model.model, model.config
    dtype = next(model.parameters()).dtype
    U, Pu = prompt_ids.shape
    B, S = suffix.shape
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn0 = body.layers[0].self_attn
    D = getattr(attn0, "head_dim", None) or cfg.hidden_size // heads
    scale = getattr(attn0, "scaling", D**-0.5)
    dev = prompt_ids.device

    prompt_len = prompt_mask.sum(1)
    pos = torch.cat([((prompt_mask.cumsum(1) - 1).clamp(min=0)).reshape(-1),
                     (prompt_len[row_prompt][:, None] + torch.arange(S, device=dev)).reshape(-1)])
    x = torch.cat([body.embed_tokens(prompt_ids).flatten(0, 1), body.embed_tokens(suffix).flatten(0, 1)])  # [N, H]: prompts, then completions
    cos, sin = rotary_table(model, x, pos)
    cos, sin = cos[:, None], sin[:, None]  # [N, 1, D]: broadcast over heads

    # attention masks (True: may attend). Pad queries also see themselves, so no row is empty;
    # their outputs reach no real token (pad keys are masked for every real query).
    causal_p = torch.ones(Pu, Pu, dtype=torch.bool, device=dev).tril()
    mask_pp = (causal_p & prompt_mask.bool()[:, None, :]) | torch.eye(Pu, dtype=torch.bool, device=dev)
    mask_pp = mask_pp[:, None]  # [U, 1, Pu, Pu]
    mask_s = torch.cat([prompt_mask.bool()[row_prompt][:, None, :].expand(B, S, Pu),
                        torch.ones(S, S, dtype=torch.bool, device=dev).tril().expand(B, S, S)], dim=-1)[:, None]  # [B, 1, S, Pu+S]
    gqa = kv_heads != heads
    # On CUDA, SDPA's memory-efficient kernel takes a mask but not grouped keys, and the flash
    # kernel takes grouped keys but no mask: with both it falls back to the math kernel, which
    # keeps every attention score for the backward. Keys and values repeated per query head
    # (the same arithmetic) let the memory-efficient kernel run. A CPU's kernels take both.
    per_head = (lambda t: t.repeat_interleave(heads // kv_heads, dim=1)) if gqa and dev.type == "cuda" else (lambda t: t)
    sdpa_gqa = gqa and dev.type != "cuda"
    NP = U * Pu

    def block(x: torch.Tensor, layer) -> torch.Tensor:
        a, m = layer.self_attn, layer.mlp
        h = _norm(layer.input_layernorm, dtype)(x)
        qkv = F.linear(h, fused_weight(a.q_proj, a.k_proj, a.v_proj), _cat_bias(a.q_proj, a.k_proj, a.v_proj))
        qkv = qkv.view(-1, heads + 2 * kv_heads, D)
        if hasattr(a, "q_norm"):
            qk = torch.cat([a.q_norm(qkv[:, :heads]), a.k_norm(qkv[:, heads : heads + kv_heads])], dim=1)
        else:
            qk = qkv[:, : heads + kv_heads]
        qk = qk * cos + qk.roll(D // 2, dims=-1) * sin
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
        qp, kp, vp = (t[:NP].view(U, Pu, -1, D).transpose(1, 2) for t in (q, k, v))
        if kv_out is not None:
            kv_out[0].append(kp)
            kv_out[1].append(vp)
        ctx_p = F.scaled_dot_product_attention(qp, per_head(kp), per_head(vp), attn_mask=mask_pp, scale=scale, enable_gqa=sdpa_gqa)
        parts = [ctx_p.transpose(1, 2).reshape(NP, heads * D)]
        if S:
            qs, ks, vs = (t[NP:].view(B, S, -1, D).transpose(1, 2) for t in (q, k, v))
            ks = torch.cat([kp[row_prompt], ks], dim=2)  # [B, Hk, Pu+S, D]: the row's prompt, then its own tokens
            vs = torch.cat([vp[row_prompt], vs], dim=2)
            ctx_s = F.scaled_dot_product_attention(qs, per_head(ks), per_head(vs), attn_mask=mask_s, scale=scale, enable_gqa=sdpa_gqa)
            parts.append(ctx_s.transpose(1, 2).reshape(B * S, heads * D))
        x = _residual(x, torch.cat(parts) if S else parts[0], a.o_proj)
        h = _norm(layer.post_attention_layernorm, dtype)(x)
        gate, up = F.linear(h, fused_weight(m.gate_proj, m.up_proj), _cat_bias(m.gate_proj, m.up_proj)).chunk(2, dim=-1)
        return _residual(x, m.act_fn(gate) * up, m.down_proj)

    # `train.activation_checkpointing` (the model's own flag): each layer's input is kept, the layer recomputed in the backward
    recompute = checkpointing(model) and model.training and torch.is_grad_enabled() and kv_out is None
    for layer in body.layers:
        x = torch.utils.checkpoint.checkpoint(block, x, layer, use_reentrant=False) if recompute else block(x, layer)
    return _norm(body.norm, dtype)(x)
