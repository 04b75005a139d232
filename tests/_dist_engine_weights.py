"""Run by `tests/test_dist.py` under `torchrun --nproc-per-node 2`: what a sharded policy hands an inference engine
(`assay.training.dist.engine_weights`) against what one process hands it (`merged_weights`), with and without LoRA.

With the argument `lora`, also a LoRA policy. Prints, on rank 0, a JSON line each: the same names (each once), the largest |sharded − single| entry, and the most FSDP2 units
whole at once while the weights streamed."""

from __future__ import annotations

import copy
import json
import sys

import torch
from torch.distributed.tensor import DTensor

from assay.models import load_policy
from assay.models.lora import merged_weights
from assay.training.dist import Ranks, engine_weights, exit_rank, fsdp_modules, shard


def main(ranks: Ranks, lora: bool) -> None:
    model, _ = load_policy("tiny-arith")
    if lora:  # B made non-zero, so that the merged weights differ from the base's
        from assay.config import LoraSettings
        from assay.models.lora import apply_lora

        model, _ = apply_lora(model, LoraSettings(r=4, alpha=8))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    single = dict(merged_weights(copy.deepcopy(model)))
    shard(model, ranks)
    inner = tuple(f"{prefix}." for prefix, m in model.named_modules() if prefix and m in fsdp_modules(model))

    def unit(name: str) -> str:  # the FSDP2 unit a weight belongs to: a decoder layer's prefix, or the root's ""
        return next((prefix for prefix in inner if name.startswith(prefix)), "")

    most, diff, names = 0, 0.0, []
    for name, tensor in engine_weights(model):
        most = max(most, len({unit(n) for n, p in model.named_parameters() if not isinstance(p, DTensor)}))
        names.append(name)
        diff = max(diff, float((tensor - single[name]).abs().max()))
    if ranks.main:
        print(json.dumps({"lora": lora, "same_names": sorted(names) == sorted(single), "max_diff": diff, "most_whole_units": most,
                          "units": len(inner) + 1}))


if __name__ == "__main__":
    torch.set_num_threads(1)
    ranks = Ranks.from_env(torch.device("cpu"))
    for lora in [False, True] if "lora" in sys.argv[1:] else [False]:
        main(ranks, lora)
    ranks.close()
    exit_rank(0)
