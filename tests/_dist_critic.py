"""Run by `tests/test_dist.py` under `torchrun --nproc-per-node 2`: one fit of the learned critic, sharded over two ranks
(each its share of the groups, its loss divided by the whole minibatch's scored tokens), against one process's.

Prints, on rank 0, a JSON line: the largest |sharded − single| gradient entry, the largest entry, both critics' metrics."""

from __future__ import annotations

import json

import torch

from assay.batch import collate
from assay.config import CriticConfig
from assay.data.tasks import make_task
from assay.models import load_policy
from assay.rollout.base import SamplingParams
from assay.rollout.torch_sampler import TorchSampler
from assay.training.critic import Critic, gae_targets
from assay.training.dist import Ranks, exit_rank
from assay.types import RewardResult


def main() -> None:
    torch.set_num_threads(1)
    ranks = Ranks.from_env(torch.device("cpu"))
    model, tok = load_policy("tiny-arith")
    prompts, G = make_task("arithmetic").heldout(5), 4  # 5 groups: the ranks' shares differ (3 and 2)
    trajs = TorchSampler(model, tok).generate(prompts, G, SamplingParams(8, 1.0), torch.Generator(device="cpu").manual_seed(0))
    results = [RewardResult(float(i % 3 == 0)) for i in range(len(trajs))]
    batch = collate(trajs, results, tok.pad_token_id, torch.device("cpu"))
    cfg = CriticConfig(grad_clip=1e9)  # no clipping: the gradients stay as the backward left them, to be compared
    single, sharded = Critic(model, cfg, seed=3), Critic(model, cfg, seed=3)
    sharded.shard(ranks)
    values = single.values(batch)
    assert torch.equal(values, sharded.values(batch))  # the same critic, whole or in shards
    returns, on = gae_targets(batch.rewards, values + 0.1, batch.mask)  # targets away from the values: a real gradient
    whole = single.fit(batch, values, returns, on, epochs=1, minibatches=1)
    part = sharded.fit(batch, values, returns, on, epochs=1, minibatches=1)
    ref = dict(single.model.named_parameters())
    diff = scale = 0.0
    for name, p in sharded.model.named_parameters():
        g = p.grad.full_tensor()
        diff = max(diff, float((g - ref[name].grad).abs().max()))
        scale = max(scale, float(ref[name].grad.abs().max()))
    if ranks.main:
        print(json.dumps({"max_diff": diff, "max_grad": scale, "single": whole, "sharded": part,
                          "sharded_params": sum(p.to_local().numel() for p in sharded.model.parameters()),
                          "single_params": sum(p.numel() for p in single.model.parameters())}))
    ranks.close()


if __name__ == "__main__":
    main()
    exit_rank(0)
