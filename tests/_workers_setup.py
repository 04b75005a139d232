"""A worker setup for tests/test_workers.py: records each worker's pid; the second one fails."""

import os


def second_fails(marker: str) -> None:
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    with open(marker) as f:
        if len(f.read().split()) == 2:
            raise RuntimeError("this worker cannot start")


def slow_start(seconds: float) -> None:
    import time

    time.sleep(seconds)


def sleep_job(state_job) -> None:
    import time

    time.sleep(state_job[1])
