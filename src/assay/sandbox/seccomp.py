"""A seccomp-bpf filter for the sandbox: no kernel keyrings, no System V / POSIX message IPC,
no ptrace, and no signal, rlimit or scheduling call aimed at the sandbox's first two processes.

bwrap loads it (`--seccomp FD`) just before it runs the harness or the fork server, so every
process of the sandbox inherits it and none can remove it. What it refuses (with EPERM):

- `add_key`, `request_key`, `keyctl`: a key's description is listed in `/proc/keys` to every
  process of the same uid, in any namespace, so keys are a channel between programs that
  bwrap's namespaces do not close (measured: a key added by one sandbox is listed in the next);
- `shmget`, `semget`, `msgget`, `mq_open`: IPC objects outlive the process that made them and
  the fork server's programs share one IPC namespace;
- `ptrace`, `process_vm_readv`, `process_vm_writev`, `kcmp`, `pidfd_getfd`, `process_madvise`,
  `pidfd_send_signal`, and `bpf`, `userfaultfd`, `perf_event_open`, `io_uring_*` (kernel attack
  surface no test program needs);
- `kill`, `tkill`, `tgkill`, `rt_(tg)sigqueueinfo`, `prlimit64`, `sched_set{param,scheduler,
  affinity,attr}`, `pidfd_open` aimed at pid 1 (bwrap's init) or pid 2 (the harness, or the
  fork server), at their process groups (-1 is also everyone: refused); `setpriority` and
  `ioprio_set` aimed at anything but one process, or at pid 1 or 2. A program may still
  signal itself and its own children.

Under the fork server each program's harness is a fresh process, not pid 2: the harness
stacks a second filter (`loader`, the same rules with its own pid added) on every test's
process, so a program cannot stop or kill its harness there either.

Only the low 32 bits of an argument are compared: the kernel reads pids and `which` as `int`.
Syscalls of a foreign ABI (i386 `int 0x80` on x86-64, x32) are refused outright. On an
architecture without a table here, `program()` returns None and the sandbox runs without the
filter (the rest of the isolation is unchanged).

    >>> len(program("x86_64")) % 8, program("sparc") is None
    (0, True)
"""

from __future__ import annotations

import os
import struct
from typing import Callable

_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR = {  # (x86_64, aarch64); from <asm/unistd_64.h> and <asm-generic/unistd.h>
    "kill": (62, 129), "tkill": (200, 130), "tgkill": (234, 131), "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240), "pidfd_send_signal": (424, 424), "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438), "prlimit64": (302, 261), "setpriority": (141, 140),
    "sched_setparam": (142, 118), "sched_setscheduler": (144, 119), "sched_setaffinity": (203, 122),
    "sched_setattr": (314, 274), "ioprio_set": (251, 30), "ptrace": (101, 117),
    "process_vm_readv": (310, 270), "process_vm_writev": (311, 271), "kcmp": (312, 272),
    "add_key": (248, 217), "request_key": (249, 218), "keyctl": (250, 219), "shmget": (29, 194),
    "semget": (64, 190), "msgget": (68, 186), "mq_open": (240, 180), "bpf": (321, 280),
    "userfaultfd": (323, 282), "perf_event_open": (298, 241), "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426), "io_uring_register": (427, 427), "process_madvise": (440, 440),
}
DENIED = ("add_key", "request_key", "keyctl", "shmget", "semget", "msgget", "mq_open", "ptrace",
          "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "pidfd_send_signal",
          "process_madvise", "bpf", "userfaultfd", "perf_event_open", "io_uring_setup", "io_uring_enter",
          "io_uring_register")
"""Syscalls refused whatever their arguments."""
PROTECTED = (1, 2)
"""Pids no process of the sandbox may aim at: bwrap's init, and the harness or fork server."""
PID_FIRST = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64", "sched_setparam",
             "sched_setscheduler", "sched_setaffinity", "sched_setattr", "pidfd_open")
"""Syscalls whose first argument is a pid (or tgid) that must not be a protected one."""
WHICH_WHO = {"setpriority": 0, "ioprio_set": 1}
"""Syscalls taking (which, who): only `which` = one process (PRIO_PROCESS, IOPRIO_WHO_PROCESS) is allowed."""

