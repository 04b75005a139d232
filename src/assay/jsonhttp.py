"""JSON over HTTP until a signal: the one server behind `assay serve rewards` and `assay serve model`.

uvicorn (the `serve` extra) holds the connections: HTTP/1.1 with keep-alive, a listen
backlog of `BACKLOG`, httptools' parser when it is installed. `JsonApp`, a small ASGI
application, answers a *service*:

* `service.routes`: `{path: method}`, each path served for one method ("GET" or "POST");
  another method on a known path is a 405 (with `Allow`), an unknown path a 404;
* `service.get(path)` and `service.post(path, body)` return the reply's payload, or raise
  `BadRequest` with its status. A coroutine function is awaited on the event loop; a plain
  function runs on a thread of its own, so a slow one (a model's `generate`) never holds
  the loop;
* `service.error_body(status, message)`, if defined, shapes an error reply (default
  `{"error": message}`);
* `service.stop()`, if defined, is called once at the end: the service lets go of its
  workers, and a call still running then must raise (a 503), never answer made-up results.

A body without a Content-Length is a 411, one over `max_body` a 413, one that is not JSON a
400, as is a request HTTP cannot parse (a malformed Content-Length); more than `max_concurrency` requests at once are answered 503 with `Retry-After`; a bug
in the service answers 500 for that request and the server goes on. Every error reply
closes its connection.

SIGTERM or SIGINT starts a drain: requests already being answered finish, new ones are
answered 503 (`Retry-After`, `Connection: close`); once none is in flight and none has
arrived for `QUIET` seconds, or after `grace` seconds, the listener and the connections
close, `service.stop()` runs, and `serve_until_signal` returns 0. A request still unanswered
at the end of the grace period is answered 503. A second signal ends the grace period at once.

    >>> BadRequest("no such endpoint /x", 404).status
    404
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Iterator

from assay.errors import AssayError

BACKLOG = 4096  # connections the kernel queues before the server accepts them (Linux caps it at net.core.somaxconn)
KEEP_ALIVE = 5  # seconds an idle keep-alive connection stays open
QUIET = 0.25  # seconds without a new request before a draining server closes
RETRY_AFTER = "1"  # seconds, in a 503's Retry-After


class BadRequest(Exception):
    """A request the server refuses; `status` is its HTTP code, the message one line."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def need_uvicorn(what: str) -> None:
    """One clear line when the `serve` extra is not installed."""
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        raise AssayError(f"{what} needs the serve extra (uvicorn): pip install 'assay[serve]'") from None


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a daemon thread of its own (never joined at exit, unlike asyncio's default executor)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            value, error = None, e
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting
            pass

    threading.Thread(target=run, name="assay-serve-call", daemon=True).start()
    return await done


class JsonApp:
    """The ASGI application around a service: routes, body limits, the concurrency limit, the drain.

    Args:
        service: see the module docstring.
        max_body: most bytes in a request body (413 above).
        max_concurrency: most requests handled at once (503 with Retry-After above).
    """

    def __init__(self, service: Any, max_body: int, max_concurrency: int):
        if max_concurrency < 1:
            raise AssayError(f"--max-concurrency must be >= 1, got {max_concurrency}")
        self.service, self.max_body, self.max_concurrency = service, max_body, max_concurrency
        self.active = 0  # requests being handled now
        self.draining = False  # set at the first signal: new requests are answered 503
        self.last_arrival = time.monotonic()
        self._calls: set[asyncio.Future] = set()  # service calls in flight, cut at the end of a drain
        self._cut = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":  # lifespan is off; nothing else is served
            return
        self.last_arrival = time.monotonic()
        headers: list[tuple[bytes, bytes]] = []
        try:
            status, payload = 200, await self._handle(scope, receive, headers)
            data = json.dumps(payload, allow_nan=False).encode()
        except BadRequest as e:
            status, data = e.status, self._error(e.status, str(e))
        except Exception as e:  # a server bug answers 500 for this request; the server goes on
            status, data = 500, self._error(500, f"{type(e).__name__}: {e}".splitlines()[0])
        if status == 503:
            headers.append((b"retry-after", RETRY_AFTER.encode()))
        if status >= 400 or self.draining:  # the unread rest of a refused body is never read; a draining server sheds connections
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *headers]})
        await send({"type": "http.response.body", "body": data})

    async def _handle(self, scope: dict, receive: Callable, headers: list[tuple[bytes, bytes]]) -> Any:
        path, method = scope["path"], scope["method"]
        routes: dict[str, str] = self.service.routes
        if path not in routes:
            raise BadRequest(f"no such endpoint {path}; {', '.join(f'{m} {p}' for p, m in routes.items())}", 404)
        if method != routes[path]:
            headers.append((b"allow", routes[path].encode()))
            raise BadRequest(f"{method} is not allowed on {path}; use {routes[path]}", 405)
        if self.draining:
            raise BadRequest("the server is stopping; retry elsewhere or later", 503)
        if self.active >= self.max_concurrency:
            raise BadRequest(f"over {self.max_concurrency} requests at once (--max-concurrency); retry later", 503)
        self.active += 1
        try:
            if method == "POST":
                body = await self._read_json(scope, receive)
                return await self._call(self.service.post, path, body)
            return await self._call(self.service.get, path)
        finally:
            self.active -= 1

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """The service's reply; a 503 when the drain's grace period ends before it."""
        call = asyncio.ensure_future(fn(*args) if inspect.iscoroutinefunction(fn) else in_thread(fn, *args))
        self._calls.add(call)
        try:
            return await call
        except asyncio.CancelledError:
            if self._cut and call.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise BadRequest("the server is stopping; this request was not finished", 503) from None
            raise
        finally:
            self._calls.discard(call)

    async def _read_json(self, scope: dict, receive: Callable) -> Any:
        length = dict(scope["headers"]).get(b"content-length")
        if length is None or not length.isdigit():  # bytes.isdigit is ASCII only ("²" is not a length)
            raise BadRequest("need a Content-Length header", 411)
        if int(length) > self.max_body:
            raise BadRequest(f"body of {int(length)} bytes is over the {self.max_body}-byte limit", 413)
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client went away", 400)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            return json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"bad JSON: {e}") from None

    def _error(self, status: int, message: str) -> bytes:
        shape = getattr(self.service, "error_body", None)
        return json.dumps(shape(status, message) if shape else {"error": message}).encode()

    # ---------------------------------------------------------------- the drain

    async def drain(self, grace: float, stop_now: asyncio.Event) -> None:
        """Refuse new requests and let those in flight finish: until none is in flight and none
        came for `QUIET` seconds, `grace` seconds pass, or `stop_now` is set. What is still in
        flight then is answered 503."""
        self.draining = True
        deadline = time.monotonic() + grace
        while not stop_now.is_set() and time.monotonic() < deadline:
            if not self.active and time.monotonic() - self.last_arrival >= QUIET:
                return
            await asyncio.sleep(0.02)
        self._cut = True
        for call in list(self._calls):
            call.cancel()
        end = time.monotonic() + 5.0  # the 503s are written before the connections close
        while self.active and time.monotonic() < end:
            await asyncio.sleep(0.02)


