"""`train.activation_checkpointing`: memory the update keeps for its backward pass, and its time, with and without.

    python benchmarks/activation_checkpointing.py [--prompts 16 --group 8 --tokens 16 --repeats 5]

One batch of the main job's shape sampled from the bundled model, then the update's forward and
backward (`token_logprobs` and a sum of logprobs) through assay's forward (`fast`) and through the
model's own, each with activation checkpointing off and on. "Kept" is the bytes of the distinct
tensors autograd saves for the backward pass while the forward runs (`saved_tensors_hooks`),
the memory checkpointing removes; with it on, each layer's intermediates are made again, one layer
at a time, while that layer's backward runs. Time: the median of `--repeats` forward+backward passes.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from assay.batch import collate
from assay.data.tasks import make_task
from assay.models import load_policy
from assay.models.llama import enable_checkpointing
from assay.models.logprobs import token_logprobs
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.types import RewardResult


def kept_bytes(model, batch, fast: bool) -> int:
    seen: set[tuple[int, torch.dtype]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(model, batch, 1.0, fast=fast)
    return total


def seconds(model, batch, fast: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad()
        t0 = time.perf_counter()
        lp, _ = token_logprobs(model, batch, 1.0, fast=fast)
        (lp * batch.mask).sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_policy("tiny-arith")
    prompts = [s for _, s in zip(range(args.prompts), make_task("arithmetic").stream("train", 1))]
    trajs = TorchSampler(model, tok).generate(prompts, args.group, SamplingParams(args.tokens, 1.0), torch.Generator().manual_seed(0))
    batch = collate(trajs, [RewardResult(0.0)] * len(trajs), tok.pad_token_id, torch.device("cpu"))
    print(f"tiny-arith ({model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}), {len(trajs)} rows, "
          f"{int(batch.attention_mask.sum())} tokens, torch threads {args.threads}\n")
    print("| forward | checkpointing | kept for the backward (MiB) | forward + backward (s) |\n|---|---|---|---|")
    for fast in (True, False):
        for on in (False, True):
            m = copy.deepcopy(model).train()
            if on:
                enable_checkpointing(m)
            kept = kept_bytes(m, batch, fast) / 2**20
            print(f"| {'assay' if fast else 'model own'} | {'on' if on else 'off'} | {kept:.2f} | {seconds(m, batch, fast, args.repeats):.3f} |")


if __name__ == "__main__":
    main()
