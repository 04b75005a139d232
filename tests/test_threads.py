"""torch's threads follow the cores other processes leave free (assay.threads)."""

import subprocess
import sys
import time

import pytest
import torch

from assay import threads
from assay.threads import ThreadGovernor


def test_the_count_follows_the_other_load(monkeypatch):
    """Fed synthetic /proc readings: 2 cores, then one taken by someone else, then free again."""
    monkeypatch.setattr(threads, "cores", lambda: 2)
    clock = {"t": 0.0, "machine": 0.0, "tree": 0.0}
    monkeypatch.setattr(ThreadGovernor, "_sample", lambda self: (clock["t"], clock["machine"], clock["tree"]))
    g = ThreadGovernor(smoothing=0.0)
    assert g.threads == 2 == torch.get_num_threads()

    def interval(own, other, wall=1.0):
        clock["t"] += wall
        clock["tree"] += own
        clock["machine"] += own + other
        return g.update()

    assert interval(own=2.0, other=0.0) == 2  # our own two busy threads are not "other" load
    assert interval(own=1.0, other=1.0) == 1 == torch.get_num_threads()  # a busy loop took a core
    assert interval(own=1.0, other=0.1) == 2
    fixed = ThreadGovernor(fixed=1)
    assert interval(own=0.0, other=0.0) and fixed.update() == 1
    torch.set_num_threads(threads.cores())


@pytest.mark.skipif(threads.machine_busy_seconds() is None, reason="needs Linux /proc")
def test_a_real_busy_loop_elsewhere_is_seen():
    """A busy process that is not ours (reparented away from us) shows up as other load; our own children do not."""
    outsider = subprocess.run(["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
                              capture_output=True, text=True).stdout.strip()
    own = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 3: pass"])
    try:
        g = ThreadGovernor(smoothing=0.0)
        time.sleep(1.0)
        g.update()
        assert g.other_load >= 0.7  # the outsider's core (our own busy child is excluded)
        if threads.cores() == 2:
            assert g.threads == 1
    finally:
        subprocess.run(["kill", "-9", outsider])
        own.kill()
        torch.set_num_threads(threads.cores())