def _listen(host: str, port: int, what: str) -> socket.socket:
    """A bound socket for `host:port` (uvicorn listens on it); AssayError when it cannot be bound."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise AssayError(f"{what}: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _raise_open_files(needed: int) -> None:
    """Lift the soft limit on open files toward `needed` (each connection is one), within the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < want:
        with contextlib.suppress(ValueError, OSError):  # best effort: past the limit, accept() waits until a connection closes
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def serve_until_signal(service: Any, host: str, port: int, max_body: int, ready_line: str, what: str,
                       ready: Callable[[str], None] | None = None, *, max_concurrency: int = 1024, grace: float = 20.0) -> int:
    """Serve `service` on `host:port` until SIGINT or SIGTERM, drain, return 0.

    Once connections are accepted, prints `ready_line` followed by ` on http://HOST:PORT` (the
    bound port, so port 0 works) to stdout, or calls `ready(address)` instead. `what` names
    the command in the error for an address that cannot be bound. `max_concurrency` and
    `grace` (seconds) are described in the module docstring. Call it from the main thread.
    """
    stop_service = getattr(service, "stop", None) or (lambda: None)
    try:
        need_uvicorn(what)
        if grace < 0:
            raise AssayError(f"{what}: --grace must be >= 0, got {grace}")
        app = JsonApp(service, max_body, max_concurrency)
        sock = _listen(host, port, what)
    except AssayError:
        stop_service()
        raise
    import uvicorn

    _raise_open_files(max_concurrency + 256)
    config = uvicorn.Config(app, lifespan="off", log_config=None, log_level="warning", access_log=False, backlog=BACKLOG,
                            timeout_keep_alive=KEEP_ALIVE, timeout_graceful_shutdown=5, server_header=False)
    config.load()
    config.http_protocol_class = _json_400(config.http_protocol_class, app)
    try:
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(_serve(_uvicorn_server(config), app, sock, grace, ready or (lambda a: print(f"{ready_line} on {a}", flush=True))))
    finally:
        stop_service()
    print("assay: server stopped", file=sys.stderr)
    return 0


async def _serve(server: Any, app: JsonApp, sock: socket.socket, grace: float, ready: Callable[[str], None]) -> None:
    """Run uvicorn on `sock` until a signal, drain, then let it shut down (listener, connections)."""
    loop = asyncio.get_running_loop()
    signalled, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        (stop_now if signalled.is_set() else signalled).set()

    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, on_signal)
    running = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started and not running.done():
        await asyncio.sleep(0.01)
    if running.done():  # it could not start: its error
        running.result()
        return
    name, port = sock.getsockname()[:2]
    ready(f"http://{f'[{name}]' if ':' in name else name}:{port}")
    await signalled.wait()
    await app.drain(grace, stop_now)
    server.should_exit = True
    await running


def _json_400(protocol: type, app: JsonApp) -> type:
    """uvicorn's HTTP protocol, answering a request it cannot parse (a malformed Content-Length, request
    line or header) with the service's one-line JSON 400 instead of plain text."""

    class Protocol(protocol):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            data = app._error(400, f"cannot parse the request: {msg.rstrip('.')}")
            head = f"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\nconnection: close\r\n\r\n"
            self.transport.write(head.encode() + data)
            self.transport.close()

    return Protocol


def _uvicorn_server(config: Any) -> Any:
    """A uvicorn server that leaves SIGINT and SIGTERM to `_serve` (a drain first, then exit 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)
