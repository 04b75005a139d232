"""Running a dataset's `check(candidate)` in the trusted parent, with the program behind a proxy.

HumanEval's tests are functions (Chen et al. 2021, "Evaluating Large Language Models Trained
on Code", arXiv:2107.03374): `check(candidate)` calls the candidate, compares, asserts, and
may loop, use locals, seeded random inputs and helper functions. Upstream runs the test in
the program's own process and namespace, so the program can win without solving anything:
return an object whose `__eq__` is always true, patch `builtins`, exit before the asserts, or
redefine a helper the test calls (HumanEval/32's `poly`). Here the test runs in the trusted
sandbox worker, in its own namespace (the dataset's trusted setup code, then the test), and
`candidate` is a proxy: each call sends its arguments by value (exact plain types, marshal)
to the program's process in the sandbox, which calls the real function and answers with the
value in the harness's tagged plain encoding. The parent decodes it into fresh plain
objects, so no object of the program ever reaches the test, and the test's comparisons run
on data. An exception the candidate raises is raised in the test as the same builtin class
(nearest builtin ancestor; `CandidateError` otherwise), so `try`/`except` in tests behaves.

Verdicts (`Outcome.verdict`): "pass" (check returned), "failed" (check raised: an assert or
any other error of the comparison), "raised" (an exception of the candidate escaped check),
"gone" (the program ended, timed out or broke the protocol during the test; recorded even
if the test catches it), "invalid" (a result was not plain data), "not_ready" (the program
never became callable: it crashed or exited while loading, or lacks the function) and
"test_error" (the test cannot run: it does not define `check`, or passes a value that is not
plain data; the row cannot be scored).

    >>> import marshal
    >>> marshal.loads(encode_args((1, [2.5, "x"]), {"k": (None, b"y")}))
    ((1, [2.5, 'x']), {'k': (None, b'y')})
    >>> encode_args((print,), {})
    Traceback (most recent call last):
    ...
    assay.sandbox.check.TestError: the test passes a builtin_function_or_method to the candidate; only plain data can enter the sandbox
"""

from __future__ import annotations

import builtins
import functools
import json
import marshal
import os
import select
import time
from dataclasses import dataclass
from typing import Any

from assay.sandbox import grading

_MAX_DEPTH = 200
_PLAIN = (type(None), bool, int, float, str, bytes)
_EXCEPTIONS = {c.__name__: c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, Exception)}


class ProgramGone(BaseException):
    """The program's process ended or misbehaved during the test (not an `Exception`: a test's
    `except Exception` cannot swallow it, and it is recorded anyway)."""


class InvalidResult(BaseException):
    """The candidate returned something that is not plain data."""


class TestError(BaseException):
    """The test itself cannot be run safely (it passes a non-plain value to the candidate)."""


class CandidateError(Exception):
    """The candidate raised an exception that has no builtin ancestor but `Exception`."""


@dataclass(frozen=True)
class CheckSpec:
    """A check test: trusted setup code, the test source, the function it calls, the program's function.

    Attributes:
        test: source defining the check function (HumanEval's `test` field).
        entry_point: the program's function that `candidate` stands for.
        setup: trusted code run first in the test's namespace (helpers, imports).
        name: the check function's name.
    """

    test: str
    entry_point: str
    setup: str = ""
    name: str = "check"


@dataclass
class Outcome:
    """How a check ended: the verdict, the number of calls made and a short message."""

    verdict: str
    calls: int = 0
    message: str = ""


@functools.lru_cache(maxsize=512)
def compile_spec(setup: str, test: str) -> tuple[Any, Any]:
    """The setup and test as code objects (SyntaxError for a malformed row)."""
    return compile(setup, "<check setup>", "exec"), compile(test, "<check>", "exec")


def encode_args(args: tuple, kwargs: dict) -> bytes:
    """The call's arguments as marshal bytes, after checking they are exact plain data."""
    for v in (*args, *kwargs.values()):
        _require_plain(v, 0)
    return marshal.dumps((tuple(args), dict(kwargs)))


def _require_plain(v: Any, depth: int) -> None:
    t = type(v)
    if depth > _MAX_DEPTH:
        raise TestError("an argument of the candidate is nested too deeply")
    if t in _PLAIN:
        return
    if t in (list, tuple, set, frozenset):
        for x in v:
            _require_plain(x, depth + 1)
        return
    if t is dict:
        for k, x in v.items():
            _require_plain(k, depth + 1)
            _require_plain(x, depth + 1)
        return
    raise TestError(f"the test passes a {t.__name__} to the candidate; only plain data can enter the sandbox")


