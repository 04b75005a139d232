"""Workers placed by Ray: rollout, reward and learner processes as Ray actors (the `cluster:` config block).

The training loop does not change; the seams it already has take Ray-backed parts:

- **rollout workers** (`RaySampler`, a `Sampler`): each actor holds a copy of the policy and the run's
  sampler (`rollout.backend`: torch, or a vLLM engine of its own); a step's prompts are split between
  them, whole groups each, and the learner pushes its weights to every actor after each update (one
  object in Ray's store, read by all; an engine takes them in place and passes the probe check). An actor that
  dies fails its prompts into the next step's batch, counted (`cluster/rollout_failures`,
  `cluster/carried_prompts`), and a new actor takes its place with the current weights.
- **reward workers** (`RayRewardExecutor`, a `RewardExecutor`): each actor scores with a reward
  executor of its own (its worker processes, deadlines and sandboxes on its machine); a batch is
  split between them. An actor that dies mid-batch is replaced and its items are scored again, so
  every item gets exactly one result (`cluster/reward_actor_restarts`).
- **learner workers** (`assay.cluster.learners.run_learners`): N actors, kept together by a placement group, run the
  ranks of one FSDP2 job — the same `ShardedTrainer` that `torchrun` starts — with the process
  group set up by assay from the first actor's address, as verl and OpenRLHF set up theirs (Ray
  Train would add its own checkpoint and report layer over the trainer's).

`cluster.address` joins an existing cluster; without it a local cluster is started for the run
and stopped after it. Ray is an optional dependency (`pip install 'assay[ray]'`).
"""

from __future__ import annotations

import os
import pickle
import sys

import torch

from assay.devices import generator_for
from assay.errors import AssayError
from assay.log import log
from assay.rewards.executor import RewardExecutor
from assay.types import RewardResult, Trajectory

NAMESPACE = "assay"


def require_ray():
    try:
        import ray
    except ImportError:
        raise AssayError("cluster.ray=true needs Ray, which is not installed: pip install 'assay[ray]'") from None
    return ray


def connect(cluster) -> bool:
    """Join `cluster.address`, or start a local cluster with room for the run's actors; True when this call started Ray."""
    ray = require_ray()
    if ray.is_initialized():
        _check_room(cluster)
        return False
    # the actors import what this process can: the user's reward or environment module too (`module:attr`)
    path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
    env = {"env_vars": {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}}
    if cluster.address:
        ray.init(address=cluster.address, namespace=NAMESPACE, runtime_env=env, log_to_driver=False)
        _check_room(cluster)
    else:
        need = cpus_needed(cluster)
        ray.init(num_cpus=max(int(need + 0.999), os.cpu_count() or 1), namespace=NAMESPACE, include_dashboard=False, runtime_env=env,
                 log_to_driver=False, configure_logging=False)
    return True


def cpus_needed(cluster) -> float:
    """CPUs the run's actors reserve: every learner rank has its own reward actors; the rollout actors are shared; one for the driver."""
    c = cluster
    return c.cpus_per_worker * (c.rollout_workers + c.reward_workers * c.learner_workers + c.learner_workers * (c.learner_workers > 1)) + 1


def _check_room(cluster) -> None:
    """Warn when a cluster this run joins has fewer CPUs than its actors reserve: the actors that do not fit wait,
    and the run with them, until room appears (an autoscaler may add it; a fixed cluster never will)."""
    have, need = require_ray().cluster_resources().get("CPU", 0.0), cpus_needed(cluster) - 1
    if have < need:
        log.warning(f"the Ray cluster has {have:g} CPUs and this run's actors reserve {need:g} (cluster.cpus_per_worker={cluster.cpus_per_worker:g} "
                    "each): the actors that do not fit wait for room, and the run waits with them")


def shutdown(started: bool) -> None:
    if started:
        require_ray().shutdown()


def _is_dead(error: BaseException) -> bool:
    ray = require_ray()
    return isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError))


# ---------------------------------------------------------------- rollout workers


class RolloutWorker:
    """A Ray actor: the policy (loaded from its folder, then given the learner's weights) behind the run's sampler."""

    def __init__(self, model_path: str, device: str, dtype: str, chat_template: str | None, rollout: dict):
        from assay.config import RolloutConfig
        from assay.models import load_policy
        from assay.rollout.base import make_sampler

        torch.set_num_threads(1)
        self.model, self.tokenizer = load_policy(model_path, device, dtype, chat_template)
        self.model.eval()
        cfg = RolloutConfig.model_validate(rollout)
        self.sampler = make_sampler(cfg.backend, self.model, self.tokenizer, cfg, device)

    def metrics(self) -> dict[str, float]:
        """The sampler's own figures since the last call (an engine's `engine/sync_*`)."""
        return self.sampler.metrics() if hasattr(self.sampler, "metrics") else {}

    def load(self, state: dict[str, torch.Tensor], version: int) -> int:
        self.model.load_state_dict(state, strict=False)
        if hasattr(self.model, "tie_weights"):
            self.model.tie_weights()
        self.sampler.update_weights(self.model, version)
        return version

    def generate(self, samples: list, n: int, params, seed: int) -> list[Trajectory]:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return self.sampler.generate(samples, n, params, gen)

    def pid(self) -> int:
        return os.getpid()


