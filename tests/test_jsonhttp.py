"""`assay.jsonhttp`: the HTTP around both serve commands, against a real server process.

Raw sockets for what clients get wrong (lengths, methods, paths), `http.client` for
keep-alive, hundreds of concurrent connections, and real signals for the drain.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)])}


class Server:
    """`tests/_json_servers.py` as a subprocess: `host`, `port`, and the file that releases `/wait`."""

    def __init__(self, tmp_path: Path, *args: str):
        self.release = tmp_path / f"release-{time.monotonic_ns()}"
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "_json_servers.py"), "--release", str(self.release), *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        line = self.proc.stdout.readline()
        if "serving on" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.host, port = line.split("://")[1].strip().rsplit(":", 1)
        self.port = int(port)

    def request(self, method: str, path: str, body=None, headers=None):
        """`(status, headers, parsed body)` on a fresh connection."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, json.loads(r.read())
        finally:
            conn.close()

    def raw(self, data: bytes) -> bytes:
        """Everything the server sends back for `data`, until it closes the connection."""
        with socket.create_connection((self.host, self.port), timeout=30) as s:
            s.sendall(data)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        return reply

    def stats(self):
        return self.request("GET", "/stats")[2]

    def wait_until(self, check, within: float = 60):
        deadline = time.monotonic() + within
        while not check():
            assert time.monotonic() < deadline, "never happened"
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, within: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=within)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("json"), "--max-body", "1000")
    yield s
    assert s.stop() == 0


def _split(reply: bytes):
    head, body = reply.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("request_bytes, status, words", [
    (b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: \xb2\r\n\r\n{}", 400, "cannot parse the request"),  # U+00B2: isdigit() is True
    (b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: -5\r\n\r\n{}", 400, "cannot parse the request"),
    (b"POST /echo HTTP/1.1\r\nHost: a\r\n\r\n", 411, "Content-Length"),
    (b"POST /echo HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411, "Content-Length"),
    (b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, 413, "over the 1000-byte limit"),
    (b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 9\r\n\r\n{not json", 400, "bad JSON"),
    (b"POST /nowhere HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}", 404, "no such endpoint /nowhere; POST /echo"),
    (b"GET /nowhere HTTP/1.1\r\nHost: a\r\n\r\n", 404, "no such endpoint"),
    (b"PUT /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}", 405, "PUT is not allowed on /echo; use POST"),
    (b"GET /echo HTTP/1.1\r\nHost: a\r\n\r\n", 405, "GET is not allowed on /echo; use POST"),
    (b"DELETE /stats HTTP/1.1\r\nHost: a\r\n\r\n", 405, "use GET"),
    (b"POST /bug HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}", 500, "RuntimeError: a bug in the service"),
])
def test_every_error_is_one_line_of_json_and_closes_the_connection(server, request_bytes, status, words):
    got, headers, body = _split(server.raw(request_bytes))  # `raw` reads until the server closes
    assert got == status
    message = json.loads(body)["error"]
    assert words in message and "\n" not in message
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    if status == 405:
        assert headers["allow"] in ("GET", "POST")


def test_keep_alive_answers_many_requests_on_one_connection(server):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    try:
        socks = []
        for i in range(5):
            conn.request("POST", "/echo", body=json.dumps({"i": i}).encode())
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read()) == {"body": {"i": i}}
            socks.append(conn.sock)
        assert all(s is socks[0] for s in socks)  # the same connection throughout
    finally:
        conn.close()


def test_a_plain_service_method_runs_off_the_event_loop(server):
    assert server.stats()["thread"] == "assay-serve-call"


def test_hundreds_of_concurrent_connections_are_all_answered(server):
    """300 clients connect at once and then post at once: none is reset (a backlog of 5 resets some)."""
    n, barrier, outcomes = 300, threading.Barrier(300, timeout=60), []

    def client(i):
        try:
            conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
            conn.connect()
            barrier.wait()
            conn.request("POST", "/echo", body=json.dumps({"i": i}).encode())
            r = conn.getresponse()
            outcomes.append((r.status, json.loads(r.read())))
            conn.close()
        except Exception as e:  # recorded, so the assertion below names it
            outcomes.append(("error", repr(e)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(outcomes, key=str) == sorted([(200, {"body": {"i": i}}) for i in range(n)], key=str)


def _in_thread(fn, *args):
    out = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_over_the_concurrency_limit_is_a_503_with_retry_after(tmp_path):
    s = Server(tmp_path, "--max-concurrency", "2")
    try:
        waits = [_in_thread(s.request, "POST", "/wait", {}) for _ in range(3)]  # held in flight until released
        s.wait_until(lambda: any(out for _, out in waits))  # the third to arrive is answered at once
        status, headers, body = next(out[0] for _, out in waits if out)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        assert body == {"error": "over 2 requests at once (--max-concurrency); retry later"}
        s.release.touch()
        for t, _ in waits:
            t.join(60)
        assert sorted(out[0][0] for _, out in waits) == [200, 200, 503]
        assert s.request("POST", "/echo", {"x": 2})[0] == 200  # and it serves again
    finally:
        s.release.touch()
        assert s.stop() == 0


def _status(s: Server) -> int:
    return s.request("POST", "/echo", {})[0]


def test_sigterm_drains_what_is_in_flight_and_refuses_the_rest(tmp_path):
    s = Server(tmp_path, "--grace", "60")
    try:
        t, out = _in_thread(s.request, "POST", "/wait", {})
        s.wait_until(lambda: s.stats()["waiting"] == 1)
        s.proc.send_signal(signal.SIGTERM)
        s.wait_until(lambda: _status(s) == 503)  # the signal is handled on the server's loop, soon after
        status, headers, body = s.request("POST", "/echo", {})
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close" and "stopping" in body["error"]
        assert s.proc.poll() is None  # still draining: the request in flight holds it
        s.release.touch()
        t.join(60)
        assert out[0][0] == 200 and out[0][2] == {"waited": True}  # answered, not cut
        assert s.proc.wait(timeout=60) == 0
        assert "server stopped" in s.proc.stderr.read()
    finally:
        s.release.touch()
        s.stop()


@pytest.mark.parametrize("second_signal, method, path", [(False, "POST", "/wait"), (True, "POST", "/wait"), (False, "GET", "/hold")])
def test_the_grace_period_ends_the_drain_with_a_503(tmp_path, second_signal, method, path):
    """An unfinished request, on the event loop or blocking a thread, is answered 503 when the grace period ends."""
    s = Server(tmp_path, "--grace", "60" if second_signal else "1")
    try:
        t, out = _in_thread(s.request, method, path, {} if method == "POST" else None)
        s.wait_until(lambda: s.stats()["waiting"] == 1)
        s.proc.send_signal(signal.SIGTERM)
        if second_signal:  # a second signal ends a 60 s grace period at once
            s.wait_until(lambda: _status(s) == 503)
            s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=30) == 0  # far below the 60 s grace and the never-released request
        t.join(30)
        status, headers, body = out[0]
        assert status == 503 and "not finished" in body["error"]  # never released, so never answered as if it were
    finally:
        s.release.touch()
        s.stop()


def test_a_missing_serve_extra_is_one_line(tmp_path):
    blocked = tmp_path / "uvicorn"
    blocked.mkdir()
    (blocked / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SRC)])}
    p = subprocess.run([sys.executable, "-m", "assay.cli", "serve", "rewards", "--reward", "math", "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == "assay: error: serve rewards needs the serve extra (uvicorn): pip install 'assay[serve]'"
