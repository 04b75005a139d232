"""Run by `tests/test_dist.py` under `torchrun --nproc-per-node 2`: one update's gradients, sharded over two
ranks (each its share of the groups, scaled by the whole batch's denominator), against one process's.

Prints, on rank 0, a JSON line: the largest |sharded − single| gradient entry, the largest entry, and the loss."""

from __future__ import annotations

import copy
import json
import sys

import torch

from assay.batch import collate
from assay.config import AlgoConfig
from assay.data.tasks import make_task
from assay.models import load_policy
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training.dist import Ranks, exit_rank, shard
from assay.training.learner import accumulate_step, compute_advantages
from assay.types import RewardResult


def main(aggregation: str, lora: bool) -> None:
    torch.set_num_threads(1)
    ranks = Ranks.from_env(torch.device("cpu"))
    model, tok = load_policy("tiny-arith")
    if lora:  # adapters on every projection, B made non-zero so that A has a gradient too
        from assay.config import LoraSettings
        from assay.models.lora import apply_lora

        model, _ = apply_lora(model, LoraSettings(r=4, alpha=8))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    single = copy.deepcopy(model)
    prompts, G = make_task("arithmetic").heldout(6), 4
    trajs = TorchSampler(model, tok).generate(prompts, G, SamplingParams(8, 1.0), torch.Generator(device="cpu").manual_seed(0))
    results = [RewardResult(float(i % 3 == 0)) for i in range(len(trajs))]
    batch = collate(trajs, results, tok.pad_token_id, torch.device("cpu"))
    algo = AlgoConfig(aggregation=aggregation)
    adv = compute_advantages(batch, algo)
    single.train()
    whole = accumulate_step(single, None, batch, adv, algo, 1.0, 8, fast=False)
    shard(model, ranks)
    model.train()
    groups = ranks.share(len(prompts))
    rows = torch.arange(groups.start * G, groups.stop * G)
    total = float(batch.mask.sum()) if aggregation == "token-mean" else float(len(trajs))
    part = accumulate_step(model, None, batch.select(rows), adv[rows], algo, 1.0, 8, fast=False, total=total)
    losses = ranks.gather(part["actor/loss"])
    ref = dict(single.named_parameters())
    diff = scale = 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name  # a frozen base weight gets no gradient
            continue
        g = p.grad.full_tensor()
        diff = max(diff, float((g - ref[name].grad).abs().max()))
        scale = max(scale, float(ref[name].grad.abs().max()))
    if ranks.main:
        print(json.dumps({"max_diff": diff, "max_grad": scale, "loss_sum": sum(losses), "loss_single": whole["actor/loss"]}))
    ranks.close()


if __name__ == "__main__":
    main(sys.argv[1], "lora" in sys.argv[2:])
    exit_rank(0)
