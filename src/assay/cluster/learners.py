"""Learner workers on Ray: the ranks of one FSDP2 job as actors kept together by a placement group.

Each actor runs the same `ShardedTrainer` that `torchrun` starts, with the process group set up by assay
from the first actor's address (as verl and OpenRLHF set up theirs; Ray Train would add its own checkpoint
and report layer over the trainer's). Kept apart from `assay.cluster`, which the training loop imports,
because this module imports the training loop.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from assay.cluster import NAMESPACE, require_ray


class LearnerWorker:
    """A Ray actor: one rank of the run's FSDP2 job."""

    def __init__(self, rank: int, world: int, address: str, port: int, local_rank: int):
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank), "MASTER_ADDR": address,
                           "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})

    def run(self, config: dict[str, Any], folder: str, resume: bool) -> dict[str, Any]:
        from assay.config import RunConfig
        from assay.training.sharded import ShardedTrainer

        trainer = ShardedTrainer(RunConfig.model_validate(config), run_dir=folder, resume=resume)
        clean = False
        try:
            final = trainer.fit(progress=False).final
            clean = True
            return final
        finally:
            trainer.sampler.close()  # an engine's own groups live in the learners' process group: they go first
            trainer.ranks.close(clean)


def run_learners(cfg, folder, resume: bool) -> dict[str, Any]:
    """Train with `cluster.learner_workers` learner actors in one placement group; rank 0's final figures."""
    ray = require_ray()
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    c = cfg.cluster
    bundle = {"CPU": c.cpus_per_worker, **({"GPU": c.gpus_per_learner} if c.gpus_per_learner else {})}
    group = placement_group([bundle] * c.learner_workers, strategy="PACK")  # the ranks together, on one node where they fit
    ray.get(group.ready())
    address, port = ray.util.get_node_ip_address(), _free_port()
    cls = ray.remote(num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_learner)(LearnerWorker)
    actors = [cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=i),
                          namespace=NAMESPACE).remote(i, c.learner_workers, address, port, 0 if c.gpus_per_learner else i)
              for i in range(c.learner_workers)]
    try:
        finals = ray.get([a.run.remote(cfg.model_dump(mode="json"), str(folder), resume) for a in actors])
    finally:
        for a in actors:
            ray.kill(a)
        ray.util.remove_placement_group(group)
    return finals[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