class RaySampler:
    """The `Sampler` over `cluster.rollout_workers` Ray actors (see the module docstring)."""

    def __init__(self, model, tokenizer, cfg, device):
        if cfg.rollout.backend == "openai":
            raise AssayError("cluster.rollout_workers with rollout.backend=openai: the server generates, not the actors; "
                             "leave cluster.rollout_workers at 0 (or use rollout.backend=torch or vllm on the actors)")
        self.ray = require_ray()
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.version = 0
        self.carry: list = []
        self.counts = {"rollout_failures": 0, "carried_prompts": 0}
        self.handles = [self._actor(i) for i in range(cfg.cluster.rollout_workers)]
        self._state_ref = None
        self._push(model, 0)

    def _actor(self, i: int, fresh: bool = False):
        c = self.cfg.cluster
        cls = self.ray.remote(num_cpus=c.cpus_per_worker, num_gpus=c.gpus_per_rollout, max_concurrency=1)(RolloutWorker)
        name = f"{_run_key(self.cfg)}-rollout-{i}"
        if fresh:
            name += f"-{os.getpid()}-{self.counts['rollout_failures']}"
        device = "cuda" if c.gpus_per_rollout > 0 else "cpu"
        return cls.options(name=name, namespace=NAMESPACE, get_if_exists=True, lifetime=None).remote(
            self.cfg.model.path, device, "float32" if device == "cpu" else self.cfg.model.dtype, self.cfg.model.chat_template,
            self.cfg.rollout.model_dump(mode="json"))

    def _push(self, model, version: int) -> None:
        """The learner's weights to every actor (the whole state gathered first when the learner is sharded)."""
        from assay.models.llama import sharded
        from assay.training.dist import full_state

        if sharded(model):
            import torch.distributed as dist

            state, _ = full_state(model)  # every rank takes part; rank 0 pushes
            if dist.get_rank() == 0:
                self._load_all(state, version)
            dist.barrier()  # no rank generates before the new weights are in
        else:
            self._load_all({k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}, version)
        self.version = version

    def _load_all(self, state: dict, version: int) -> None:
        self._state_ref = self.ray.put(state)
        self.ray.get([h.load.remote(self._state_ref, version) for h in self.handles])

    def generate(self, samples: list, n: int, params, generator: torch.Generator | None = None) -> list[Trajectory]:
        """`n` completions of each prompt (and of any prompt a dead actor failed last time, first), grouped prompt by prompt."""
        carried, self.carry = self.carry, []
        samples = carried + list(samples)
        chunks = _split(len(samples), len(self.handles))
        seeds = [int(torch.randint(0, 2**62, (1,), device="cpu", generator=generator_for(generator, "cpu"))) if generator is not None else i
                 for i in range(len(chunks))]
        refs = [(i, s, self.handles[i].generate.remote(samples[s], n, params, seed)) for i, (s, seed) in enumerate(zip(chunks, seeds)) if s.stop > s.start]
        out: list[Trajectory] = []
        for i, s, ref in refs:
            try:
                trajs = self.ray.get(ref)
            except Exception as e:
                if not _is_dead(e):
                    raise
                self.counts["rollout_failures"] += 1
                self.carry.extend(samples[s])  # into the next step's batch, never dropped
                self.counts["carried_prompts"] += s.stop - s.start
                self.handles[i] = self._actor(i, fresh=True)
                self.ray.get(self.handles[i].load.remote(self._state_ref, self.version))
                continue
            for t in trajs:
                t.group += s.start
                t.version = self.version
            out.extend(trajs)
        return out

    def update_weights(self, model, version: int) -> None:
        self._push(model, version)

    def metrics(self) -> dict[str, float]:
        """`cluster/*` counts, and the actors' samplers' own figures (an engine's `engine/sync_*`: the mean over actors,
        `_max` keys the largest)."""
        out = {f"cluster/{k}": float(v) for k, v in self.counts.items()}
        self.counts = dict.fromkeys(self.counts, 0)
        parts = []
        for ref in [h.metrics.remote() for h in self.handles]:
            try:
                parts.append(self.ray.get(ref))
            except Exception as e:  # an actor that died since: its replacement reports next time
                if not _is_dead(e):
                    raise
        for key in sorted({k for p in parts for k in p}):
            values = [p[key] for p in parts if key in p]
            out[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
        return out

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        for h in self.handles:
            self.ray.kill(h)
        self.handles = []


# ---------------------------------------------------------------- reward workers


class RewardWorker:
    """A Ray actor: a reward executor of its own (worker processes, deadlines, sandboxes on this machine)."""

    def __init__(self, reward_bytes: bytes, workers: int, timeout: float, failure_score: float | None):
        self.executor = RewardExecutor(pickle.loads(reward_bytes), workers=workers, timeout=timeout, failure_score=failure_score)

    def score(self, trajs: list[Trajectory]) -> tuple[list[RewardResult], dict[str, float]]:
        results = self.executor.score(trajs)
        return results, self.executor.stats()

    def pid(self) -> int:
        return os.getpid()


class RayRewardExecutor(RewardExecutor):
    """A `RewardExecutor` whose CPU work runs on `actors` Ray actors (see the module docstring); I/O and batch
    rewards run here, as with a local executor."""

    def __init__(self, reward, actors: int, workers: int, timeout: float, cpus: float = 1.0, key: str = "run"):
        super().__init__(reward, workers=workers, timeout=timeout)
        self.ray = require_ray()
        self.n_actors, self.cpus, self.key = actors, cpus, key
        self._counts["actor_restarts"] = 0
        self._reward_bytes = pickle.dumps(reward)
        self.handles = [self._actor(i) for i in range(actors)]

    def _actor(self, i: int, generation: int = 0):
        cls = self.ray.remote(num_cpus=self.cpus, max_concurrency=1)(RewardWorker)
        name = f"{self.key}-reward-{i}-{generation}-{os.getpid()}"
        return cls.options(name=name, namespace=NAMESPACE).remote(self._reward_bytes, self.workers, self.timeout, self.failure_score)

    def score(self, batch: list[Trajectory]) -> list[RewardResult]:
        """As `RewardExecutor.score`, a CPU reward's items scored on the actors."""
        import time

        if not batch or getattr(self.reward, "kind", "cpu") != "cpu":
            return super().score(batch)
        start = time.perf_counter()
        results = self._score_pool(batch)
        self._seconds += time.perf_counter() - start
        return [self._finish(r) for r in results]

    __call__ = score

    def _score_pool(self, batch: list[Trajectory]) -> list[RewardResult]:
        """Each actor a contiguous part of the batch; an actor that dies is replaced and its part sent again."""
        parts = [s for s in _split(len(batch), len(self.handles)) if s.stop > s.start]
        pending = {i: (s, self.handles[i].score.remote(batch[s])) for i, s in enumerate(parts)}
        results: list[RewardResult | None] = [None] * len(batch)
        restarts = 0
        while pending:
            i, (s, ref) = next(iter(pending.items()))
            try:
                scored, stats = self.ray.get(ref)
            except Exception as e:
                if not _is_dead(e) or restarts > 3 * len(self.handles):
                    raise
                restarts += 1
                self._counts["actor_restarts"] += 1
                self.handles[i] = self._actor(i, self._counts["actor_restarts"])
                pending[i] = (s, self.handles[i].score.remote(batch[s]))
                continue
            del pending[i]
            results[s] = scored
            for k in ("timeouts", "crashes", "restarts"):
                self._counts[k] += int(stats.get(f"reward/executor/{k}", 0))
        return results  # type: ignore[return-value]

    def stats(self) -> dict[str, float]:
        restarts = self._counts.pop("actor_restarts", 0)
        out = super().stats()
        out["cluster/reward_actor_restarts"] = float(restarts)
        self._counts["actor_restarts"] = 0
        return out

    def close(self, final: bool = False) -> None:
        super().close(final)
        for h in getattr(self, "handles", []):
            try:
                self.ray.kill(h)
            except Exception:
                pass
        self.handles = []


def _split(n: int, parts: int) -> list[slice]:
    """`n` items in `parts` contiguous slices whose sizes differ by at most one."""
    base, extra = divmod(n, max(parts, 1))
    out, start = [], 0
    for i in range(max(parts, 1)):
        size = base + (i < extra)
        out.append(slice(start, start + size))
        start += size
    return out


def _run_key(cfg) -> str:
    """A name shared by one run's processes for the actors they share (the learner ranks find the same rollout actors)."""
    return f"assay-{cfg.run_name or 'run'}-{cfg.seed}"