_LD, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _EPERM = 0x7FFF0000, 0x00050000 | 1
_X32_BIT = 0x40000000


def _ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def _arg(i: int) -> int:
    """Offset of the low 32 bits of argument i in `struct seccomp_data` (little-endian)."""
    return 16 + 8 * i


def _pid_values(pids: tuple[int, ...]) -> tuple[int, ...]:
    """Pid arguments that reach `pids`: each pid, its process group (-pid), and -1 (everyone)."""
    return tuple(dict.fromkeys([*pids, *(-p & 0xFFFFFFFF for p in pids), 0xFFFFFFFF]))


def _refuse_values(values: tuple[int, ...]) -> list[bytes]:
    """With A loaded: refuse if A is one of `values`, else allow."""
    out = [_ins(_JEQ, v, jt=len(values) - i, jf=0) for i, v in enumerate(values)]
    return out + [_ins(_RET, _ALLOW), _ins(_RET, _EPERM)]


def _rule(name: str, pids: tuple[int, ...]) -> list[bytes]:
    """The instructions that decide one syscall (A holds the syscall number on entry)."""
    if name in DENIED:
        return [_ins(_RET, _EPERM)]
    if name in PID_FIRST:
        return [_ins(_LD, _arg(0))] + _refuse_values(_pid_values(pids))
    return [_ins(_LD, _arg(0)), _ins(_JEQ, WHICH_WHO[name], jt=1, jf=0), _ins(_RET, _EPERM),
            _ins(_LD, _arg(1))] + _refuse_values(pids)


def program(machine: str | None = None, pids: tuple[int, ...] = PROTECTED) -> bytes | None:
    """The filter as raw `struct sock_filter` bytes (for bwrap `--seccomp`), or None (no table).

    `pids` are the processes (and their groups) nothing under the filter may signal, re-limit
    or re-schedule.
    """
    machine = machine or os.uname().machine
    if machine not in _ARCH:
        return None
    col = 0 if machine == "x86_64" else 1
    head = [_ins(_LD, 4), _ins(_JEQ, _ARCH[machine], jt=1, jf=0), _ins(_RET, _EPERM),
            _ins(_LD, 0), _ins(_JGE, _X32_BIT, jt=0, jf=1), _ins(_RET, _EPERM)]
    rules: list[bytes] = []
    for name in DENIED + PID_FIRST + tuple(WHICH_WHO):
        body = _rule(name, pids)
        rules += [_ins(_JEQ, _NR[name][col], jt=0, jf=len(body))] + body
    return b"".join(head + rules + [_ins(_RET, _ALLOW)])


def loader(prog: bytes) -> Callable[[], bool]:
    """A function that loads `prog` on the calling process (and its future children); True when loaded.

    Everything is prepared here, so the returned function only makes the two prctl calls: a
    process can prepare once and let each of its forked children load. Filters stack: one
    added this way only refuses more than the sandbox's own. Standard library only, so the
    fork server can use it inside the sandbox.
    """
    import ctypes

    sock_fprog, prctl = _ctypes_parts()
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = sock_fprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    ref = ctypes.byref(fprog)

    def load() -> bool:
        _keep = buf  # noqa: F841  (the filter's bytes live as long as the loader)
        if prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
            return False
        return prctl(22, 2, ref, 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER

    return load


_PARTS: list = []


def warm() -> None:
    """Make the ctypes parts `loader` needs now (a fork server does it once, before forking)."""
    _ctypes_parts()


def _ctypes_parts() -> tuple[type, Callable[..., int]]:
    """`struct sock_fprog` and libc's prctl, made once per process."""
    if not _PARTS:
        import ctypes

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        _PARTS.extend((SockFprog, ctypes.CDLL(None, use_errno=True).prctl))
    return _PARTS[0], _PARTS[1]


def memfd() -> int | None:
    """A file descriptor holding `program()` at offset 0 (inheritable), or None."""
    prog = program()
    if prog is None:
        return None
    fd = os.memfd_create("assay-seccomp", 0)
    os.write(fd, prog)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
