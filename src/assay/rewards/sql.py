"""The `sql` reward: execute the completion's query and compare its result with the gold's.

Input rows carry `db` (a SQLite file; a relative path is relative to the current directory)
and `gold_sql`. Both queries run in a memory-limited worker process on a read-only
connection (`mode=ro` and `PRAGMA query_only`) with an authorizer that allows only reads
(no writes, DDL, ATTACH, PRAGMA, transactions or `load_extension`), one statement only, a
progress-handler deadline, `setlimit` caps, a row cap and a byte cap. The worker itself is
killed if it does not answer within 1.5 × the deadline.

Comparison modes (`compare`):
    test_suite     the default: the multiset of rows must match, in order only when the
                   gold has ORDER BY; any column permutation is allowed; no extra columns
                   (test-suite-sql-eval semantics).
    bird_set       set(gold rows) == set(predicted rows), columns in order (BIRD).
    spider2_columns every gold column must equal some predicted column (extra predicted
                   columns are free), numbers within 0.01, columns sorted independently
                   unless the gold has ORDER BY (Spider 2.0).
Values are normalised before comparing: integral floats equal ints, other floats are
rounded to `float_digits` significant digits. Gold results are cached per (db, gold_sql);
a gold query that fails scores None (a data bug), never a reward. `info["reason"]` says why
a query earned 0.

    >>> extract_sql("```sql\\nSELECT 1;\\n```")
    'SELECT 1'
"""

from __future__ import annotations

import itertools
import math
import os
import re
import resource
import sqlite3
import threading
import time
import urllib.parse
from collections import Counter
from typing import Any

from assay.errors import AssayError
from assay.rewards.base import REWARDS, Reward
from assay.sandbox.pool import WorkerFailure, WorkerPool
from assay.types import RewardResult, Trajectory

COMPARE_MODES = ("test_suite", "bird_set", "spider2_columns")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
                    getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
_DENIED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
_MAX_PERMUTATIONS = 20_000


def extract_sql(completion: str, how: str = "fenced") -> str | None:
    """The query in `completion`: the last ```sql block, else the last untagged block; or all of it ("raw")."""
    if how == "raw":
        text: str | None = completion
    else:
        blocks = [(t.strip().lower(), b) for t, b in _FENCE.findall(completion)]
        chosen = [b for t, b in blocks if t in ("sql", "sqlite")] or [b for t, b in blocks if not t]
        text = chosen[-1] if chosen else None
    if text is None:
        return None
    text = text.strip().rstrip(";").strip()
    return text or None


# --- the worker side ---------------------------------------------------------------------


