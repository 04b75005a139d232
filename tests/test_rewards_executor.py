"""The executor isolates every failure: raise, hang, crash, and pathological math inputs."""

import os
import threading
import time

import pytest

from _reward_helpers import FailsToLoad, Misbehave, SlowToLoad, traj
from assay.errors import AssayError
from assay.rewards.executor import RewardExecutor
from assay.rewards.math import MathReward
from assay.types import RewardResult
from assay.rewards.base import Reward


def test_inline_scores_and_isolates_raise():
    with RewardExecutor(Misbehave(), workers=0) as ex:
        rs = ex.score([traj("ab"), traj("raise"), traj("abc")])
        assert [r.score for r in rs] == [2.0, 0.0, 3.0]
        assert rs[1].error == "RuntimeError: boom" and rs[1].info["reason"] == "raised"
        st = ex.stats()
        assert st["reward/executor/failures"] == 1 and st["reward/executor/items"] == 3
        assert ex.stats()["reward/executor/items"] == 0  # counts reset on read


def test_pool_raise_hang_crash_fail_only_their_item():
    batch = [traj(c) for c in ["ab", "raise", "hang", "crash", "abc", "hang", "x"]]
    start = time.perf_counter()
    with RewardExecutor(Misbehave(), workers=2, timeout=1.0, failure_score=None) as ex:
        rs = ex.score(batch)
        elapsed = time.perf_counter() - start
        assert [r.score for r in rs] == [2.0, None, None, None, 3.0, None, 1.0]
        assert [r.info.get("reason") for r in rs[1:4]] == ["raised", "timeout", "crashed"]
        assert all(r.info["seconds"] <= 1.0 + 1.0 for r in rs if r.info.get("reason") == "timeout")
        st = ex.stats()
        assert (st["reward/executor/timeouts"], st["reward/executor/crashes"], st["reward/executor/none"]) == (2, 1, 4)
        assert ex.score([traj("abcd")])[0].score == 4.0  # the pool was restarted and still works
    assert elapsed < 1.0 + 1.0 + 3.0  # two hangs run in parallel; restarts are cheap


def test_worker_killed_from_outside_is_restarted():
    with RewardExecutor(Misbehave(), workers=1, timeout=2.0) as ex:
        ex.score([traj("a")])
        os.kill(ex._pool._workers[0].proc.pid, 9)
        ex._pool._workers[0].proc.join(2)
        assert ex.score([traj("ab")])[0].score == 2.0


