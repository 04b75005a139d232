"""A small OpenAI-shaped HTTP server for the judge tests, run as its own process.

    python tests/_judge_servers.py [--reply TEXT] [--fail N] [--hang-every K] [--delay S]

Every POST is answered with `TEXT` as both `choices[0].text` and `choices[0].message.content`,
after `S` seconds; the first `N` POSTs get a 500 instead; with `K` > 0 every K-th POST (the
K-th, 2K-th, ... to arrive) is read and never answered. `GET /stats` gives
`{"requests": POSTs seen, "max_concurrent": most POSTs in flight at once}`. The first line
on stdout is `serving on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "Server"

    def do_GET(self) -> None:
        with self.server.lock:
            self._send(200, {"requests": self.server.requests, "max_concurrent": self.server.max_concurrent})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        s = self.server
        with s.lock:
            s.requests += 1
            n = s.requests
            s.active += 1
            s.max_concurrent = max(s.max_concurrent, s.active)
        if s.args.hang_every and n % s.args.hang_every == 0:
            time.sleep(3600)  # accepted and read, never answered
        time.sleep(s.args.delay)
        with s.lock:  # done before the answer leaves: the client may send its next request as soon as it has it
            s.active -= 1
        if n <= s.args.fail:
            self._send(500, {"error": {"message": f"failure {n} of {s.args.fail}"}})
        else:
            text = s.args.reply
            self._send(200, {"choices": [{"index": 0, "text": text, "message": {"role": "assistant", "content": text},
                                          "finish_reason": "stop"}]})

    def _send(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args) -> None:
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reply", default="[[7]]")
    p.add_argument("--fail", type=int, default=0)
    p.add_argument("--hang-every", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args()
    server = Server(("127.0.0.1", 0), Handler)
    server.args, server.lock, server.requests, server.active, server.max_concurrent = args, threading.Lock(), 0, 0, 0
    print(f"serving on http://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
