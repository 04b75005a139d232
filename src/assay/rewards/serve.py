"""`assay serve rewards`: any assay reward over HTTP, for trainers that are not assay.

Three request formats, one `RewardExecutor` behind them (worker processes, a deadline per
item, one item's failure fails only that item), and a `Coalescer` in front of it: the items
of requests that arrive together are scored as one batch, and each reply gets its own.

* `POST /get_reward`: OpenRLHF's remote reward model (`--remote_rm_url http://host:port/get_reward`).
  `{"query": [prompt + response], "prompts": [...], "labels": [...]}` ->
  `{"rewards": [float], "scores": [float], "extra_logs": {"unscored": [0/1]}, "unscored": [index], "reasons": [str]}`.
  The completion is the query after its prompt, found up to whitespace and special tokens
  (`assay.rewards.align`); a query that does not begin with its prompt is not scored. A label
  is the answer. OpenRLHF needs a float for every item, so an item that was not scored (the
  reward returned None, raised, timed out, crashed its worker; the prompt was not found)
  gets 0.0, its index in `unscored` and its reason in `reasons`.
* `POST /compute_score`: verl's custom reward function, `compute_score(data_source,
  solution_str, ground_truth, extra_info)`, over HTTP. One item `{data_source, solution_str,
  ground_truth, extra_info}` -> `{"score": float, "unscored": bool, "reason": str}`; a list
  of items -> a list of those. Every reply has the same keys (verl's reward managers gather
  the extra keys into `reward_extra_info`, which needs one value per item); unscored is 0.0.
  A `solution_str` that begins with the prompt (`extra_info["prompt"]`) is scored after it.
* `POST /score`: assay's own rows, `{"rows": [{prompt, completion, answer, **fields}]}` ->
  `{"results": [{id, score, components, info, error}]}`, exactly as `assay reward score`
  writes them: `score` is null when the item could not be scored and `error` says why.
* `GET /health` -> `{"status": "ok", "reward", "workers", "timeout", "max_batch", "items", "batches"}`.

A body that is not JSON, or JSON of the wrong shape or types (a label that is an object, a
prompt that is null), is a 400 with `{"error": one line}`; a body over the size limit a 413,
as is a batch over `--max-batch`. The HTTP around it is `assay.jsonhttp`'s.

    >>> req = verl_rows({"data_source": "gsm8k", "solution_str": "#### 4", "ground_truth": "4"})
    >>> req.rows[0]["completion"], req.rows[0]["answer"], req.single
    ('#### 4', '4', True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from assay.errors import AssayError
from assay.jsonhttp import BadRequest, need_uvicorn, serve_until_signal
from assay.rewards.align import completion_after
from assay.rewards.coalesce import Coalescer
from assay.rewards.executor import RewardExecutor
from assay.rewards.scoring import result_row, row_to_traj
from assay.rewards.spec import build_reward
from assay.types import RewardResult, Trajectory

MAX_BODY = 64 * 2**20  # bytes: a request body larger than this is refused (413)
NOT_FOUND = "prompt_not_in_query"  # the reason of an OpenRLHF item whose query does not begin with its prompt


@dataclass
class Request:
    """A parsed request: one row per item (as `/score` takes them), and the items not to score."""

    rows: list[dict[str, Any]]
    single: bool = False  # verl's one-object form: the reply is one object too
    unscored: dict[int, str] = field(default_factory=dict)  # item index -> why it is not sent to the reward


def _kind(value: Any) -> str:
    """The JSON type of a parsed value, for messages."""
    for t, name in ((bool, "boolean"), (str, "string"), (int, "number"), (float, "number"), (list, "array"), (dict, "object")):
        if isinstance(value, t):
            return name
    return "null" if value is None else type(value).__name__


def _list(body: Any, key: str, n: int | None = None) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list):
        raise BadRequest(f"'{key}' must be a list, got {_kind(value)}")
    if n is not None and len(value) != n:
        raise BadRequest(f"'{key}' has {len(value)} items but 'query' has {n}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{where} must be a string, got {_kind(value)}")
    return value


def _reference(value: Any, where: str) -> str | None:
    """A reference answer: a string, a number (as its decimal text: a GSM8K label 42 is "42") or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return str(value)
    raise BadRequest(f"{where} must be a string, a number or null, got {_kind(value)}")


def _unscored(r: RewardResult) -> bool:
    return r.score is None or r.error is not None or not math.isfinite(r.score)


def _reason(r: RewardResult) -> str:
    """Why an item was not scored ("" when it was)."""
    return (r.error or str(r.info.get("reason", ""))) if _unscored(r) else ""


# ---------------------------------------------------------------- OpenRLHF