def test_pathological_math_inputs_within_timeout():
    timeout = 3.0
    cases = [r"\boxed{9^{9^{9^9}}}", "x" * 1_000_000 + r"\boxed{5}", "\udcff\udcfe\x00", "", r"\boxed{" * 500 + "5" + "}" * 500, r"\boxed{5}"]
    with RewardExecutor(MathReward(), workers=2, timeout=timeout) as ex:
        ex.score([traj(r"\boxed{1}", "1")])  # start the pool
        start = time.perf_counter()
        rs = ex.score([traj(c, "5") for c in cases])
        assert time.perf_counter() - start < timeout + 1.0
    assert [r.score for r in rs] == [0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert all(r.info.get("reason") for r in rs)


class Unpicklable(Reward):
    def __init__(self):
        self.f = lambda: 1

    def score(self, t):
        return RewardResult(1.0)


def test_unpicklable_reward_is_a_clear_error():
    with pytest.raises(AssayError, match="cannot be pickled"):
        RewardExecutor(Unpicklable(), workers=1).score([traj("a")])


class SlowIO(Reward):
    """Waits 0.5 s on "slow"; `peak` is the most calls that were running at once."""

    kind = "io"

    def __init__(self):
        self._lock, self._running, self.peak = threading.Lock(), 0, 0

    def score(self, t):
        with self._lock:
            self._running += 1
            self.peak = max(self.peak, self._running)
        time.sleep(0.5 if t.completion == "slow" else 0.0)
        with self._lock:
            self._running -= 1
        return RewardResult(1.0)


class AsyncIO(Reward):
    kind = "io"

    def score(self, t):
        raise AssertionError("ascore is used")

    async def ascore(self, t):
        import asyncio

        await asyncio.sleep(10 if t.completion == "hang" else 0.05)
        return RewardResult(2.0)


def test_io_rewards_run_concurrently_with_deadline():
    slow = SlowIO()
    with RewardExecutor(slow, timeout=1.0, concurrency=8) as ex:
        assert [r.score for r in ex.score([traj("slow")] * 8)] == [1.0] * 8
    assert slow.peak == 8  # all eight waited at once
    with RewardExecutor(AsyncIO(), timeout=0.5) as ex:
        rs = ex.score([traj("a"), traj("hang")])
        assert rs[0].score == 2.0 and rs[1].info["reason"] == "timeout"


def test_bad_arguments():
    with pytest.raises(AssayError):
        RewardExecutor(Misbehave(), workers=-1)


def test_reward_that_cannot_load_in_a_worker_is_a_clear_error():
    with pytest.raises(AssayError, match=r"reward worker \(loading the reward\) failed to start: ImportError"):
        RewardExecutor(FailsToLoad(), workers=1).score([traj("a")])


def test_failure_inside_a_chunk_requeues_the_rest():
    batch = [traj("a")] * 10 + [traj("hang")] + [traj("bb")] * 5 + [traj("crash")] + [traj("ccc")] * 4
    with RewardExecutor(Misbehave(), workers=1, timeout=0.5, chunk=8) as ex:
        rs = ex.score(batch)
        st = ex.stats()
    assert [r.score for r in rs] == [1.0] * 10 + [0.0] + [2.0] * 5 + [0.0] + [3.0] * 4
    assert rs[10].info["reason"] == "timeout" and rs[10].info["seconds"] <= 0.5 + 1.0
    assert rs[16].info["reason"] == "crashed"
    assert (st["reward/executor/timeouts"], st["reward/executor/crashes"], st["reward/executor/restarts"]) == (1, 1, 2)


def test_a_script_without_a_main_guard_can_use_worker_processes(tmp_path):
    """Notebook-style scripts have no `if __name__ == "__main__":`; worker processes must not re-run them."""
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "from assay.rewards.executor import RewardExecutor\n"
        "from assay.rewards.math import MathReward\n"
        "from assay.types import Sample, Trajectory\n"
        "print('top-level code ran')\n"
        "batch = [Trajectory(Sample(str(i), '', '4'), '\\\\boxed{4}', [], [], [], True) for i in range(4)]\n"
        "for method in ('forkserver', 'fork'):\n"
        "    with RewardExecutor(MathReward(), workers=2, start_method=method) as ex:\n"
        "        print(method, [r.score for r in ex.score(batch)])\n"
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("top-level code ran") == 1
    assert "forkserver [1.0, 1.0, 1.0, 1.0]" in p.stdout and "fork [1.0, 1.0, 1.0, 1.0]" in p.stdout


def test_a_worker_warms_its_reward_before_the_first_deadline_starts():
    """Loading (2 s) is not scoring: the first item of a fresh worker has its whole 1 s deadline."""
    with RewardExecutor(SlowToLoad(), workers=1, timeout=1.0) as ex:
        first = ex.score([traj("a")])[0]
        assert first.score == 1.0 and first.error is None
        os.kill(ex._pool._workers[0].proc.pid, 9)  # its replacement warms up again, off the clock too
        ex._pool._workers[0].proc.join(5)
        assert ex.score([traj("b")])[0].score == 1.0


def test_rewards_inside_a_rubrics_criteria_are_warmed_and_counted():
    """A rubric keeps each `check: reward` criterion's reward in a `Criterion` dataclass: the walk over the
    reward tree (warm in a worker, preload modules, `reward_stats`) must reach it."""
    from assay.rewards.executor import _modules, _rewards, reward_stats
    from assay.rewards.spec import build_reward

    rubric = build_reward({"name": "rubric", "args": {"criteria": [{"name": "m", "check": "reward", "reward": "math"}]}})
    inner = rubric.criteria[0].reward
    assert any(r is inner for r in _rewards(rubric))
    assert type(inner).__module__ in _modules(rubric)

    class Counting(Reward):
        def score(self, t):
            return RewardResult(1.0)

        def stats(self):
            return {"reward/x/requests": 2.0}

    rubric.criteria[0].reward = Counting()
    assert reward_stats(rubric) == {"reward/x/requests": 2.0}
