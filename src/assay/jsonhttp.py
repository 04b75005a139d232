"""JSON over HTTP until a signal: the one server behind `assay serve rewards` and `assay serve model`.

A *service* answers parsed requests; this module does the HTTP around it:

* `service.get(path)` and `service.post(path, body)` return the reply's payload, or raise
  `BadRequest` with its status (404 for an unknown path);
* `service.error_body(status, message)`, if defined, shapes an error reply (default
  `{"error": message}`);
* `service.stop()`, if defined, is called once when the server stops, after it stopped
  accepting connections: the service refuses what arrives later and lets go of its workers.

A body without a Content-Length is a 411, one over `max_body` a 413, one that is not JSON a
400; a bug in the service answers 500 for that request and the server goes on. Every error
reply closes its connection (the unread rest of a refused body is never read as a request).

    >>> BadRequest("no such endpoint /x", 404).status
    404
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from assay.errors import AssayError


class BadRequest(Exception):
    """A request the server refuses; `status` is its HTTP code, the message one line."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._answer(lambda: self.server.service.get(self.path.split("?")[0]))

    def do_POST(self) -> None:
        self._answer(lambda: self.server.service.post(self.path.split("?")[0], self._read_json()))

    def _answer(self, reply: Callable[[], Any]) -> None:
        try:
            status, data = 200, json.dumps(reply(), allow_nan=False).encode()
        except BadRequest as e:
            status, data = e.status, self._error(e.status, str(e))
        except Exception as e:  # a server bug answers 500 for this request; the server goes on
            status, data = 500, self._error(500, f"{type(e).__name__}: {e}".splitlines()[0])
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status >= 400:
            self.send_header("Connection", "close")  # the unread rest of a refused body must not be read as a request
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> bytes:
        shape = getattr(self.server.service, "error_body", None)
        return json.dumps(shape(status, message) if shape else {"error": message}).encode()

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not (length.isascii() and length.isdigit()):  # "²" is a digit to isdigit, not to int
            raise BadRequest("need a Content-Length header", 411)
        if int(length) > self.server.max_body:
            raise BadRequest(f"body of {length} bytes is over the {self.server.max_body}-byte limit", 413)
        try:
            return json.loads(self.rfile.read(int(length)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"bad JSON: {e}") from None

    def log_message(self, format: str, *args: Any) -> None:  # no line per request on stderr
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a request stuck at shutdown does not hold the process
    service: Any
    max_body: int


def serve_until_signal(service: Any, host: str, port: int, max_body: int, ready_line: str, what: str,
                       ready: Callable[[str], None] | None = None) -> int:
    """Serve `service` on `host:port` until SIGINT or SIGTERM; 0 after a clean stop.

    Once connections are accepted, prints `ready_line` followed by ` on http://HOST:PORT` (the
    bound port, so port 0 works) to stdout, or calls `ready(address)` instead. `what` names
    the command in the error for an address that cannot be bound.
    """
    stop_service = getattr(service, "stop", None) or (lambda: None)
    try:
        server = _Server((host, port), _Handler)
    except OSError as e:
        stop_service()
        raise AssayError(f"{what}: cannot listen on {host}:{port}: {e.strerror}") from None
    server.service, server.max_body = service, max_body
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="assay-serve", daemon=True)
    thread.start()
    address = f"http://{server.server_address[0]}:{server.server_address[1]}"
    (ready or (lambda a: print(f"{ready_line} on {a}", flush=True)))(address)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        server.server_close()
        stop_service()
        for s, h in previous.items():
            signal.signal(s, h)
    print("assay: server stopped", file=sys.stderr)
    return 0
