"""The one exception type for mistakes a user can fix.

The CLI prints an `AssayError` as a single line and exits non-zero; anything else is a
bug and keeps its traceback.
"""


class AssayError(Exception):
    """A user-facing error: bad input, missing file, invalid config, unknown name."""
