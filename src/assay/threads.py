"""torch's CPU threads on a shared machine: as many as there are cores nobody else is using.

On a 2-core laptop another busy process is the normal case. torch's default of one
OpenMP thread per core then makes every parallel region wait for a thread that has no
core: a step became 5–20× slower with one of two cores taken (measured on these
machines). `ThreadGovernor` re-reads the load between steps and sets the thread count
to the cores the rest of the machine left free, so a step under contention slows in
proportion to the lost core instead.

The load of "the rest of the machine" is the CPU time all processes used since the last
check (`/proc/stat`), less what this process and its descendants (reward and sandbox
workers) used (`/proc/PID/stat`), over the wall time. Where `/proc` is missing the governor
keeps the count it started with. Changing the thread count can change floating-point
rounding, so a run that must be bit-for-bit reproducible sets `train.threads=N`.
"""

from __future__ import annotations

import os
import time

import torch

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_busy_seconds() -> float | None:
    """CPU seconds every process on the machine has used since boot (None without `/proc/stat`)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _stat(pid: str) -> tuple[int, float] | None:
    """(parent pid, CPU seconds used) of a process, from `/proc/PID/stat`."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    rest = text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses
    return int(rest[1]), (int(rest[11]) + int(rest[12]) + int(rest[13]) + int(rest[14])) / _TICK


def tree_busy_seconds(root: int | None = None) -> float:
    """CPU seconds this process and every live descendant have used (their own, and their reaped children's)."""
    root = root or os.getpid()
    stats = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (s := _stat(pid)) is not None:
            stats[int(pid)] = s
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += children.get(pid, [])
    return total


class ThreadGovernor:
    """Sets `torch.set_num_threads` between steps from the cores the rest of the machine leaves free.

    Args:
        fixed: a thread count to keep (`train.threads` > 0); 0 adapts.
        smoothing: weight of the previous load estimate (an exponential moving average, so one
            noisy interval does not flip the count).
    """

    def __init__(self, fixed: int = 0, smoothing: float = 0.5):
        self.cores, self.fixed, self.smoothing = cores(), fixed, smoothing
        self.threads = fixed or self.cores
        self.other_load = 0.0
        torch.set_num_threads(self.threads)
        self._last = self._sample()

    def _sample(self) -> tuple[float, float, float] | None:
        busy = machine_busy_seconds()
        return None if busy is None else (time.monotonic(), busy, tree_busy_seconds())

    def update(self) -> int:
        """Re-read the load since the last call; set and return the thread count."""
        if self.fixed:
            return self.threads
        now = self._sample()
        if now is not None and self._last is not None and now[0] - self._last[0] > 0.05:
            wall = now[0] - self._last[0]
            other = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
            self.other_load = self.smoothing * self.other_load + (1 - self.smoothing) * min(other, self.cores)
            want = max(1, min(self.cores, round(self.cores - self.other_load)))
            if want != self.threads:
                self.threads = want
                torch.set_num_threads(want)
        self._last = now
        return self.threads
