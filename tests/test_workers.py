"""`assay.workers.WorkerPool` closed while another thread waits on it (a server stopping under a batch)."""

import threading
import time

import pytest

from assay.errors import AssayError
from assay.rewards.base import Reward
from assay.rewards.executor import RewardExecutor
from assay.types import RewardResult, Sample, Trajectory
from assay.workers import WorkerFailure, WorkerPool


def in_thread(fn):
    """Run `fn` in a thread; `(thread, box)` where `box` gets its result."""
    box = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()
    return t, box


@pytest.mark.parametrize("call", ["stream", "map"])
def test_a_close_from_another_thread_fails_the_running_jobs_at_once(call):
    wp = WorkerPool("time:sleep", workers=2)
    jobs = [0, 0, 0, 60, 60]
    t, box = in_thread(lambda: wp.stream(jobs, 120.0, chunk=1) if call == "stream" else wp.map(jobs, [120.0] * 5))
    time.sleep(1.0)  # both 60 s jobs are on their workers now
    wp.close()
    t.join(30)
    assert not t.is_alive(), "the call went on after the pool closed"
    (out,) = box
    assert len(out) == 5 and out[:3] == [None] * 3
    assert all(isinstance(r, WorkerFailure) and r.reason == "crashed" for r in out[3:]), out
    assert wp.restarts == 0 and len(wp) == 0  # a closing pool replaces nothing


def test_a_closed_pool_fails_new_jobs_instead_of_waiting_for_workers():
    wp = WorkerPool("time:sleep", workers=1)
    wp.close()
    wp.close()  # twice is harmless
    t, box = in_thread(lambda: (wp.stream([0, 0], 5.0), wp.map([0, 0], [5.0, 5.0])))
    t.join(30)
    assert not t.is_alive(), "a job on a closed pool waited for ever"
    streamed, mapped = box[0]
    assert all(isinstance(r, WorkerFailure) and r.reason == "crashed" for r in streamed + mapped)


def test_a_worker_that_cannot_start_takes_the_started_ones_with_it(tmp_path):
    marker = tmp_path / "started"
    with pytest.raises(AssayError, match="failed to start"):
        WorkerPool("time:sleep", workers=3, setup="_workers_setup:second_fails", setup_args=(str(marker),))
    pids = [int(p) for p in marker.read_text().split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids), "the worker that started was left running"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Length(Reward):
    def score(self, t):
        return RewardResult(float(len(t.completion)))


def test_an_executor_closed_for_good_starts_no_workers_again():
    traj = Trajectory(Sample("0", "", None), "abc", [], [], [], True)
    ex = RewardExecutor(Length(), workers=1, timeout=5.0).start()
    assert ex.score([traj])[0].score == 3.0
    ex.close()
    assert ex.score([traj])[0].score == 3.0  # a plain close: the next batch starts the workers again
    ex.close(final=True)
    with pytest.raises(AssayError, match="closed for good"):
        ex.score([traj])


def test_a_close_between_dispatch_and_wait_fails_the_jobs_instead_of_raising():
    # the stream thread has sent its chunks and not yet waited on the pipes when another thread
    # closes the pool: waiting on a closed pipe raised OSError ("handle is closed") out of stream
    wp = WorkerPool("time:sleep", workers=2)
    dispatch = wp._dispatch

    def dispatch_then_close(k, *args):
        dispatch(k, *args)
        if k == len(wp._workers) - 1:
            t = threading.Thread(target=wp.close)
            t.start()
            t.join()

    wp._dispatch = dispatch_then_close
    out = wp.stream([5, 5, 5, 5], 30.0, chunk=1)
    assert len(out) == 4 and all(isinstance(r, WorkerFailure) and r.reason == "crashed" for r in out), out


def test_a_close_does_not_wait_for_a_replacement_worker_still_starting():
    # a timed-out job's worker is replaced; the replacement's setup (a reward loading its model) takes
    # 5 s. A close from another thread (a server at SIGTERM) used to wait for that start under the lock.
    wp = WorkerPool("_workers_setup:sleep_job", workers=1, setup="_workers_setup:slow_start", setup_args=(5.0,))
    t, box = in_thread(lambda: wp.stream([60], 0.5))
    time.sleep(1.5)  # the job timed out at 0.5 s; its replacement is starting
    start = time.monotonic()
    wp.close()
    assert time.monotonic() - start < 2.5, "close waited for the replacement worker to start"
    t.join(30)
    assert not t.is_alive()
    (out,) = box
    assert isinstance(out[0], WorkerFailure) and out[0].reason == "timeout"
    assert wp.restarts == 0 and len(wp) == 0


def test_a_worker_that_cannot_be_restarted_fails_its_jobs_not_the_call(tmp_path):
    """A restart whose setup fails (a model that cannot load again) leaves jobs failed, never an exception."""
    wp = WorkerPool("_workers_setup:sleep_job", workers=1, setup="_workers_setup:only_the_first_starts",
                    setup_args=(str(tmp_path / "started"),))
    try:
        out = wp.stream([0, 30, 0], deadline=1.0, chunk=1)  # the hang kills the worker; its restart fails
        assert out[0] is None and out[1].reason == "timeout"
        assert out[2].reason == "crashed" and "out of memory" in out[2].error
        again = wp.stream([0], deadline=1.0)  # the next call tries to start it again, and fails the same way
        assert again[0].reason == "crashed" and "out of memory" in again[0].error
        (one,) = wp.map([0], [1.0])
        assert one.reason == "crashed" and "out of memory" in one.error
    finally:
        wp.close()
