"""vLLM's weight-update routes in front of a real completions server, failing on cue; run as its own process.

    python tests/_weight_routes.py BACKEND_URL --fail-at-pause N

`/v1/...` passes through to BACKEND_URL (`assay serve model`, which generates but takes no weights). The weight
routes (`/init_weight_transfer_engine`, `/pause`, `/start_weight_update`, `/update_weights`, ...) answer 200 and
keep nothing, until the N-th `/pause`: from there on every weight route answers 500, as a server does that went
wrong in the middle of a run. The first line on stdout is `serving on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    server: "Server"

    def do_GET(self) -> None:
        self._pass(None)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path.startswith("/v1/"):
            return self._pass(body)
        with self.server.lock:
            if self.path.startswith("/pause"):
                self.server.pauses += 1
            broken = self.server.pauses >= self.server.fail_at
        self._send(500, {"error": "weight update failed"}) if broken else self._send(200, {})

    def _pass(self, body: bytes | None) -> None:
        req = urllib.request.Request(self.server.backend + self.path, body, {"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                self._send(r.status, r.read())
        except urllib.error.HTTPError as e:
            self._send(e.code, e.read())

    def _send(self, code: int, body: dict | bytes) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


class Server(ThreadingHTTPServer):
    def __init__(self, backend: str, fail_at: int):
        super().__init__(("127.0.0.1", 0), Handler)
        self.backend, self.fail_at, self.pauses, self.lock = backend.rstrip("/"), fail_at, 0, threading.Lock()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("--fail-at-pause", type=int, required=True)
    args = ap.parse_args()
    server = Server(args.backend, args.fail_at_pause)
    print(f"serving on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
