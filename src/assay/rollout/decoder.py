"""Incremental decoding with a preallocated KV cache, for the Llama family of models.

`generate()`-style decoding through a Hugging Face model pays, at every token, for
growing the KV cache by concatenation (an O(T²) copy over a completion), for building
attention masks, and for a dozen small modules per layer. On a CPU with a small model
that overhead is larger than the arithmetic. `StaticDecoder` runs the same model's own
modules and weights, but keeps keys and values in buffers sized once for the whole
completion, fuses the q/k/v and gate/up projections into one matmul each, and attends
with two batched matmuls over the cache buffer.

Left padding makes every row's prompt end in the same column, so the token generated at
step s of every row is written to the same cache slot `P + s`; only position ids differ
by row. The prefill still goes through the model's own forward (it runs once), and its
keys and values are copied into the buffers.

Supported: decoder-only models whose layers are laid out like Llama's (`q/k/v/o_proj`,
`gate/up/down_proj`, pre-norm residual blocks, rotary embeddings from the model's own
`rotary_emb`): Llama, Mistral, Qwen2, Qwen3 (with its q/k norms), with or without
projection biases. Anything else, and sequences longer than a sliding attention window,
use the generic Hugging Face path (`supported()` says why).
`tests/test_sampler.py` checks that both paths give the trainer's logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def supported(model, max_len: int | None = None) -> str | None:
    """None when `StaticDecoder` can run `model` on sequences of up to `max_len` tokens, else the reason it cannot.

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
    return None


def hf_prefill(model, ids: torch.Tensor, mask: torch.Tensor):
    """The model's own forward over left-padded prompts: next-token logits `[U, V]` and the filled `DynamicCache`."""
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1], cache


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cat_bias(*linears) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears])


class StaticDecoder:
    """Decode step by step from a prefilled prompt batch; holds the caches of one `generate` call.

    Build it once per call (weights are read when it is built, so it always sees the
    current policy), then `prefill` and `step` in turn; `select` keeps only some rows.
    """

    def __init__(self, model):
        self.model = model
        cfg = model.config
        body = model.model
        attn0 = body.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // self.heads
        self.scale = getattr(attn0, "scaling", self.head_dim**-0.5)
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            self.layers.append((
                layer, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]), _cat_bias(a.q_proj, a.k_proj, a.v_proj),
                torch.cat([m.gate_proj.weight, m.up_proj.weight]), _cat_bias(m.gate_proj, m.up_proj),
            ))
        self.keys = self.values = self.bias = None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int) -> torch.Tensor:
        """Run the prompts `[U, P]` once; return next-token logits `[U, V]`; size caches for `U·repeat` rows."""
        logits, cache = hf_prefill(self.model, ids, mask)
        U, P = ids.shape
        B, S = U * repeat, P + max_new_tokens
        ref = cache.layers[0].keys
        self.keys = ref.new_zeros((len(self.layers), B, self.kv_heads, S, self.head_dim))
        self.values = torch.zeros_like(self.keys)
        for i, layer in enumerate(cache.layers):
            self.keys[i, :, :, :P] = layer.keys.repeat_interleave(repeat, 0)
            self.values[i, :, :, :P] = layer.values.repeat_interleave(repeat, 0)
        bias = torch.full((B, S), float("-inf"), dtype=ref.dtype, device=ref.device)  # slots not yet written
        bias[:, :P].masked_fill_(mask.repeat_interleave(repeat, 0) == 1, 0.0)
        self.bias = bias
        self.filled = P
        return logits

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows `idx` of the batch (finished rows leave it)."""
        self.keys = self.keys.index_select(1, idx)
        self.values = self.values.index_select(1, idx)
        self.bias = self.bias.index_select(0, idx)

    @torch.no_grad()
    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (`tok [A]`, position ids `pos [A, 1]`); return logits `[A, V]`."""
        body = self.model.model
        A, t = tok.shape[0], self.filled
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        x = body.embed_tokens(tok)  # [A, H]: one row per sequence
        cos, sin = body.rotary_emb(x, pos)  # [A, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        self.bias[:, t] = 0.0  # this step's slot becomes visible
        bias = self.bias[:, None, None, :]  # [A, 1, 1, S]
        for i, (layer, w_qkv, b_qkv, w_gu, b_gu) in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            q, k, v = F.linear(layer.input_layernorm(x), w_qkv, b_qkv).split(self.split, dim=-1)
            q, k, v = q.view(A, 1, Hq, D), k.view(A, 1, Hk, D), v.view(A, 1, Hk, D)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [A, heads, 1, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i, :, :, t] = k[:, :, 0]
            self.values[i, :, :, t] = v[:, :, 0]
            # attend over the whole buffer (unwritten slots are masked): a slice along the slot
            # axis would not be contiguous, and batched matmul would copy it at every step.
            # Grouped-query attention without repeating keys: query heads of a kv head share a matmul.
            keys, values = self.keys[i], self.values[i]  # [A, Hk, S, D]
            scores = q.reshape(A, Hk, Hq // Hk, D) @ keys.transpose(-1, -2) * self.scale + bias  # [A, Hk, Hq/Hk, S]
            ctx = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype) @ values  # [A, Hk, Hq/Hk, D]
            x = x + attn.o_proj(ctx.reshape(A, Hq * D))
            gate, up = F.linear(layer.post_attention_layernorm(x), w_gu, b_gu).chunk(2, dim=-1)
            x = x + mlp.down_proj(mlp.act_fn(gate) * up)
        self.filled = t + 1
        return self.model.lm_head(body.norm(x))
