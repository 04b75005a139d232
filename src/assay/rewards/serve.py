"""`assay serve rewards`: any assay reward over HTTP, for trainers that are not assay.

Three request formats, one `RewardExecutor` behind them (worker processes, a deadline per
item, one item's failure fails only that item):

* `POST /get_reward`: OpenRLHF's remote reward model (`--remote_rm_url http://host:port/get_reward`).
  `{"query": [prompt + response], "prompts": [...], "labels": [...]}` ->
  `{"rewards": [float], "scores": [float], "extra_logs": {"unscored": [0/1]}, "unscored": [index]}`.
  The completion is the query with its prompt cut off the front; a label is the answer.
  OpenRLHF needs a float for every item, so an item the reward could not score (it
  returned None, raised, timed out, crashed its worker) gets 0.0 and its index in `unscored`.
* `POST /compute_score`: verl's custom reward function, `compute_score(data_source,
  solution_str, ground_truth, extra_info)`, over HTTP. One item `{data_source, solution_str,
  ground_truth, extra_info}` -> `{"score": float, "unscored": bool, "reason": str}`; a list
  of items -> a list of those. Every reply has the same keys (verl's reward managers gather
  the extra keys into `reward_extra_info`, which needs one value per item); unscored is 0.0.
* `POST /score`: assay's own rows, `{"rows": [{prompt, completion, answer, **fields}]}` ->
  `{"results": [{id, score, components, info, error}]}`, exactly as `assay reward score`
  writes them: `score` is null when the item could not be scored and `error` says why.
* `GET /health` -> `{"status": "ok", "reward", "workers", "timeout", "max_batch", "items"}`.

A body that is not JSON, or JSON of the wrong shape, is a 400 with `{"error": one line}`;
a body over the size limit a 413, as is a batch over `--max-batch`. Batches are scored
one at a time (the executor's workers score each batch's items in parallel).

    >>> rows, single = verl_rows({"data_source": "gsm8k", "solution_str": "#### 4", "ground_truth": "4"})
    >>> rows[0]["completion"], rows[0]["answer"], single
    ('#### 4', '4', True)
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

from assay.errors import AssayError
from assay.jsonhttp import BadRequest, serve_until_signal
from assay.rewards.executor import RewardExecutor
from assay.rewards.scoring import result_row, row_to_traj
from assay.rewards.spec import build_reward
from assay.types import RewardResult

MAX_BODY = 64 * 2**20  # bytes: a request body larger than this is refused (413)


def _list(body: Any, key: str, n: int | None = None) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise BadRequest(f"'{key}' must be a list, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise BadRequest(f"'{key}' has {len(value)} items but 'query' has {n}")
    return value


def _unscored(r: RewardResult) -> bool:
    return r.score is None or r.error is not None or not math.isfinite(r.score)


# ---------------------------------------------------------------- OpenRLHF


def openrlhf_rows(body: Any) -> tuple[list[dict[str, Any]], bool]:
    """Rows from OpenRLHF's `{query, prompts, labels}`; the completion is the query after its prompt."""
    if not isinstance(body, dict):
        raise BadRequest("OpenRLHF body must be an object with 'query' (and 'prompts', 'labels')")
    queries = _list(body, "query")
    prompts = _list(body, "prompts", len(queries)) if body.get("prompts") is not None else [""] * len(queries)
    labels = _list(body, "labels", len(queries)) if body.get("labels") is not None else [None] * len(queries)
    rows = []
    for q, p, label in zip(queries, prompts, labels):
        q, p = str(q), str(p)
        rows.append({"prompt": p, "completion": q[len(p):] if p and q.startswith(p) else q, "answer": label})
    return rows, False