class Channel:
    """The two pipes to the program's process: length-prefixed requests out, JSON lines back."""

    def __init__(self, req_fd: int, rep_fd: int, deadline: float, reply_cap: int) -> None:
        self.req, self.rep, self.deadline, self.cap = req_fd, rep_fd, deadline, reply_cap
        self.buf = bytearray()
        os.set_blocking(req_fd, False)
        os.set_blocking(rep_fd, False)

    def send(self, payload: bytes) -> str:
        """Write one request; "" when written, else why not."""
        data = memoryview(len(payload).to_bytes(4, "big") + payload)
        while data:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return "the program stopped reading before its deadline"
            if not select.select([], [self.req], [], left)[1]:
                continue
            try:
                data = data[os.write(self.req, data):]
            except BlockingIOError:
                continue
            except OSError:
                return "the program's process ended"
        return ""

    def receive(self) -> tuple[dict | None, str]:
        """One reply as a dict, or (None, why there is none)."""
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                return None, "the program did not answer before its deadline"
            if not select.select([self.rep], [], [], left)[0]:
                continue
            try:
                chunk = os.read(self.rep, 65536)
            except BlockingIOError:
                continue
            if not chunk:
                return None, "the program's process ended"
            self.buf += chunk
            if len(self.buf) > self.cap:
                return None, "the program's answer exceeded the output cap"
        line, _, rest = bytes(self.buf).partition(b"\n")
        self.buf = bytearray(rest)
        try:
            reply = json.loads(line)
        except (ValueError, RecursionError):
            return None, "the program broke the call protocol"
        return (reply, "") if isinstance(reply, dict) else (None, "the program broke the call protocol")


class Session:
    """The candidate proxy's state: what happened to the program during the test."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.calls = 0
        self.gone = self.invalid = self.test_error = ""
        self.raised: list[BaseException] = []

    def proxy(self, name: str) -> Any:
        def candidate(*args: Any, **kwargs: Any) -> Any:
            return self.call(args, kwargs)

        candidate.__name__ = candidate.__qualname__ = name
        return candidate

    def call(self, args: tuple, kwargs: dict) -> Any:
        """Run one call in the sandbox; its decoded value, or the exception it raised."""
        if self.gone or self.test_error:
            raise ProgramGone(self.gone or self.test_error)
        try:
            payload = encode_args(args, kwargs)
        except TestError as e:
            self.test_error = str(e)
            raise
        self.calls += 1
        why = self.channel.send(payload)
        reply, why = (None, why) if why else self.channel.receive()
        if reply is None:
            self.gone = why
            raise ProgramGone(why)
        return self._value(reply)

    def _value(self, reply: dict) -> Any:
        kind = reply.get("k")
        if kind == "r":
            try:
                return grading.decode_value(reply.get("v"))
            except ValueError:
                self.invalid = "the program's result was malformed"
        elif kind == "e" and isinstance(reply.get("n"), str) and isinstance(reply.get("m"), str):
            exc = _exception(reply["n"], reply["m"])
            self.raised.append(exc)
            raise exc
        elif kind == "bad":
            self.invalid = f"the candidate's result is not plain data: {str(reply.get('m'))[:200]}"
        else:
            self.gone = "the program broke the call protocol"
            raise ProgramGone(self.gone)
        raise InvalidResult(self.invalid)

    def verdict(self, error: BaseException | None) -> Outcome:
        """The outcome, given what `check` raised (None: it returned)."""
        for verdict, why in (("test_error", self.test_error), ("gone", self.gone), ("invalid", self.invalid)):
            if why:
                return Outcome(verdict, self.calls, why)
        if error is None:
            return Outcome("pass", self.calls)
        text = f"{type(error).__name__}: {error}"[:500]
        if any(error is e for e in self.raised):
            return Outcome("raised", self.calls, text)
        return Outcome("failed", self.calls, text)


def _exception(name: str, text: str) -> BaseException:
    """The builtin exception class `name` with message `text` (CandidateError for any other name)."""
    cls = _EXCEPTIONS.get(name)
    if cls is None or cls is Exception:
        return CandidateError(f"{name}: {text}")
    try:
        return cls(text)
    except Exception:  # a class with a special constructor (UnicodeDecodeError...)
        exc = cls.__new__(cls)
        exc.args = (text,)
        return exc


def run_check(spec: CheckSpec, channel: Channel) -> Outcome:
    """Wait for the program to be ready, then run the test's check function against the proxy."""
    reply, why = channel.receive()
    if reply is None or reply.get("k") != "ready":
        return Outcome("not_ready", 0, why or "the program broke the call protocol")
    namespace: dict[str, Any] = {"__name__": "assay_check", "__builtins__": builtins}
    setup_code, test_code = compile_spec(spec.setup, spec.test)
    try:
        exec(setup_code, namespace)
        exec(test_code, namespace)
    except Exception as e:
        return Outcome("test_error", 0, f"the test's code raised {type(e).__name__}: {e}"[:500])
    check = namespace.get(spec.name)
    if not callable(check):
        return Outcome("test_error", 0, f"the test defines no function {spec.name!r}")
    session = Session(channel)
    try:
        check(session.proxy(spec.entry_point))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # asserts, errors of the comparison, the candidate's exceptions
        return session.verdict(e)
    return session.verdict(None)
