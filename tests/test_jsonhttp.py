"""`assay.jsonhttp`: the HTTP around both serve commands, on a raw socket."""

import socket
import threading

from assay.jsonhttp import _Handler, _Server


class Echo:
    def post(self, path, body):
        return {"body": body}

    def get(self, path):
        return {}


def test_a_content_length_of_non_ascii_digits_is_a_411_not_a_server_error():
    server = _Server(("127.0.0.1", 0), _Handler)
    server.service, server.max_body = Echo(), 1000
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        with socket.create_connection(server.server_address, timeout=10) as s:
            s.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: \xb2\r\n\r\n{}")  # U+00B2: isdigit() is True
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 411"), reply
        assert b"Content-Length" in reply.split(b"\r\n\r\n", 1)[1]
    finally:
        server.shutdown()
        server.server_close()
