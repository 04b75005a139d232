"""The memory-bandwidth roofline of decoding: the least time a token step can take.

A decoding step with R sequences reads every weight once (the LM head included; an
embedding lookup reads only R rows, so tied embeddings count once) and every sequence's
cached keys and values. At small batch those bytes, not the arithmetic, bound the step:

    t_min = (W + R · C̄ · kv) / BW

with W the parameters' bytes, C̄ the mean context over the steps (prompt plus half the
completion), kv the cache bytes per token (layers × 2 × kv_heads × head_dim × element size)
and BW the device's memory bandwidth. `fraction = t_min / t_measured` says how close a
decoder comes; a launch-bound decoder (a kernel per small operation, launched from Python)
sits at a few percent.
"""

from __future__ import annotations

#: peak memory bandwidth (bytes/s) of GPUs by a substring of `torch.cuda.get_device_name()`,
#: from their makers' data sheets, checked in this order (a longer name before a name inside it);
#: an unknown device is measured instead (`copy_bandwidth`)
BANDWIDTH = {
    "GH200": 4.0e12, "H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "A10G": 0.6e12,
    "A10": 0.6e12, "RTX 4090": 1.008e12, "RTX 3090": 0.936e12, "V100": 0.9e12, "T4": 0.32e12,
}


def kv_bytes_per_token(config, itemsize: int) -> int:
    """Bytes of keys and values one token adds to the cache, over all layers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * itemsize


def decode_bytes_per_step(model, rows: int, prompt_len: float, steps: int) -> float:
    """Mean bytes a decoding step must read: all weights once, and `rows` caches at the mean context over `steps` steps."""
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    weights = sum(p.numel() * p.element_size() for p in params)
    itemsize = next(iter(params)).element_size()
    mean_context = prompt_len + (steps - 1) / 2
    return weights + rows * mean_context * kv_bytes_per_token(model.config, itemsize)


def copy_bandwidth(device, gib: float = 1.0, repeats: int = 10) -> float:
    """Measured device-to-device copy bandwidth (bytes/s: read plus write) of `device`."""
    import time

    import torch

    n = int(gib * 2**30) // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        b.copy_(a)
    torch.cuda.synchronize(device)
    return 2 * a.numel() * 4 * repeats / (time.perf_counter() - t0)


def peak_bandwidth(device) -> tuple[float, str]:
    """The device's peak bandwidth (bytes/s) and where it came from: its data sheet, or a copy measured here."""
    import torch

    name = torch.cuda.get_device_name(device)
    for key, bw in BANDWIDTH.items():
        if key in name:
            return bw, f"{name}: data sheet"
    return copy_bandwidth(device), f"{name}: measured copy"
