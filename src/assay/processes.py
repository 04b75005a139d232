"""Starting worker processes without re-running the user's script in them.

"spawn" and "forkserver" children import the parent's `__main__` from its file, which runs
a script that has no `if __name__ == "__main__":` guard a second time (and fails with
multiprocessing's bootstrapping error, or trains a second model). assay's workers (reward
workers, sandbox workers) never need `__main__`, so while a child starts, the main
module's file is hidden and the child skips that import. A notebook's `__main__` has no
file, and nothing changes there.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator

_LOCK = threading.RLock()


@contextlib.contextmanager
def main_script_hidden() -> Iterator[None]:
    """Hide `__main__`'s file and spec while a child process starts (thread-safe)."""
    with _LOCK:
        main = sys.modules.get("__main__")
        path = getattr(main, "__file__", None)
        spec = getattr(main, "__spec__", None)
        if main is None or (path is None and spec is None):
            yield
            return
        try:
            if path is not None:
                del main.__file__
            main.__spec__ = None
            yield
        finally:
            if path is not None:
                main.__file__ = path
            main.__spec__ = spec
