"""Worker setups and handlers for tests/test_workers.py: starts that fail, are slow, or fail on a restart."""

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


def only_the_first_starts(marker: str) -> None:
    """The first worker starts; every later one (a restart) fails, as when a model cannot load again."""
    if os.path.exists(marker):
        raise RuntimeError("out of memory loading the model")
    open(marker, "w").close()
