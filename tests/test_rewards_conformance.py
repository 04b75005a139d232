"""One conformance suite run over every registered reward (optax's contrib suite, for rewards).

Each reward must: build from its example block, pickle, map a batch to one RewardResult
each, handle a missing reference / empty / odd completion without raising, and give the
same results through a worker pool whose worker was killed between batches (I/O rewards:
through the asyncio path).
"""

import os
import pickle

import pytest

from _reward_helpers import traj
from assay.rewards.base import REWARDS, Reward
from assay.rewards.executor import RewardExecutor
from assay.rewards.spec import build_reward, load_builtins
from assay.types import RewardResult

load_builtins()

# Arguments for rewards that cannot be built without any; a reward may instead carry a
# class attribute `example_args` (a dict, or a block-style dict for compositions).
EXAMPLES = {
    "regex": {"pattern": r"\d"},
    "json_schema": {"schema": {"type": "object"}},
    "weighted": {"components": {"correct": "math", "fmt": "format_only"}, "weights": {"fmt": 0.1}},
    "minimum": {"components": ["math", "format_only"]},
    "pessimistic": {"components": ["math", "format_only"], "beta": 0.5},
    "tiers": {"components": {"boxed": "format_only", "correct": "math"}},
    "gate": {"outcome": "math", "process": "format_only"},
    "par": {"reward": "length", "reference_field": "reference"},
    "chain": {"reward": "math"},
}


def _rm_folder() -> str:
    """A real reward-model folder for `rm`: the bundled model's transformer with its seeded head, saved as `assay rm train` saves."""
    import atexit
    import shutil
    import tempfile
    from pathlib import Path

    from assay.rm.model import build_rm, save_rm

    root = tempfile.mkdtemp(prefix="assay-rm-conformance-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    folder = Path(root) / "rm"
    model, tok = build_rm("tiny-arith", seed=0)
    save_rm(folder, model, tok, {"max_length": 64})
    return str(folder)


EXAMPLES["rm"] = {"path": _rm_folder()}
EXAMPLES["prm"] = {"path": EXAMPLES["rm"]["path"]}  # the same one-label classifier, read at every step

BATCH = [
    traj(r"The answer is \boxed{4}.", "4", reference="ref", nums=[1, 3], target=4),
    traj(r"\boxed{5}", "4", reference="ref", nums=[1, 3], target=4),
    traj("", "4", reference="ref"),
    traj("\udcff garbage {", None),
    traj("4", "not a number {", nums=[1, 3], target=4),
]


def example_block(name):
    cls = REWARDS.get(name)
    args = EXAMPLES.get(name, getattr(cls, "example_args", None))
    return {"name": name, "args": args} if args else name


NAMES = REWARDS.names()


@pytest.mark.parametrize("name", NAMES)
def test_conformance(name):
    reward = build_reward(example_block(name))
    assert isinstance(reward, Reward) and reward.kind in ("cpu", "io", "batch")
    assert isinstance(reward.hparams(), dict)
    clone = pickle.loads(pickle.dumps(reward))
    results = clone(BATCH)
    assert len(results) == len(BATCH) and all(isinstance(r, RewardResult) for r in results)
    for r in results:
        assert r.score is None or isinstance(r.score, float)
        assert isinstance(r.components, dict) and isinstance(r.info, dict)
    if reward.kind in ("io", "batch"):  # no worker process to crash: the executor's path must agree with a direct call
        with RewardExecutor(reward, timeout=30.0) as ex:
            assert [r.score for r in ex.score(BATCH)] == [r.score for r in results]
        return
    with RewardExecutor(reward, workers=1, timeout=10.0) as ex:
        first = ex.score(BATCH[:2])
        os.kill(ex._pool._workers[0].proc.pid, 9)  # the worker dies between batches
        ex._pool._workers[0].proc.join(5)
        again = ex.score(BATCH[:2])
    assert [r.score for r in first] == [r.score for r in again] == [r.score for r in results[:2]]


def test_every_reward_is_listed():
    from assay.rewards.scoring import list_rewards

    listed = dict(list_rewards())
    assert set(NAMES) <= set(listed) and all(listed[n] for n in NAMES)
