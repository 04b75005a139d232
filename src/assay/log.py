"""assay's logger: warnings a user should see, without a traceback.

Library code calls `log.warning(...)` on `logging.getLogger("assay")`; the `assay`
command prints each as one `assay: warning: ...` line on stderr. From Python, the
standard `logging` configuration applies (Python prints warnings to stderr by default).
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("assay")


def setup_cli_logging() -> None:
    """Print assay's warnings as `assay: warning: MESSAGE` lines on stderr (once per process)."""
    if any(getattr(h, "_assay_cli", False) for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("assay: %(levelname)s: %(message)s"))
    handler._assay_cli = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