def openrlhf_reply(results: list[RewardResult], rows: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """`rewards` and `scores` (0.0 where unscored), `extra_logs`, and the unscored indices."""
    scores = [0.0 if _unscored(r) else float(r.score) for r in results]
    flags = [float(_unscored(r)) for r in results]
    return {"rewards": scores, "scores": scores, "extra_logs": {"unscored": flags},
            "unscored": [i for i, f in enumerate(flags) if f]}


# ---------------------------------------------------------------- verl


def _verl_row(item: Any) -> dict[str, Any]:
    if not isinstance(item, dict) or "solution_str" not in item:
        raise BadRequest("a verl item must be an object with 'solution_str' (and 'data_source', 'ground_truth', 'extra_info')")
    extra = item.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise BadRequest(f"'extra_info' must be an object, got {type(extra).__name__}")
    fields = {k: v for k, v in extra.items() if k not in ("prompt", "completion", "answer")}
    return {**fields, "prompt": extra.get("prompt", extra.get("question", "")), "completion": item["solution_str"],
            "answer": item.get("ground_truth"), "data_source": item.get("data_source")}


def verl_rows(body: Any) -> tuple[list[dict[str, Any]], bool]:
    """Rows from one verl item or a list of them; `extra_info` entries become reward fields."""
    if isinstance(body, list):
        return [_verl_row(item) for item in body], False
    return [_verl_row(body)], True


def verl_reply(results: list[RewardResult], rows: list[dict[str, Any]], single: bool) -> Any:
    """`{score, unscored, reason}` per item (0.0 where unscored), one object for one item."""
    out = [{"score": 0.0 if _unscored(r) else float(r.score), "unscored": _unscored(r),
            "reason": r.error or (str(r.info.get("reason", "")) if r.score is None else "")} for r in results]
    return out[0] if single else out


# ---------------------------------------------------------------- assay


def assay_rows(body: Any) -> tuple[list[dict[str, Any]], bool]:
    """Rows from `{"rows": [...]}` (or a bare list), each needing 'completion'."""
    rows = body.get("rows") if isinstance(body, dict) else body
    if not isinstance(rows, list):
        raise BadRequest("assay body must be {\"rows\": [{prompt, completion, answer, ...}]}")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or "completion" not in row:
            raise BadRequest(f"row {i}: needs an object with 'completion' (and prompt, answer)")
    return rows, False


def assay_reply(results: list[RewardResult], rows: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """The rows `assay reward score` writes: id, score (null when unscored), components, info, error."""
    return {"results": [result_row(row.get("id", i), r) for i, (row, r) in enumerate(zip(rows, results))]}


#: path -> (parse: body -> (rows, single), reply: (results, rows, single) -> JSON)
FORMATS: dict[str, tuple[Callable[[Any], tuple[list[dict[str, Any]], bool]], Callable[..., Any]]] = {
    "/get_reward": (openrlhf_rows, openrlhf_reply),
    "/compute_score": (verl_rows, verl_reply),
    "/score": (assay_rows, assay_reply),
}


# ---------------------------------------------------------------- the service


class RewardService:
    """Parses a request in one of the formats, scores it with the executor, builds the reply."""

    def __init__(self, spec: str, workers: int = 2, timeout: float = 5.0, max_batch: int = 4096):
        if max_batch < 1:
            raise AssayError(f"serve rewards: --max-batch must be >= 1, got {max_batch}")
        self.spec, self.max_batch = spec, max_batch
        self.executor = RewardExecutor(build_reward(spec), workers=workers, timeout=timeout, failure_score=None)
        self.items = 0
        self.stopping = False  # set at SIGINT/SIGTERM: a batch cut short then is answered 503
        self._lock = threading.Lock()  # the executor's pool serves one batch at a time

    def post(self, path: str, body: Any) -> Any:
        """The reply to a POST of `body` (parsed JSON) to `path`; BadRequest for a bad one."""
        if path not in FORMATS:
            raise BadRequest(f"no such endpoint {path}; POST /get_reward (OpenRLHF), /compute_score (verl), /score (assay)", 404)
        parse, reply = FORMATS[path]
        rows, single = parse(body)
        if len(rows) > self.max_batch:
            raise BadRequest(f"batch of {len(rows)} items is over --max-batch {self.max_batch}", 413)
        trajs = []
        for i, row in enumerate(rows):
            try:
                trajs.append(row_to_traj(row, i))
            except (TypeError, ValueError) as e:  # e.g. a `group` that is not a number
                raise BadRequest(f"row {i}: {e}".splitlines()[0]) from None
        with self._lock:
            if self.stopping:
                raise BadRequest("the server is stopping; this batch was not scored", 503)
            try:
                results = self.executor.score(trajs)
            except Exception:
                if not self.stopping:
                    raise
            if self.stopping:  # its workers were stopped under it: what came back is not the reward's
                raise BadRequest("the server is stopping; this batch was not scored", 503)
            self.items += len(results)
        return reply(results, rows, single)

    def get(self, path: str) -> dict[str, Any]:
        if path != "/health":
            raise BadRequest(f"no such endpoint {path}; GET /health", 404)
        ex = self.executor
        return {"status": "ok", "reward": self.spec, "workers": ex.workers, "timeout": ex.timeout,
                "max_batch": self.max_batch, "items": self.items}

    def stop(self) -> None:
        """Refuse new batches (503) and stop the workers; a batch they were scoring is answered 503."""
        self.stopping = True
        self.executor.close(final=True)


def serve(spec: str, host: str = "127.0.0.1", port: int = 8000, workers: int = 2, timeout: float = 5.0,
          max_batch: int = 4096, max_body: int = MAX_BODY, ready: Callable[[str], None] | None = None) -> int:
    """Serve reward `spec` until SIGINT or SIGTERM; returns 0 after a clean stop.

    The reward's workers start first; then `assay: serving reward SPEC on http://HOST:PORT`
    (the bound port, so `--port 0` works) goes to stdout.
    """
    service = RewardService(spec, workers=workers, timeout=timeout, max_batch=max_batch)
    service.executor.start()
    return serve_until_signal(service, host, port, max_body, f"assay: serving reward {spec}", "serve rewards", ready)
