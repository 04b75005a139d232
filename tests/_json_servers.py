"""A service for `assay.jsonhttp`'s tests, served by `serve_until_signal` in its own process.

    python tests/_json_servers.py --release FILE [--max-body N] [--max-concurrency N] [--grace S]

`POST /echo` answers `{"body": body}`; `POST /wait` answers `{"waited": true}` once FILE
exists (a request held in flight for as long as the test wants), or never; `POST /bug`
raises (a 500); `GET /stats` (a plain method: the server runs it on a thread) answers
`{"waiting": /wait and /hold requests seen, "thread": its thread's name}`; `GET /hold` blocks
its thread until FILE exists, then answers `{"held": true}`. The first line on
stdout is `serving on http://HOST:PORT`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time

from assay.jsonhttp import serve_until_signal


class Service:
    routes = {"/echo": "POST", "/wait": "POST", "/bug": "POST", "/stats": "GET", "/hold": "GET"}

    def __init__(self, release: str) -> None:
        self.release, self.waiting = release, 0

    async def post(self, path: str, body):
        if path == "/bug":
            raise RuntimeError("a bug in the service\nsecond line")
        if path == "/wait":
            self.waiting += 1
            try:
                while not os.path.exists(self.release):
                    await asyncio.sleep(0.01)
            finally:
                self.waiting -= 1
            return {"waited": True}
        return {"body": body}

    def get(self, path: str):
        if path == "/hold":  # /wait on a thread: a blocking call the server cannot interrupt
            self.waiting += 1
            while not os.path.exists(self.release):
                time.sleep(0.01)
            return {"held": True}
        return {"waiting": self.waiting, "thread": threading.current_thread().name}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--release", required=True)
    p.add_argument("--max-body", type=int, default=1000)
    p.add_argument("--max-concurrency", type=int, default=1024)
    p.add_argument("--grace", type=float, default=20.0)
    args = p.parse_args()
    serve_until_signal(Service(args.release), "127.0.0.1", 0, args.max_body, "serving", "test server",
                       max_concurrency=args.max_concurrency, grace=args.grace)


if __name__ == "__main__":
    main()
