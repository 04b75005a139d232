"""What the sandbox and code-reward tests share: requiring bwrap, and finding leftover processes.

Without a working bubblewrap the security suite cannot run. A local user without it gets a
skip; when `CI` is set the session stops with one line that says why (issue 21: the suite
must not skip silently in CI).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from assay.sandbox import isolation

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "install-sandbox.sh")


def in_ci() -> bool:
    """True when the environment variable CI is set to anything but empty, 0 or false."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_sandbox() -> None:
    """Use bwrap; install it once with the project's script if missing; else skip (or stop, in CI)."""
    path, why = isolation.find_bwrap()
    if path is not None:
        return
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHON": sys.executable})
    isolation.probe_bwrap.cache_clear()
    path, why = isolation.find_bwrap()
    if path is not None:
        return
    tail = proc.stderr.strip()[-200:]
    message = f"no working bubblewrap sandbox ({why})" + (f"; scripts/install-sandbox.sh: {tail}" if tail else "")
    if in_ci():
        pytest.exit(f"CI is set and the security suite cannot run: {message}", returncode=1)
    pytest.skip(message)


def descendants(root: int) -> set[int]:
    """The pids of every live process below `root` (its children, theirs, ...), from `/proc/PID/stat`."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        children.setdefault(int(text[text.rfind(")") + 2 :].split()[1]), []).append(int(name))
    out, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def describe(pids: list[int]) -> str:
    """What a leftover is, for a failing assertion: pid, parent, state, in-sandbox pid and command line."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            out.append(f"{pid}: gone")
            continue
        out.append(f"{pid} (parent {status.get('PPid')}, {status.get('State')}, NSpid {status.get('NSpid')}): {argv[:160]!r}")
    return "; ".join(out)


def slot_leftovers(root: int | None = None) -> list[int]:
    """Processes of sandbox slot uids, in the sandboxes of `root` (default: this process), that are not an idle fork
    server's sandbox.

    An idle fork server is bwrap's monitor, bwrap's init (pid 1 in the sandbox) and
    `server.py` (pid 2); anything else of a slot uid outlived the program that started it.
    Only `root`'s descendants count: an orphan inside a sandbox is re-parented to the
    sandbox's init, itself a descendant, so nothing of ours escapes the scan, while another
    process's sandboxes on the same machine (another test run, another user of the slot uids)
    are not ours to judge. `root=1` scans the whole machine.
    """
    ours = descendants(os.getpid() if root is None else root)
    out = []
    for name in os.listdir("/proc"):
        try:
            if not name.isdigit() or int(name) not in ours or os.stat(f"/proc/{name}").st_uid not in range(
                    isolation.UID_BASE, isolation.UID_BASE + isolation.UID_COUNT):
                continue
            with open(f"/proc/{name}/status") as f:
                nspid = next(line for line in f if line.startswith("NSpid:")).split()[1:]
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, StopIteration):
            continue
        inner = int(nspid[-1]) if len(nspid) > 1 else 0
        bwrap = argv[0].endswith(b"bwrap") and inner in (0, 1)
        server = inner == 2 and b"/box/server.py" in argv
        if not (bwrap or server):
            out.append(int(name))
    return out