def openrlhf_rows(body: Any) -> Request:
    """Rows from OpenRLHF's `{query, prompts, labels}`; the completion is the query after its prompt."""
    if not isinstance(body, dict):
        raise BadRequest("OpenRLHF body must be an object with 'query' (and 'prompts', 'labels')")
    queries = _list(body, "query")
    prompts = _list(body, "prompts", len(queries)) if body.get("prompts") is not None else None
    labels = _list(body, "labels", len(queries)) if body.get("labels") is not None else None
    req = Request([])
    for i, q in enumerate(queries):
        q = _text(q, f"'query[{i}]'")
        p = _text(prompts[i], f"'prompts[{i}]'") if prompts is not None else ""
        completion = completion_after(q, p)
        if completion is None:
            req.unscored[i] = NOT_FOUND
        answer = _reference(labels[i], f"'labels[{i}]'") if labels is not None else None
        req.rows.append({"prompt": p, "completion": q if completion is None else completion, "answer": answer})
    return req


def openrlhf_reply(results: list[RewardResult], req: Request) -> dict[str, Any]:
    """`rewards` and `scores` (0.0 where unscored), `extra_logs`, the unscored indices and every item's reason."""
    scores = [0.0 if _unscored(r) else float(r.score) for r in results]  # type: ignore[arg-type]
    flags = [float(_unscored(r)) for r in results]
    return {"rewards": scores, "scores": scores, "extra_logs": {"unscored": flags},
            "unscored": [i for i, f in enumerate(flags) if f], "reasons": [_reason(r) for r in results]}


# ---------------------------------------------------------------- verl


def _verl_row(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict) or "solution_str" not in item:
        raise BadRequest("a verl item must be an object with 'solution_str' (and 'data_source', 'ground_truth', 'extra_info')")
    solution = _text(item["solution_str"], f"{where}'solution_str'")
    extra = item.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise BadRequest(f"{where}'extra_info' must be an object, got {_kind(extra)}")
    source = item.get("data_source")
    if source is not None and not isinstance(source, str):
        raise BadRequest(f"{where}'data_source' must be a string, got {_kind(source)}")
    key = "prompt" if "prompt" in extra else "question"
    prompt = extra.get(key, "")
    if not isinstance(prompt, (str, list)):
        raise BadRequest(f"{where}'extra_info.{key}' must be a string or a list of messages, got {_kind(prompt)}")
    after = completion_after(solution, prompt) if isinstance(prompt, str) and prompt.strip() else None
    fields = {k: v for k, v in extra.items() if k not in ("prompt", "completion", "answer")}
    return {**fields, "prompt": prompt, "completion": solution if after is None else after,
            "answer": _reference(item.get("ground_truth"), f"{where}'ground_truth'"), "data_source": source}


def verl_rows(body: Any) -> Request:
    """Rows from one verl item or a list of them; `extra_info` entries become reward fields.

    `solution_str` is the completion; one that begins with the prompt (a decode of the whole
    sequence) is scored after it.
    """
    if isinstance(body, list):
        return Request([_verl_row(item, f"item {i}: ") for i, item in enumerate(body)])
    return Request([_verl_row(body, "")], single=True)


def verl_reply(results: list[RewardResult], req: Request) -> Any:
    """`{score, unscored, reason}` per item (0.0 where unscored), one object for one item."""
    out = [{"score": 0.0 if _unscored(r) else float(r.score), "unscored": _unscored(r), "reason": _reason(r)}  # type: ignore[arg-type]
           for r in results]
    return out[0] if req.single else out


# ---------------------------------------------------------------- assay


def _assay_row(i: int, row: Any) -> dict[str, Any]:
    if not isinstance(row, dict) or "completion" not in row:
        raise BadRequest(f"row {i}: needs an object with 'completion' (and prompt, answer)")
    for key, kinds in (("completion", (str, list)), ("prompt", (str, list, type(None)))):
        if not isinstance(row.get(key), kinds):
            raise BadRequest(f"row {i}: '{key}' must be a string or a list of messages, got {_kind(row.get(key))}")
    answer = row.get("answer")
    if isinstance(answer, (dict, list, bool)):
        raise BadRequest(f"row {i}: 'answer' must be a string, a number or null, got {_kind(answer)}")
    return row


def assay_rows(body: Any) -> Request:
    """Rows from `{"rows": [...]}` (or a bare list), each needing 'completion'."""
    rows = body.get("rows") if isinstance(body, dict) else body
    if not isinstance(rows, list):
        raise BadRequest("assay body must be {\"rows\": [{prompt, completion, answer, ...}]}")
    return Request([_assay_row(i, row) for i, row in enumerate(rows)])


