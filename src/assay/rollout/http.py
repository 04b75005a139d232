"""A small JSON-over-HTTP client with timeouts and retries (the standard library only).

Used by the OpenAI-compatible backend for completions and vLLM's weight-update routes.
A request that cannot connect, times out, or gets 429 or a 5xx answer is retried up to
`retries` times with doubling backoff (0.5 s, 1 s, 2 s, ...); any other failure, or the
last retry's, is one `AssayError` line naming the server, the route and why.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from assay.errors import AssayError

RETRY_STATUS = {429, 500, 502, 503, 504}


class JsonClient:
    """POST and GET JSON to one server.

    Args:
        base: the server's URL (`http://host:port`; a trailing `/v1` is dropped, routes carry it).
        api_key: sent as `Authorization: Bearer KEY` when given.
        timeout: seconds per request. retries: extra attempts of a retryable failure.
    """

    def __init__(self, base: str, api_key: str | None = None, timeout: float = 120.0, retries: int = 3):
        base = base.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.timeout, self.retries = timeout, retries

    def get(self, route: str) -> Any:
        return self._request("GET", route, None, None)

    def post(self, route: str, body: Any, params: dict[str, str] | None = None) -> Any:
        return self._request("POST", route, body, params)

    def try_post(self, route: str, body: Any) -> str | None:
        """POST once, without retries: None when it succeeded, else why not (one line)."""
        try:
            self._once("POST", route, body, None)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return _reason(e)
        return None

    def _request(self, method: str, route: str, body: Any, params: dict[str, str] | None) -> Any:
        delay = 0.5
        for attempt in range(self.retries + 1):
            try:
                return self._once(method, route, body, params)
            except (urllib.error.URLError, OSError) as e:
                retryable = not isinstance(e, urllib.error.HTTPError) or e.code in RETRY_STATUS
                if not retryable or attempt == self.retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise AssayError(f"server {self.base}: {method} {route} failed{tries}: {_reason(e)}") from None
                time.sleep(delay)
                delay *= 2
        raise AssertionError("unreachable")

    def _once(self, method: str, route: str, body: Any, params: dict[str, str] | None) -> Any:
        url = self.base + route + (f"?{urllib.parse.urlencode(params)}" if params else "")
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, headers=self.headers, method=method)
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.HTTPError):
        try:
            detail = e.read().decode(errors="replace").strip().splitlines()[0][:300]
        except (OSError, IndexError):
            detail = ""
        return f"HTTP {e.code}" + (f": {detail}" if detail else "")
    if isinstance(e, urllib.error.URLError):
        return str(e.reason)
    if isinstance(e, (socket.timeout, TimeoutError)):
        return "timed out"
    return str(e).splitlines()[0] if str(e) else type(e).__name__