def worker_setup(memory_mb: int) -> dict[str, Any]:
    """Once per SQL worker: bound its memory (address space and SQLite's heap)."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    return {"conns": {}, "heap": (memory_mb // 2) << 20}


def run_query(state_job: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    """Execute one query job {db, sql, timeout_s, max_rows, max_bytes} in this worker.

    Returns {"ok": bool, "rows": [[value]] | None, "ncols": int, "reason": str, "error": str}.
    """
    state, job = state_job
    try:
        conn = _connection(state, job["db"])
    except sqlite3.Error as e:
        return _fail("error", f"cannot open db: {e}")
    deadline = time.monotonic() + job["timeout_s"]
    timed_out = [False]

    def progress() -> int:
        if time.monotonic() > deadline:
            timed_out[0] = True
            return 1
        return 0

    conn.set_progress_handler(progress, 1000)
    try:
        return _fetch(conn, job)
    except sqlite3.DatabaseError as e:
        if timed_out[0]:
            return _fail("timeout", f"query ran past {job['timeout_s']} s")
        return _fail(_reason(str(e)), str(e)[:300])
    except (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError) as e:
        return _fail(_reason(str(e)), f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        conn.set_progress_handler(None, 0)


def _reason(message: str) -> str:
    if "not authorized" in message or "authorization denied" in message:
        return "not_authorized"
    return "multiple_statements" if "one statement" in message else "error"


def _fetch(conn: sqlite3.Connection, job: dict[str, Any]) -> dict[str, Any]:
    cur = conn.execute(job["sql"])
    ncols = len(cur.description or [])
    rows = cur.fetchmany(job["max_rows"] + 1)
    cur.close()
    if len(rows) > job["max_rows"]:
        return _fail("too_many_rows", f"more than {job['max_rows']} rows")
    size = sum(len(v) if isinstance(v, (str, bytes)) else 8 for row in rows for v in row)
    if size > job["max_bytes"]:
        return _fail("too_large", f"result larger than {job['max_bytes']} bytes")
    return {"ok": True, "rows": [list(r) for r in rows], "ncols": ncols, "reason": "", "error": ""}


def _fail(reason: str, error: str) -> dict[str, Any]:
    return {"ok": False, "rows": None, "ncols": 0, "reason": reason, "error": error}


def _connection(state: dict[str, Any], path: str) -> sqlite3.Connection:
    st = os.stat(path)
    key = (path, st.st_mtime_ns, st.st_size)
    conns: dict[Any, sqlite3.Connection] = state["conns"]
    if key not in conns:
        if len(conns) >= 64:  # many databases: start over rather than hold every file open
            for c in conns.values():
                c.close()
            conns.clear()
        conns[key] = _open_read_only(path, state["heap"])
    return conns[key]


def _open_read_only(path: str, heap_bytes: int) -> sqlite3.Connection:
    uri = f"file:{urllib.parse.quote(path)}?mode=ro"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA query_only = ON")
    conn.execute(f"PRAGMA hard_heap_limit = {int(heap_bytes)}")
    for name, value in (("SQLITE_LIMIT_LENGTH", 1 << 20), ("SQLITE_LIMIT_SQL_LENGTH", 100_000),
                        ("SQLITE_LIMIT_COMPOUND_SELECT", 64), ("SQLITE_LIMIT_EXPR_DEPTH", 200),
                        ("SQLITE_LIMIT_ATTACHED", 0), ("SQLITE_LIMIT_VARIABLE_NUMBER", 256)):
        if hasattr(sqlite3, name):
            conn.setlimit(getattr(sqlite3, name), value)
    conn.set_authorizer(_authorize)
    return conn


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    """Allow reading only; refuse every write, ATTACH, PRAGMA and extension loading."""
    if action not in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


# --- comparison (trusted parent) --------------------------------------------------------


def has_order_by(sql: str) -> bool:
    """True when the query (string literals and comments removed) has ORDER BY."""
    text = re.sub(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|--[^\n]*|/\*.*?\*/", " ", sql, flags=re.DOTALL)
    return re.search(r"\border\s+by\b", text, re.IGNORECASE) is not None


def norm(v: Any, digits: int = 10) -> tuple[int, Any]:
    """A hashable, type-tagged key of one SQL value: 2 == 2.0, floats to `digits` significant digits."""
    if v is None:
        return (0, 0)
    if isinstance(v, (int, float)):
        if isinstance(v, float) and math.isnan(v):
            return (4, "nan")
        if isinstance(v, float) and math.isinf(v):
            return (1, v)
        if float(v).is_integer() and abs(v) < 2**63:
            return (1, int(v))
        return (1, float(f"{v:.{digits}g}"))
    if isinstance(v, str):
        return (2, v)
    return (3, bytes(v))


def compare(gold: list[list[Any]], pred: list[list[Any]], gold_ncols: int, pred_ncols: int,
            ordered: bool, mode: str = "test_suite", digits: int = 10) -> str:
    """"match", or why not: "column_count", "row_count", "mismatch"."""
    if mode == "spider2_columns":
        return _spider2(gold, pred, gold_ncols, pred_ncols, ordered)
    g = [tuple(norm(v, digits) for v in r) for r in gold]
    p = [tuple(norm(v, digits) for v in r) for r in pred]
    if mode == "bird_set":
        return "match" if set(g) == set(p) else "mismatch"
    if not g and not p:
        return "match"
    if gold_ncols != pred_ncols:
        return "column_count"
    if len(g) != len(p):
        return "row_count"
    for perm in _column_permutations(g, p, gold_ncols):
        q = [tuple(r[j] for j in perm) for r in p]
        if (q == g) if ordered else (Counter(q) == Counter(g)):
            return "match"
    return "mismatch"


def _column_permutations(g: list[tuple], p: list[tuple], n: int) -> Any:
    """Assignments gold column i -> predicted column perm[i] whose value multisets agree."""
    gcols = [Counter(r[i] for r in g) for i in range(n)]
    pcols = [Counter(r[j] for r in p) for j in range(n)]
    options = [[j for j in range(n) if pcols[j] == gcols[i]] for i in range(n)]
    tried = 0
    for perm in itertools.product(*options):
        if len(set(perm)) != n:
            continue
        tried += 1
        if tried > _MAX_PERMUTATIONS:
            return
        yield perm


def _spider2(gold: list[list[Any]], pred: list[list[Any]], gold_ncols: int, pred_ncols: int, ordered: bool) -> str:
    if len(gold) != len(pred):
        return "row_count"
    gcols = [_column(gold, i, ordered) for i in range(gold_ncols)]
    pcols = [_column(pred, j, ordered) for j in range(pred_ncols)]
    for gc in gcols:
        if not any(len(pc) == len(gc) and all(_close(a, b) for a, b in zip(gc, pc)) for pc in pcols):
            return "mismatch"
    return "match"


def _column(rows: list[list[Any]], i: int, ordered: bool) -> list[Any]:
    col = [r[i] for r in rows]
    return col if ordered else sorted(col, key=lambda v: norm(v))


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, abs_tol=1e-2)
    return norm(a) == norm(b)


# --- the reward --------------------------------------------------------------------------

_POOLS: dict[tuple[int, int], WorkerPool] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int, memory_mb: int) -> WorkerPool:
    key = (workers, memory_mb)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = WorkerPool("assay.rewards.sql:run_query", workers, "assay.rewards.sql:worker_setup",
                                     (memory_mb,))
        return _POOLS[key]


@REWARDS.register("sql")
class SQLReward(Reward):
    """Execution-match reward for SQL written by the policy, on the row's SQLite database.

    Args:
        compare: "test_suite" (default), "bird_set" or "spider2_columns".
        extract: "fenced" (last ```sql block, else last untagged block) or "raw".
        timeout_s: deadline of each query (progress handler; the worker is killed at 1.5×).
        max_rows: rows a result may have; more scores 0 ("too_many_rows").
        max_bytes: approximate bytes a result may have.
        memory_mb: address-space limit of each SQL worker process.
        float_digits: significant digits floats are compared to.
        workers: SQL worker processes.
        db_field, gold_field: the row fields holding the database path and the gold query.

    `kind` is "io": the reward waits on its worker processes, so an executor may call
    `score` from many threads at once (the pool is thread-safe).
    """

    kind = "io"

    def __init__(self, compare: str = "test_suite", extract: str = "fenced", timeout_s: float = 2.0,
                 max_rows: int = 10_000, max_bytes: int = 32 << 20, memory_mb: int = 1024, float_digits: int = 10,
                 workers: int = 2, db_field: str = "db", gold_field: str = "gold_sql") -> None:
        if compare not in COMPARE_MODES:
            raise AssayError(f"sql reward: compare={compare!r} is not one of {', '.join(COMPARE_MODES)}")
        if extract not in ("fenced", "raw"):
            raise AssayError(f"sql reward: extract={extract!r} is not one of fenced, raw")
        self.compare, self.extract, self.timeout_s, self.max_rows = compare, extract, timeout_s, max_rows
        self.max_bytes, self.memory_mb, self.float_digits, self.workers = max_bytes, memory_mb, float_digits, workers
        self.db_field, self.gold_field = db_field, gold_field
        self._gold: dict[tuple[Any, ...], dict[str, Any]] = {}

    def score(self, traj: Trajectory) -> RewardResult:
        return self([traj])[0]

    def __call__(self, batch: list[Trajectory]) -> list[RewardResult]:
        plans = [self._plan(t) for t in batch]
        gold_todo = {p["gold_key"]: p["gold_job"] for p in plans if isinstance(p, dict) and p["gold_key"] not in self._gold}
        jobs = list(gold_todo.values()) + [p["job"] for p in plans if isinstance(p, dict) and p["job"]]
        outs = iter(self._run(jobs))
        for key in gold_todo:
            self._gold[key] = next(outs)
        return [self._result(p, next(outs) if p["job"] else None) if isinstance(p, dict) else p for p in plans]

    def _run(self, jobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not jobs:
            return []
        outs = _pool(self.workers, self.memory_mb).map(jobs, [1.5 * self.timeout_s] * len(jobs))
        return [_fail("worker_failed", o.error) if isinstance(o, WorkerFailure) else o for o in outs]

    def _plan(self, t: Trajectory) -> dict[str, Any] | RewardResult:
        db, gold = t.sample.fields.get(self.db_field), t.sample.fields.get(self.gold_field)
        if not isinstance(db, str) or not isinstance(gold, str):
            return RewardResult.failed(f"row needs string fields {self.db_field!r} and {self.gold_field!r}", score=None)
        path = os.path.abspath(db)
        try:
            st = os.stat(path)
        except OSError:
            return RewardResult.failed(f"database not found: {db}", score=None)
        pred = extract_sql(t.completion, self.extract)
        job = None if pred is None else self._job(path, pred)
        return {"gold_key": (path, st.st_mtime_ns, st.st_size, gold), "gold_job": self._job(path, gold),
                "job": job, "gold_sql": gold, "pred": pred}

    def _job(self, path: str, sql: str) -> dict[str, Any]:
        return {"db": path, "sql": sql, "timeout_s": self.timeout_s, "max_rows": self.max_rows,
                "max_bytes": self.max_bytes}

    def _result(self, plan: dict[str, Any], out: dict[str, Any] | None) -> RewardResult:
        gold = self._gold[plan["gold_key"]]
        if not gold["ok"]:
            return RewardResult.failed(f"gold query failed ({gold['reason']}): {gold['error']}", score=None,
                                       reason="gold_failed")
        info: dict[str, Any] = {"sql": plan["pred"], "compare": self.compare, "gold_rows": len(gold["rows"])}
        if out is None:
            return RewardResult(0.0, info={**info, "reason": "no_sql"})
        if not out["ok"]:
            return RewardResult(0.0, info={**info, "reason": out["reason"], "error": out["error"]})
        try:
            verdict = compare(gold["rows"], out["rows"], gold["ncols"], out["ncols"], has_order_by(plan["gold_sql"]),
                              self.compare, self.float_digits)
        except (TypeError, ValueError, IndexError) as e:  # rows of unexpected shape: no reward
            return RewardResult(0.0, info={**info, "reason": "error", "error": f"compare: {e}"})
        info.update(pred_rows=len(out["rows"]), reason=verdict)
        return RewardResult(float(verdict == "match"), info=info)