def assay_reply(results: list[RewardResult], req: Request) -> dict[str, Any]:
    """The rows `assay reward score` writes: id, score (null when unscored), components, info, error."""
    return {"results": [result_row(row.get("id", i), r) for i, (row, r) in enumerate(zip(req.rows, results))]}


#: path -> (parse: body -> Request, reply: (results, request) -> JSON)
FORMATS: dict[str, tuple[Callable[[Any], Request], Callable[[list[RewardResult], Request], Any]]] = {
    "/get_reward": (openrlhf_rows, openrlhf_reply),
    "/compute_score": (verl_rows, verl_reply),
    "/score": (assay_rows, assay_reply),
}


# ---------------------------------------------------------------- the service


class RewardService:
    """Parses a request in one of the formats, scores it in a batch with its neighbours, builds the reply.

    Args:
        spec: the reward (a name, `module:attr`, YAML).
        workers, timeout: the executor's worker processes and seconds per item.
        max_batch: most items in one request (413 above).
        batch_window: seconds a batch waits for more requests after its first one arrived.
        batch_items: most items in one executor batch (a larger request is a batch alone).
    """

    routes = {"/get_reward": "POST", "/compute_score": "POST", "/score": "POST", "/health": "GET"}

    def __init__(self, spec: str, workers: int = 2, timeout: float = 5.0, max_batch: int = 4096,
                 batch_window: float = 0.005, batch_items: int = 1024):
        if max_batch < 1:
            raise AssayError(f"serve rewards: --max-batch must be >= 1, got {max_batch}")
        if batch_window < 0 or batch_items < 1:
            raise AssayError(f"serve rewards: need --batch-window >= 0 and --batch-items >= 1, got {batch_window}, {batch_items}")
        self.spec, self.max_batch = spec, max_batch
        self.executor = RewardExecutor(build_reward(spec), workers=workers, timeout=timeout, failure_score=None)
        self.coalescer = Coalescer(self._score_batch, batch_window, batch_items)
        self.items = 0
        self.stopping = False  # set when the server stops: a batch cut short then is answered 503

    async def post(self, path: str, body: Any) -> Any:
        """The reply to a POST of `body` (parsed JSON) to `path`; BadRequest for a bad one."""
        parse, reply = FORMATS[path]
        req = parse(body)
        if len(req.rows) > self.max_batch:
            raise BadRequest(f"batch of {len(req.rows)} items is over --max-batch {self.max_batch}", 413)
        todo = [i for i in range(len(req.rows)) if i not in req.unscored]
        trajs = [self._traj(req.rows[i], i) for i in todo]
        if self.stopping:
            raise BadRequest("the server is stopping; this batch was not scored", 503)
        scored = dict(zip(todo, await self.coalescer(trajs)))
        results = [scored[i] if i in scored else RewardResult(None, info={"reason": req.unscored[i]}) for i in range(len(req.rows))]
        return reply(results, req)

    @staticmethod
    def _traj(row: dict[str, Any], i: int) -> Trajectory:
        try:
            return row_to_traj(row, i)
        except (TypeError, ValueError) as e:  # e.g. a `group` that is not a number
            raise BadRequest(f"row {i}: {e}".splitlines()[0]) from None

    def _score_batch(self, trajs: list[Trajectory]) -> list[RewardResult]:
        """One executor batch, on the coalescer's thread; a 503 when the server stopped under it."""
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
        return results

    async def get(self, path: str) -> dict[str, Any]:
        ex = self.executor
        return {"status": "ok", "reward": self.spec, "workers": ex.workers, "timeout": ex.timeout,
                "max_batch": self.max_batch, "items": self.items, "batches": self.coalescer.batches}

    def stop(self) -> None:
        """Refuse new batches (503) and stop the workers; a batch they were scoring is answered 503."""
        self.stopping = True
        self.executor.close(final=True)


def serve(spec: str, host: str = "127.0.0.1", port: int = 8000, workers: int = 2, timeout: float = 5.0,
          max_batch: int = 4096, max_body: int = MAX_BODY, ready: Callable[[str], None] | None = None, *,
          batch_window: float = 0.005, batch_items: int = 1024, max_concurrency: int = 2048, grace: float = 20.0) -> int:
    """Serve reward `spec` until SIGINT or SIGTERM, drain, return 0 (see `assay.jsonhttp` for the drain).

    The reward's workers start first; then `assay: serving reward SPEC on http://HOST:PORT`
    (the bound port, so `--port 0` works) goes to stdout.
    """
    need_uvicorn("serve rewards")
    service = RewardService(spec, workers=workers, timeout=timeout, max_batch=max_batch, batch_window=batch_window, batch_items=batch_items)
    service.executor.start()
    return serve_until_signal(service, host, port, max_body, f"assay: serving reward {spec}", "serve rewards", ready,
                              max_concurrency=max_concurrency, grace=grace)
