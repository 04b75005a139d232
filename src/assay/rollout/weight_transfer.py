"""Pushing the learner's weights to a vLLM server through vLLM's weight-transfer routes.

vLLM's server (with `VLLM_SERVER_DEV_MODE=1`) exposes `/init_weight_transfer_engine`,
`/start_weight_update`, `/update_weights` and `/finish_weight_update`; what travels inside
`/update_weights` is up to a *weight-transfer backend* chosen when the server starts
(`--weight-transfer-config '{"backend": ...}'`). vLLM's own backends move the bytes over
NCCL or CUDA IPC, which need GPUs. assay adds `assay_http`: the bytes travel in the
request body itself (base64, in chunks of about `CHUNK_BYTES`), so a CPU server and a
trainer on another machine work too. The server side (`assay.rollout.vllm_transfer_engine`)
is registered through vLLM's plugin entry point (`vllm.general_plugins` → `register`), so a
server whose Python has assay installed offers it; on the server the update is vLLM's
layerwise reload, the same as the colocated backend's.

This module imports no vLLM: the trainer side needs only the server's URL.
"""

from __future__ import annotations

import base64
from typing import Any, Iterable, Iterator

import torch

from assay.models.lora import merged_weights

BACKEND = "assay_http"
#: raw bytes per `/update_weights` request (the body is a third larger, base64)
CHUNK_BYTES = 64 << 20
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


def register() -> None:
    """vLLM plugin entry point: make `assay_http` a weight-transfer backend in this vLLM process."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "assay.rollout.vllm_transfer_engine", "HTTPWeightTransferEngine")
    except ValueError:  # already registered in this process
        pass


def encode_chunks(model: Any, chunk_bytes: int = CHUNK_BYTES, weights: Iterable[tuple[str, torch.Tensor]] | None = None,
                  ) -> Iterator[dict[str, Any]]:
    """`update_info` payloads carrying every parameter of `model` (tied names included), about `chunk_bytes` each;
    `weights`: the `(name, tensor)` pairs to send instead (a sharded policy's, gathered one unit at a time).

    Each payload: `names`, `dtype_names`, `shapes` (one per tensor) and `data`, the tensors'
    bytes back to back in that order, base64-encoded.
    """
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    parts: list[bytes] = []
    size = 0
    for name, p in merged_weights(model) if weights is None else weights:  # a LoRA policy's layers as W + s·B·A (assay.models.lora)
        t = p.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        names.append(name)
        dtypes.append(DTYPE_NAMES[t.dtype])
        shapes.append(list(t.shape))
        parts.append(raw)
        size += len(raw)
        if size >= chunk_bytes:
            yield _payload(names, dtypes, shapes, parts)
            names, dtypes, shapes, parts, size = [], [], [], [], 0
    if names:
        yield _payload(names, dtypes, shapes, parts)


def _payload(names: list[str], dtypes: list[str], shapes: list[list[int]], parts: list[bytes]) -> dict[str, Any]:
    return {"names": names, "dtype_names": dtypes, "shapes": shapes, "data": base64.b64encode(b"".join(parts)).decode("ascii")}


def decode_chunk(names: list[str], dtype_names: list[str], shapes: list[list[int]], data: str) -> list[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` pairs of one payload (the inverse of `encode_chunks`)."""
    raw = bytearray(base64.b64decode(data))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8, device="cpu")
    out, offset = [], 0
    for name, dtype_name, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, dtype_name)
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype, device="cpu").element_size()
        out.append((name, flat[offset : offset + n].view(dtype).reshape(shape)))
        offset += n
    if offset != len(raw):
        raise ValueError(f"weight payload holds {len(raw)} bytes, its metadata describes {offset}")
    return out
