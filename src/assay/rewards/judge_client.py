"""The judge's HTTP side: one prompt in, the judge model's text out, never an exception.

`JudgeClient.ask(prompt)` posts to an OpenAI-compatible server (`/v1/completions`, or
`/v1/chat/completions` with `api: chat`) and returns a `Reply`: the text, or why there is
none. A connection error, a dropped connection, 429 or a 5xx answer is retried up to
`retries` times with doubling backoff (`backoff`, 2·`backoff`, ...); a request that gets no
answer within `timeout` seconds is not retried (a server that hangs once hangs again, and
every retry would add `timeout` to the step) and comes back with reason `timeout`; any
other failure, or the last retry's, with reason `http_error`. At most `concurrency`
requests are in flight at once, however many threads ask.

Replies are cached by the SHA-256 of the server, the route and the whole request body (so
the prompt, the model, the temperature and the seed are all in the key): in memory, and in
`cache_dir` on disk when given (one small JSON file per reply, written atomically, shared
by every process that points at the folder). Only replies that came back are cached.

`stats()` returns, and resets, what the client did since the last call: HTTP requests sent
(retries included), retries, cache hits and the seconds spent waiting on the server.

`url: local://NAME` asks a model in this process instead of a server: the function `LOCAL[NAME]`
takes the route and the request body and returns the reply body, as a server would. `assay
train` serves its own policy as `local://policy` (`assay.po.selfjudge`: self-rewarding). That
model changes as it trains, so its replies are never cached.

    >>> JudgeClient("http://127.0.0.1:1/v1", model="m", api="completions").body("2+2=")
    {'model': 'm', 'prompt': '2+2=', 'max_tokens': 64, 'temperature': 0.0}
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import io
import json
import os
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

#: in-process models a judge asks through `url: local://NAME`: NAME -> (route, body) -> the reply body
LOCAL: dict[str, Callable[[str, dict[str, Any]], Any]] = {}
RETRY_STATUS = {429, 500, 502, 503, 504}
APIS = ("chat", "completions")
MEMORY_ENTRIES = 100_000  # replies kept in memory; the oldest go first
COUNTERS = ("requests", "retries", "cache_hits", "request_seconds")  # what `JudgeClient.stats` counts


@dataclass
class Reply:
    """What came back for one prompt: `text`, or None with `reason` (`timeout`, `http_error`) and `error`."""

    text: str | None
    reason: str | None = None
    error: str | None = None
    cached: bool = False
    attempts: int = 0


class Pictured(NamedTuple):
    """A judge prompt with pictures: its text and each picture as a `data:` URL (sent as OpenAI `image_url` parts before the text)."""

    text: str
    pictures: tuple[str, ...]


class JudgeClient:
    """Asks one OpenAI-compatible server; see the module docstring.

    Args:
        url: the server (`http://host:port`, a trailing `/v1` is allowed).
        model: the model name sent in every request (None: not sent; servers that serve one model accept that).
        api: `chat` (messages, for instruction-tuned judges) or `completions` (a raw prompt).
        system: a system message first in every chat request.
        max_tokens, temperature, seed, stop: sampling fields of every request (temperature 0: greedy).
        timeout: seconds one request may wait for its answer. retries: extra attempts of a
            retryable failure. backoff: seconds before the first retry, doubled each time.
        concurrency: requests in flight at once. cache: keep replies in memory.
        cache_dir: also keep replies in this folder. api_key_env: an environment variable
            whose value is sent as `Authorization: Bearer ...` (the key itself is never stored).
    """

    def __init__(self, url: str, model: str | None = None, api: str = "chat", system: str | None = None, max_tokens: int = 64,
                 temperature: float = 0.0, seed: int | None = None, stop: list[str] | str | None = None, timeout: float = 30.0,
                 retries: int = 2, backoff: float = 0.5, concurrency: int = 8, cache: bool = True, cache_dir: str | None = None,
                 api_key_env: str | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "local://")):
            raise ValueError(f"url must be an http:// or https:// address (or local://NAME, a model in this process), got {url!r}")
        if api not in APIS:
            raise ValueError(f"api must be one of {', '.join(APIS)}, got {api!r}")
        if timeout <= 0 or retries < 0 or backoff < 0 or concurrency < 1 or max_tokens < 1:
            raise ValueError(f"need timeout > 0, retries >= 0, backoff >= 0, concurrency >= 1, max_tokens >= 1; got {timeout}, {retries}, "
                             f"{backoff}, {concurrency}, {max_tokens}")
        base = url.rstrip("/")
        self.url = base[: -len("/v1")] if base.endswith("/v1") else base
        self.model, self.api, self.system, self.max_tokens, self.temperature = model, api, system, int(max_tokens), float(temperature)
        self.seed, self.stop = seed, ([stop] if isinstance(stop, str) else list(stop) if stop else None)
        self.timeout, self.retries, self.backoff, self.concurrency = float(timeout), int(retries), float(backoff), int(concurrency)
        self.cache, self.cache_dir, self.api_key_env = cache, cache_dir, api_key_env
        if self.url.startswith("local://"):  # a model that trains: yesterday's reply is not today's
            self.cache, self.cache_dir = False, None
        self._start()

    def _start(self) -> None:
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._counts = dict.fromkeys(COUNTERS, 0.0)
        self._counts_lock = threading.Lock()
        self._memory: dict[str, str] = {}
        self._memory_lock = threading.Lock()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict[str, Any]:  # locks and threads stay behind; a worker process starts its own
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._start()

    @property
    def route(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def body(self, prompt: str | Pictured) -> dict[str, Any]:
        """The JSON request for `prompt` (a `Pictured` prompt's pictures go first in the user message, as `image_url` parts)."""
        body: dict[str, Any] = {} if self.model is None else {"model": self.model}
        content: Any = prompt
        if isinstance(prompt, Pictured):
            if self.api != "chat":
                raise ValueError("a judge prompt with pictures needs api=chat (the completions API takes text only)")
            content = [*({"type": "image_url", "image_url": {"url": url}} for url in prompt.pictures), {"type": "text", "text": prompt.text}]
        if self.api == "chat":
            body["messages"] = ([{"role": "system", "content": self.system}] if self.system else []) + [{"role": "user", "content": content}]
        else:
            body["prompt"] = prompt
        body.update(max_tokens=self.max_tokens, temperature=self.temperature)
        if self.seed is not None:
            body["seed"] = self.seed
        if self.stop:
            body["stop"] = self.stop
        return body

    # ---------------------------------------------------------------- asking

    def ask(self, prompt: str | Pictured) -> Reply:
        """The judge's reply to `prompt` (from the cache when it holds it); never raises."""
        try:
            body = self.body(prompt)
            key = hashlib.sha256(json.dumps([self.url, self.route, body], sort_keys=True).encode()).hexdigest()
            text = self._cached(key)
            if text is not None:
                self._count(cache_hits=1)
                return Reply(text, cached=True)
            with self._slots:
                reply = self._post(body)
            if reply.text is not None:
                self._remember(key, reply.text)
            return reply
        except Exception as e:  # a bug here fails one prompt, never the batch
            return Reply(None, "http_error", f"{type(e).__name__}: {e}".splitlines()[0])

    def ask_many(self, prompts: list[str | Pictured], deadline: float | None = None) -> list[Reply]:
        """One reply per prompt, equal prompts asked once; prompts unanswered after `deadline` seconds get reason `timeout`."""
        if not prompts:
            return []
        with self._memory_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.concurrency, thread_name_prefix="assay-judge")
            pool = self._pool
        futures = {p: pool.submit(self.ask, p) for p in dict.fromkeys(prompts)}
        done, _ = concurrent.futures.wait(futures.values(), timeout=deadline)
        out = {}
        for p, f in futures.items():
            if f in done:
                out[p] = f.result()
            else:  # still queued or in flight: abandoned (it ends at its own timeout), the item is unscored
                f.cancel()
                out[p] = Reply(None, "timeout", f"no reply within the batch deadline of {deadline:g}s")
        return [out[p] for p in prompts]

    def stats(self) -> dict[str, float]:
        """Counts since the last call (`COUNTERS`), then zero."""
        with self._counts_lock:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0.0)
        return out

    def _count(self, **add: float) -> None:
        with self._counts_lock:
            for k, v in add.items():
                self._counts[k] += v

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # ---------------------------------------------------------------- HTTP

    def _post(self, body: dict[str, Any]) -> Reply:
        delay, why = self.backoff, ""
        for attempt in range(1, self.retries + 2):
            start = time.monotonic()
            try:
                data = self._once(body)
            except urllib.error.HTTPError as e:
                why = _http_reason(e)
                if e.code not in RETRY_STATUS:
                    return Reply(None, "http_error", f"{self.url}{self.route}: {why}", attempts=attempt)
            except (TimeoutError, socket.timeout):
                return Reply(None, "timeout", f"{self.url}{self.route}: no reply within {self.timeout:g}s", attempts=attempt)
            except urllib.error.URLError as e:
                if isinstance(e.reason, (TimeoutError, socket.timeout)):
                    return Reply(None, "timeout", f"{self.url}{self.route}: no connection within {self.timeout:g}s", attempts=attempt)
                why = str(e.reason)
            except (OSError, http.client.HTTPException) as e:  # refused, reset, a connection closed mid-reply
                why = f"{type(e).__name__}: {e}".splitlines()[0]
            else:
                text = _reply_text(data, self.api)
                if text is None:
                    return Reply(None, "http_error", f"{self.url}{self.route}: the reply has no {_TEXT_PATH[self.api]}", attempts=attempt)
                return Reply(text, attempts=attempt)
            finally:
                self._count(requests=1, retries=float(attempt > 1), request_seconds=time.monotonic() - start)
            if attempt <= self.retries:
                time.sleep(delay)
                delay *= 2
        tries = f" after {self.retries + 1} attempts" if self.retries else ""
        return Reply(None, "http_error", f"{self.url}{self.route} failed{tries}: {why}", attempts=self.retries + 1)

    def _once(self, body: dict[str, Any]) -> Any:
        if self.url.startswith("local://"):
            name = self.url.removeprefix("local://")
            if name not in LOCAL:
                why = f"no model {name!r} is served in this process (`assay train` serves its policy as local://policy)"
                raise urllib.error.HTTPError(self.url, 404, why, None, io.BytesIO(why.encode()))  # type: ignore[arg-type]
            return LOCAL[name](self.route, body)
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(self.url + self.route, data=json.dumps(body).encode(), headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            raw = resp.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # not JSON: `_reply_text` finds no text in it

    # ---------------------------------------------------------------- cache

    def _cached(self, key: str) -> str | None:
        if self.cache:
            with self._memory_lock:
                if key in self._memory:
                    return self._memory[key]
        if self.cache_dir:
            try:
                with open(self._path(key), encoding="utf-8") as f:
                    text = json.load(f)["text"]
            except (OSError, ValueError, KeyError, TypeError):
                return None
            if isinstance(text, str):
                self._remember(key, text, disk=False)
                return text
        return None

    def _remember(self, key: str, text: str, disk: bool = True) -> None:
        if self.cache:
            with self._memory_lock:
                self._memory[key] = text
                while len(self._memory) > MEMORY_ENTRIES:
                    del self._memory[next(iter(self._memory))]
        if disk and self.cache_dir:
            path = self._path(key)
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"text": text}, f)
                os.replace(tmp, path)
            except OSError:
                pass  # a cache that cannot be written only costs a request next time

    def _path(self, key: str) -> str:
        return os.path.join(str(self.cache_dir), key[:2], f"{key}.json")


_TEXT_PATH = {"chat": "choices[0].message.content", "completions": "choices[0].text"}


def _reply_text(data: Any, api: str) -> str | None:
    """The generated text of an OpenAI-compatible reply, or None when it has none."""
    try:
        choice = data["choices"][0]
        text = choice["message"]["content"] if api == "chat" else choice["text"]
    except (KeyError, IndexError, TypeError):
        return None
    return text if isinstance(text, str) else None


def _http_reason(e: urllib.error.HTTPError) -> str:
    try:
        detail = e.read().decode(errors="replace").strip().splitlines()[0][:300]
    except (OSError, IndexError):
        detail = ""
    return f"HTTP {e.code}" + (f": {detail}" if detail else "")
