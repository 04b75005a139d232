"""Workers placed by Ray (`assay.cluster`), on a local Ray cluster: a run trains through them, and a worker that
dies loses nothing — a reward actor's items are scored again, a rollout actor's prompts come in the next batch."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'assay[ray]')")

from assay.rewards.base import Reward  # noqa: E402
from assay.types import RewardResult, Sample, Trajectory  # noqa: E402

pytestmark = pytest.mark.slow


class SlowLength(Reward):
    """Scores a completion by its length, slowly, and logs each call (item id, process) to a file."""

    name = "slow_length"

    def __init__(self, log: str, seconds: float = 0.15):
        self.log, self.seconds = log, seconds

    def score(self, traj: Trajectory) -> RewardResult:
        import os

        time.sleep(self.seconds)
        with open(self.log, "a") as f:
            f.write(f"{traj.sample.id} {os.getpid()}\n")
        return RewardResult(float(len(traj.completion)))


@pytest.fixture(scope="module")
def cluster():
    from assay.cluster import connect, shutdown
    from assay.config import ClusterConfig

    # room for the largest run here: two learner ranks, each with two reward actors, and two rollout actors
    started = connect(ClusterConfig(ray=True, rollout_workers=2, reward_workers=2, learner_workers=2))
    yield
    shutdown(started)


def _trajs(n: int) -> list[Trajectory]:
    return [Trajectory(Sample(str(i), "p", None), "x" * (i % 7), [], [], [], True) for i in range(n)]


def test_a_reward_actor_killed_mid_batch_loses_no_item_and_doubles_none(cluster, tmp_path):
    from assay.cluster import RayRewardExecutor

    log = tmp_path / "calls.txt"
    ex = RayRewardExecutor(SlowLength(str(log)), actors=2, workers=0, timeout=30, key="test")
    victim = ex.handles[1]
    victim_pid = ray.get(victim.pid.remote())
    batch = _trajs(24)
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(results=ex.score(batch)))
    t.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not log.is_file() or str(victim_pid) not in log.read_text()):
        time.sleep(0.05)
    ray.kill(victim)  # mid-batch: some of its items scored, the rest not
    t.join(timeout=300)
    results = out["results"]
    assert [r.score for r in results] == [float(i % 7) for i in range(24)]  # every item exactly once, in order
    calls = [line.split() for line in log.read_text().splitlines()]
    by_item = {}
    for item, pid in calls:
        by_item.setdefault(item, []).append(pid)
    assert set(by_item) == {str(i) for i in range(24)}
    redone = [i for i, pids in by_item.items() if len(pids) > 1]
    assert all(str(victim_pid) in by_item[i] for i in redone)  # only the dead actor's items were scored twice
    stats = ex.stats()
    assert stats["cluster/reward_actor_restarts"] == 1.0 and stats["reward/executor/items"] == 24.0
    ex.close()


def test_a_rollout_actor_that_dies_fails_its_prompts_into_the_next_batch(cluster):
    import torch

    from assay.config import RunConfig
    from assay.data.tasks import make_task
    from assay.models import load_policy
    from assay.cluster import RaySampler
    from assay.rollout.base import SamplingParams

    cfg = RunConfig.model_validate({"run_name": "rollout-death", "cluster": {"ray": True, "rollout_workers": 2}})
    model, tok = load_policy("tiny-arith")
    sampler = RaySampler(model, tok, cfg, torch.device("cpu"))
    prompts = make_task("arithmetic").heldout(8)
    params = SamplingParams(6, 1.0)
    ray.kill(sampler.handles[1])
    first = sampler.generate(prompts, 2, params, torch.Generator(device="cpu").manual_seed(0))
    assert {t.sample.id for t in first} == {p.id for p in prompts[:4]} and len(first) == 8  # the live actor's half
    assert sampler.metrics() == {"cluster/rollout_failures": 1.0, "cluster/carried_prompts": 4.0}
    second = sampler.generate(prompts[:2], 2, params, torch.Generator(device="cpu").manual_seed(1))
    ids = [t.sample.id for t in second]
    assert ids[: 4 * 2] == [p.id for p in prompts[4:] for _ in range(2)] and len(second) == 12  # carried first, then the new ones
    assert sorted({t.group for t in second}) == list(range(6))
    sampler.close()


def test_assay_train_runs_its_workers_on_ray(tmp_path):
    """The bundled task through `assay train` with rollout, reward and two learner actors; then resumed with one learner."""
    from assay.api import train
    from assay.report.metrics import read_metrics

    args = ["train.steps=4", "train.eval_every=4", "train.eval_n=64", "train.save_every=2", "train.threads=1", f"output_dir={tmp_path}",
            "run_name=ray", "cluster.ray=true", "cluster.rollout_workers=2", "cluster.reward_workers=2"]
    result = train(None, *args, "cluster.learner_workers=2", progress=False)
    rows = read_metrics(Path(result.run_dir) / "metrics.jsonl")
    assert [r["step"] for r in rows if "reward/mean" in r] == [1, 2, 3, 4]
    assert all(r["cluster/rollout_failures"] == 0.0 and r["cluster/reward_actor_restarts"] == 0.0 for r in rows if "reward/mean" in r)
    assert (Path(result.run_dir) / "checkpoints" / "step_000004" / "dcp").is_dir()
    again = train(None, resume=result.run_dir, *["train.steps=6", "cluster.learner_workers=1"], progress=False)
    assert [r["step"] for r in read_metrics(Path(again.run_dir) / "metrics.jsonl") if "reward/mean" in r] == [1, 2, 3, 4, 5, 6]
