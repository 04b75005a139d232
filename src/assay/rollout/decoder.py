"""Incremental decoding with a preallocated KV cache, for the Llama family of models.

`generate()`-style decoding through a Hugging Face model pays, at every token, for
growing the KV cache by concatenation (an O(T²) copy over a completion), for building
attention masks, and for a dozen small modules per layer. On a CPU with a small model
that overhead is larger than the arithmetic. `StaticDecoder` runs the same model's own
modules and weights, but keeps keys and values in buffers sized once for the whole
completion, fuses the q/k/v and gate/up projections into one matmul each, and attends
with two batched matmuls over the slots written so far (a recorded step: the whole buffer).

Left padding makes every row's prompt end in the same column, so the token generated at
step s of every row is written to the same cache slot `P + s`; only position ids differ
by row. The prefill runs each prompt once through `assay.models.llama.prompt_cache` and copies
its keys and values into the buffers, G times.

Supported: the Llama family as `assay.models.llama.supported` defines it (Llama, Mistral, Qwen2,
Qwen3 with its q/k norms, with or without projection biases). Anything else, and
sequences longer than a sliding attention window, use the generic Hugging Face path
(`supported()` says why). `tests/test_numerics.py` checks that both paths draw the same
tokens with the trainer's logprobs.

On a CUDA device a step is launch-bound, not bandwidth-bound: a 24-layer model runs some
450 small kernels per token in bf16 (18 a layer), each costing more to launch from Python
than to execute.
`StaticDecoder.graphed()` records one step as a CUDA graph (`CudaGraphStep`) and replays it:
the step's shapes are fixed (the batch keeps its rows; finished ones are ignored) and the cache
slot it writes is a device tensor (`slot`), so nothing in the step depends on a Python value.
On a CPU the same step runs eagerly.
"""

from __future__ import annotations

import contextlib
import threading
import warnings

import torch
import torch.nn.functional as F

from assay.models.llama import _cat_bias, _norm, fused_weight, prompt_cache, rotary_table
from assay.models.lora import bias_of, weight_of


def cache_arg(model) -> str:
    """The name a model's forward takes its KV cache by: `cache` (transformers ≥ 5.2x), else `past_key_values`.

    An older model's forward takes unknown keywords into `**kwargs` and ignores them, so passing
    the cache by the wrong name decodes every token without its context, silently.
    """
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_prefill(model, ids: torch.Tensor, mask: torch.Tensor, **inputs):
    """The model's own forward over left-padded prompts: next-token logits `[U, V]` and the filled `DynamicCache`.

    `inputs` go to the forward as they are (a vision-language model's `pixel_values`).
    """
    from transformers import DynamicCache

    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **{cache_arg(model): cache}, **inputs)
    return out.logits[:, -1], cache


def _linear_t(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed as `(weight @ xᵀ)ᵀ`.

    With few rows (a decode step's batch) MKL runs the weight-major product much faster:
    on the bench's 64-row shapes, 85–95 GFLOP/s against 50–57 over the four layers' weights
    at two threads (it splits the weight's rows across threads, not the batch's).
    """
    out = weight @ x.t() if bias is None else torch.addmm(bias[:, None], weight, x.t())
    return out.t()


class StaticDecoder:
    """Decode step by step from a prefilled prompt batch; holds the caches of one `generate` call.

    Build it once per call (weights are read when it is built, so it always sees the
    current policy), then `prefill` and `step` in turn; `select` keeps only some rows.

    Per layer and token a step runs 18 kernels on a GPU in bf16, against about 55 in the
    model's own modules: RMSNorm as one `F.rms_norm` (and its weight in bf16: `_norm`),
    rotary embeddings read from a table built at prefill and applied to queries and keys
    together (the sign of `rotate_half` folded into the table; one batched product by each
    row's rotation, built once a step for all layers; on a CPU `x·cos + roll(x)·sin`), the
    attention scale folded into the fused query weights (when there is no q-norm after
    them), masking fused into the score matmul (`baddbmm`), the attention's softmax one
    kernel in any dtype, the residual sums in the output projections' GEMMs (`residual`; on
    a CPU every projection weight-major instead, `_linear_t`). A recorded step still pays a few
    microseconds a kernel, so at 0.5B (24 layers, ~1 GB of weights, 0.3 ms of an H100's
    bandwidth) the count is what the step time is made of.
    """

    def __init__(self, model, compile: bool = False):
        self.model = model
        self.compile = compile
        cfg = model.config
        body = model.model
        attn0 = body.layers[0].self_attn
        first = next(model.parameters())
        dtype = first.dtype
        # the CPU's form of the step: weight-major products (they pay off with MKL) and elementwise rotary
        # embeddings; elsewhere the form with the fewest kernels (`x @ Wᵀ` as cuBLAS takes it, residual
        # sums in `addmm`, rotary embeddings as one batched product a layer)
        self.cpu_form = first.device.type == "cpu"
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(attn0, "head_dim", None) or cfg.hidden_size // self.heads
        # rotary embeddings as a product by each row's [D, D] rotation: one kernel a layer for three, and fewer bytes
        # than the three read and write while D ≤ 5 (Hq + Hk); in bf16/fp16 only (an fp32 product would run in TF32)
        self.rotation_product = not self.cpu_form and dtype != torch.float32 and self.head_dim <= 5 * (self.heads + self.kv_heads)
        scale = getattr(attn0, "scaling", self.head_dim**-0.5)
        self.qk_norm = hasattr(attn0, "q_norm")
        self.scale = scale if self.qk_norm else 1.0  # without a q-norm the scale lives in the query weights
        q_rows = self.heads * self.head_dim
        self.layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            w_qkv = fused_weight(a.q_proj, a.k_proj, a.v_proj)  # a LoRA layer's with its delta folded in (W + s·B·A)
            b_qkv = _cat_bias(a.q_proj, a.k_proj, a.v_proj)
            if not self.qk_norm:
                w_qkv[:q_rows] *= scale
                if b_qkv is not None:
                    b_qkv[:q_rows] *= scale
            self.layers.append((
                _norm(layer.input_layernorm, dtype), w_qkv, b_qkv, a, (weight_of(a.o_proj), bias_of(a.o_proj)),
                _norm(layer.post_attention_layernorm, dtype), fused_weight(m.gate_proj, m.up_proj), _cat_bias(m.gate_proj, m.up_proj), m,
                (weight_of(m.down_proj), bias_of(m.down_proj)),
            ))
        self.final_norm = _norm(body.norm, dtype)
        self.keys = self.values = self.bias = self.slot = None
        self.filled = 0  # cache slots written so far (the prompts' and the steps'), counted on the host

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, repeat: int, max_new_tokens: int) -> torch.Tensor:
        """Run the prompts `[U, P]` once; return next-token logits `[U, V]`; size caches for `U·repeat` rows."""
        last, keys, values = prompt_cache(self.model, ids, mask)
        U, P = ids.shape
        B, S = U * repeat, P + max_new_tokens
        ref = keys[0]
        # one buffer per layer, not one for all: a compiled step then writes each layer's slot in place
        # (a slice of one big buffer is a view, which torch.compile would copy whole at every step)
        self.keys = [ref.new_zeros((B, self.kv_heads, S, self.head_dim)) for _ in self.layers]  # [B, Hk, S, D] each
        self.values = [ref.new_zeros((B, self.kv_heads, S, self.head_dim)) for _ in self.layers]
        for i, (k, v) in enumerate(zip(keys, values)):  # each prompt's cache, copied to its G rows
            self.keys[i].view(U, repeat, self.kv_heads, S, self.head_dim)[:, :, :, :P] = k[:, None]
            self.values[i].view(U, repeat, self.kv_heads, S, self.head_dim)[:, :, :, :P] = v[:, None]
        logits = self.model.get_output_embeddings()(last)
        bias = torch.full((B, S), float("-inf"), dtype=ref.dtype, device=ref.device)  # slots not yet written
        bias[:, :P].masked_fill_(mask.repeat_interleave(repeat, 0) == 1, 0.0)
        self.bias = bias
        self.slot = torch.full((1,), P, dtype=torch.long, device=ref.device)  # the cache slot the next step writes
        self.filled = P
        self.cos, self.sin = rotary_table(self.model, ref, torch.arange(S, device=ref.device))  # every position a row can reach
        eye = torch.eye(self.head_dim, dtype=ref.dtype, device=ref.device)
        self.eye, self.swap = eye, eye.roll(self.head_dim // 2, dims=0)  # swap[i, j] = 1 where i = j + D/2 (mod D)
        return logits

    def select(self, idx: torch.Tensor) -> None:
        """Keep only rows `idx` of the batch (finished rows leave it)."""
        self.keys = [k.index_select(0, idx) for k in self.keys]
        self.values = [v.index_select(0, idx) for v in self.values]
        self.bias = self.bias.index_select(0, idx)

    @torch.no_grad()
    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (`tok [A]`, position ids `pos [A, 1]`); return logits `[A, V]`.

        Attends over the slots written so far, not the whole buffer: a step late in a long completion
        reads its cache, an early one only the prompt's (the buffer's first slots are a strided view,
        which batched matmul reads in place)."""
        logits = self.forward_token(tok, pos, self.filled + 1)
        self.slot += 1
        self.filled += 1
        return logits

    def graphed(self, tok: torch.Tensor, pos: torch.Tensor) -> "CudaGraphStep":
        """This decoder's step recorded as a CUDA graph, with `tok`, `pos` as the first step's inputs (no rows leave afterwards)."""
        return CudaGraphStep(self, tok, pos)

    def forward_token(self, tok: torch.Tensor, pos: torch.Tensor, span: int | None = None) -> torch.Tensor:
        """One step's computation, writing cache slot `slot` (not advanced): the body of `step` and of its CUDA graph.

        `span`: how many of the cache's first slots it attends over (they must hold every written slot and this
        step's); None, the whole buffer, as a recorded step does (one graph serves every step, so its shapes are the
        buffer's).

        With `compile`, the step runs through `torch.compile` (Inductor fuses the norms, rotary
        embeddings, residual adds and activations into a few kernels); compiled once per process
        for any batch and cache size (`dynamic=True`).
        """
        if self.compile:
            try:
                with compiled_calls():
                    return _compiled_forward()(self, unviewed(tok), unviewed(pos), span)
            except Exception as e:  # Inductor's failures have many types; the step still runs, eagerly
                self.compile = False
                compile_failed("the decoding step", "decoding eagerly", e, stacklevel=2)
        return self._forward_token(tok, pos, span)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return _linear_t(x, weight, bias) if self.cpu_form else F.linear(x, weight, bias)

    def residual(self, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x + linear(h, weight, bias)`, or without a bias off a CPU, the product summed into `x` in place (one GEMM with
        β = 1; out of place, `addmm` would copy `x` first). Not with one row, where cuBLASLt would read `x` as a bias
        vector while writing it."""
        if self.cpu_form or bias is not None or x.shape[0] == 1:
            return x + self.linear(h, weight, bias)
        return x.addmm_(h, weight.t())

    def _forward_token(self, tok: torch.Tensor, pos: torch.Tensor, span: int | None = None) -> torch.Tensor:
        body = self.model.model
        A, slot = tok.shape[0], self.slot
        Hq, Hk, D = self.heads, self.kv_heads, self.head_dim
        S, G = span or self.keys[0].shape[2], Hq // Hk
        linear = self.linear
        x = body.embed_tokens(tok)  # [A, H]: one row per sequence
        cos, sin = self.cos[pos[:, 0]][:, None], self.sin[pos[:, 0]][:, None]  # [A, 1, D], broadcast over heads
        # rope(x)_j = x_j·cos_j + x_(j+D/2 mod D)·sin_j: elementwise on a CPU (three kernels a layer), else as x @ R
        # with each row's rotation R [D, D] built here once for all layers (one kernel a layer; the products are
        # exact and summed in fp32, so rounded once)
        rotation = torch.addcmul(cos * self.eye, sin, self.swap) if self.rotation_product else None  # [A, D, D]
        self.bias.index_fill_(1, slot, 0.0)  # this step's slot becomes visible
        # the mask for every (row, kv head) pair of the batched score matmul, built once per step
        bias = self.bias[:, None, None, :S].expand(A, Hk, G, S).reshape(A * Hk, G, S)
        for i, (norm_in, w_qkv, b_qkv, attn, o_proj, norm_post, w_gu, b_gu, mlp, down_proj) in enumerate(self.layers):
            qkv = linear(norm_in(x), w_qkv, b_qkv).contiguous().view(A, Hq + 2 * Hk, D)
            if self.qk_norm:
                qk = torch.cat([attn.q_norm(qkv[:, :Hq]), attn.k_norm(qkv[:, Hq : Hq + Hk])], dim=1)
            else:
                qk = qkv[:, : Hq + Hk]
            # rotary, queries and keys at once
            qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin) if rotation is None else torch.bmm(qk, rotation)
            self.keys[i].index_copy_(2, slot, qk[:, Hq:, None])
            self.values[i].index_copy_(2, slot, qkv[:, Hq + Hk :, None])
            # attend over the first S slots (unwritten ones are masked): [A, Hk, :S] is one strided
            # view [A·Hk, S, D], read in place. Grouped-query attention without repeating keys: the
            # query heads of a kv head share a matmul.
            keys, values = self.keys[i][:, :, :S].reshape(A * Hk, S, D), self.values[i][:, :, :S].reshape(A * Hk, S, D)
            scores = torch.baddbmm(bias, qk[:, :Hq].reshape(A * Hk, G, D), keys.transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores, dim=-1)  # in bf16 too: computed in fp32, rounded once
            x = self.residual(x, torch.bmm(probs, values).view(A, Hq * D), *o_proj)
            gate, up = linear(norm_post(x), w_gu, b_gu).chunk(2, dim=-1)
            x = self.residual(x, mlp.act_fn(gate) * up, *down_proj)
        return self.model.get_output_embeddings()(self.final_norm(x))


_COMPILED = None
_COMPILED_CALLS = threading.Lock()


def _compiled_forward():
    """`StaticDecoder._forward_token` through `torch.compile`, made on first use and shared by every decoder."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(StaticDecoder._forward_token, dynamic=True)
    return _COMPILED


#: one recording at a time in a process: the caching allocator's capture bookkeeping is process-wide, and an
#: asynchronous run decodes in two threads (the producer's batches, the learner's evaluations and greedy baselines).
#: Reentrant: a recording thread's own compiled step takes it again (`compiled_calls`).
_RECORDING = threading.RLock()


def compile_failed(what: str, instead: str, e: Exception, stacklevel: int) -> None:
    """Warn that compiling `what` failed (the exception's type and first line) and what runs `instead`; `stacklevel`
    as the caller's own `warnings.warn` would take it."""
    first = str(e).splitlines()[0] if str(e) else ""
    warnings.warn(f"assay: torch.compile failed on {what} ({type(e).__name__}: {first}); {instead}", stacklevel=stacklevel + 1)


def unviewed(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it is a view of another tensor: what compiled code is given. Dynamo guards a view's base, so
    a view in one call (the first step's inputs, cut from the prompts') and a plain tensor in the next would compile
    the same code twice."""
    return t if t._base is None else t.clone()


@contextlib.contextmanager
def compiled_calls():
    """Held around every call of compiled code: Dynamo's guards and recompiles are not thread-safe, and compiling
    (Triton's autotuning) synchronises the whole device, which would break another thread's graph recording."""
    with _RECORDING, _COMPILED_CALLS:
        yield


class CudaGraphStep:
    """A `StaticDecoder` step recorded once as a CUDA graph and replayed for every later token.

    Built after the prefill with the first step's real inputs: two warm-up runs (cuBLAS picks
    its kernels, the allocator settles) and the capture all compute that same first step, so
    they write exactly what it writes (its keys and values into slot `slot`, which they do not
    advance). Each call copies the inputs into the graph's own buffers, replays it and advances
    the slot; the logits it returns live in the graph's output buffer, overwritten by the next
    call. The batch is fixed: `select` is not allowed.

    Recorded on a stream of its own on the tensors' device (not `torch.cuda.graph`'s one shared
    stream, made on whichever device is current: on `cuda:1` the kernels would run eagerly on that
    device's default stream and leave an empty graph), one recording at a time, in thread-local
    capture mode, so another thread's allocations and synchronisations meanwhile are not refused;
    and without `torch.cuda.graph`'s device-wide synchronise and cache emptying on entry.
    """

    def __init__(self, decoder: StaticDecoder, tok: torch.Tensor, pos: torch.Tensor):
        self.decoder = decoder
        self.tok, self.pos = tok.clone(), pos.clone()
        device = tok.device
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.graph = torch.cuda.CUDAGraph()
        with _RECORDING, torch.cuda.device(device), torch.cuda.stream(self.stream), torch.no_grad():
            for _ in range(2):
                decoder.forward_token(self.tok, self.pos)
            self.stream.synchronize()
            self.graph.capture_begin(capture_error_mode="thread_local")
            try:
                self.logits = decoder.forward_token(self.tok, self.pos)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the stream must not stay capturing; the step's own error is the one to see
                    self.graph.capture_end()
                raise
            self.graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(self.stream)

    def step(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.tok.copy_(tok)
        self.pos.copy_(pos)
        self.graph.replay()
        self.decoder.slot += 1
        self.decoder.filled += 1
        return self.logits
