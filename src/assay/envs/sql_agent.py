"""The `sql-agent` environment and task: answer a question about a SQLite database by probing it first.

The task (`data.task: sql-agent`) generates two small databases from a fixed seed (`shop`:
customers and orders; `library`: books and loans; the same bytes on every machine) and
questions about them, each with a hidden gold query (`fields["gold_sql"]`). The
environment shows the question and the table names; the model may call

- `tables()`: the table names;
- `describe(table)`: the table's columns and types;
- `probe(sql)`: run a read-only query and see at most `max_rows` rows;
- `submit(sql)`: the answer, scored by the `sql` verifier (execution match against the
  gold query's result; `assay.rewards.sql`), which ends the episode.

A turn without any call is taken as the answer query itself. The bundled model's syntax
is `[probe SELECT COUNT(*) FROM books]` (a query may not contain `]`); chat models use
`json` `<tool_call>` blocks.

Probes run in the SQL verifier's worker processes on a read-only connection (`mode=ro`,
`PRAGMA query_only`, an authorizer that allows only reads: no write, DDL, ATTACH, PRAGMA or
`load_extension`), one statement, a progress-handler deadline of `timeout_s` (the worker is
killed at 1.5×) and a row cap: a result over `max_rows` rows is refused, not cut. The gold
query and its result live only in this process (the sample's fields and the verifier's
cache), never in the database, so no probe can read them.

The set-up (an isolated executable database per task, a hidden execution oracle, the agent
probing inside its harness before it answers) follows HarnessSQL, "Harness-native
post-training for multi-turn database agents"; the databases here are tiny and generated, a
smoke test of the wiring rather than a benchmark.
"""

from __future__ import annotations

import os
import random
import sqlite3
import tempfile
from pathlib import Path
from typing import Any

from assay.data.tasks.base import TASKS, Task
from assay.envs.base import ENVS, Step, ToolEnv
from assay.rewards.sql import SQLReward, _pool
from assay.sandbox.pool import WorkerFailure
from assay.types import Sample, Trajectory

VERSION = 1
CITIES = ["Oslo", "Lima", "Pune", "Kyiv", "Rome", "Baku"]
NAMES = ["Ada", "Ben", "Cai", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jon", "Kim", "Lea"]
AUTHORS = ["Ito", "Ng", "Roy", "Sen", "Tam"]
WORDS = ["Sea", "Sky", "Fox", "Owl", "Oak", "Sun", "Ice", "Ash"]


def _shop(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT, city TEXT)")
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER, amount INTEGER, year INTEGER)")
    conn.executemany("INSERT INTO customers VALUES (?, ?, ?)", [(i + 1, n, rng.choice(CITIES)) for i, n in enumerate(NAMES)])
    conn.executemany("INSERT INTO orders VALUES (?, ?, ?, ?)",
                     [(i + 1, rng.randint(1, len(NAMES)), rng.randint(5, 95), rng.randint(2019, 2024)) for i in range(40)])


def _library(conn: sqlite3.Connection, rng: random.Random) -> None:
    conn.execute("CREATE TABLE books (id INTEGER PRIMARY KEY, title TEXT, author TEXT, year INTEGER, pages INTEGER)")
    conn.execute("CREATE TABLE loans (id INTEGER PRIMARY KEY, book_id INTEGER, days INTEGER)")
    titles = [f"{a} {b}" for a in WORDS for b in WORDS if a != b][:24]
    conn.executemany("INSERT INTO books VALUES (?, ?, ?, ?, ?)",
                     [(i + 1, t, rng.choice(AUTHORS), rng.randint(1950, 2020), rng.randint(80, 600)) for i, t in enumerate(titles)])
    conn.executemany("INSERT INTO loans VALUES (?, ?, ?)", [(i + 1, rng.randint(1, 24), rng.randint(1, 30)) for i in range(50)])


DATABASES = {"shop": _shop, "library": _library}

#: question template, gold query template, parameter choices (one per database)
QUESTIONS: dict[str, list[tuple[str, str, list[Any]]]] = {
    "shop": [
        ("How many customers live in {0}?", "SELECT COUNT(*) FROM customers WHERE city = '{0}'", CITIES),
        ("Total order amount in {0}?", "SELECT SUM(amount) FROM orders WHERE year = {0}", list(range(2019, 2025))),
        ("Names of customers with an order over {0}?",
         "SELECT DISTINCT c.name FROM customers c JOIN orders o ON o.customer_id = c.id WHERE o.amount > {0}", [70, 80, 90]),
        ("How many orders did {0} place?",
         "SELECT COUNT(*) FROM orders o JOIN customers c ON o.customer_id = c.id WHERE c.name = '{0}'", NAMES),
    ],
    "library": [
        ("How many books are from before {0}?", "SELECT COUNT(*) FROM books WHERE year < {0}", [1960, 1970, 1980, 1990, 2000]),
        ("Titles of books by {0}?", "SELECT title FROM books WHERE author = '{0}'", AUTHORS),
        ("How many loans lasted over {0} days?", "SELECT COUNT(*) FROM loans WHERE days > {0}", [5, 10, 15, 20, 25]),
        ("Most pages in a book by {0}?", "SELECT MAX(pages) FROM books WHERE author = '{0}'", AUTHORS),
    ],
}


def build_databases(folder: str | os.PathLike | None = None) -> dict[str, str]:
    """The task's databases, built once from a fixed seed into `folder` (default: a folder in the temp dir); name → path."""
    root = Path(folder) if folder is not None else Path(tempfile.gettempdir()) / f"assay-sql-agent-v{VERSION}"
    root.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fill in DATABASES.items():
        path = root / f"{name}.sqlite"
        if not path.is_file():
            tmp = root / f".{name}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            conn = sqlite3.connect(tmp)
            fill(conn, random.Random(f"sql-agent:{name}:{VERSION}"))
            conn.commit()
            conn.close()
            os.replace(tmp, path)  # another process building the same file writes the same bytes
        paths[name] = str(path)
    return paths


@TASKS.register("sql-agent")
class SqlAgentTask(Task):
    """Questions about the bundled SQLite databases, each with a hidden gold query (see the module docstring).

    Args:
        db_dir: where the databases are built (default: a folder in the temp dir).
    """

    reward = "sql"

    def __init__(self, db_dir: str | None = None, heldout_fraction: float = 0.2):
        self.db_dir, self.heldout_fraction = db_dir, heldout_fraction
        self._paths = build_databases(db_dir)

    def make(self, rng: random.Random) -> Sample:
        db = rng.choice(sorted(QUESTIONS))
        question, gold, choices = rng.choice(QUESTIONS[db])
        value = rng.choice(choices)
        return Sample("", question.format(value), fields={"db": self._paths[db], "gold_sql": gold.format(value), "db_name": db})


@ENVS.register("sql-agent")
class SqlAgent(ToolEnv):
    """Probe a SQLite database with read-only queries, then submit an answer query (see the module docstring).

    Args:
        syntax: `bracket` (the bundled model) or `json` (chat models).
        max_rows: rows a probe may return (more is refused with an error observation).
        timeout_s: deadline of a probe query (and of the final scoring).
        max_chars: an observation is cut to this many characters.
        workers: SQL worker processes (shared with the `sql` reward's pool of the same size).
    """

    def __init__(self, syntax: str = "bracket", max_rows: int = 20, timeout_s: float = 1.0, max_chars: int = 300, workers: int = 2):
        super().__init__([self.tables, self.describe, self.probe, self.submit], syntax, timeout_s=3 * timeout_s + 5)
        self.box.max_chars = max_chars
        self.max_rows, self.timeout_s, self.workers = max_rows, timeout_s, workers
        self.verifier = SQLReward(extract="raw", timeout_s=timeout_s, workers=workers)

    def prompt(self, sample: Sample) -> str:
        names = [r[0] for r in self._query("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")["rows"] or []]
        return f"Q: {sample.prompt} tables: {','.join(names)}"

    # -- the tools -----------------------------------------------------------------------

    def tables(self) -> str:
        """The names of the database's tables."""
        return ",".join(str(r[0]) for r in self._rows("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"))

    def describe(self, table: str) -> str:
        """The columns of a table, with their types."""
        known = self.tables().split(",")
        if table.strip() not in known:
            raise ValueError(f"no table {table.strip()!r}; tables: {','.join(known)}")
        (create,) = self._rows(f"SELECT sql FROM sqlite_master WHERE type = 'table' AND name = '{table.strip()}'")[0]
        return create[create.index("(") + 1 : create.rindex(")")].replace(", ", ",")

    def probe(self, sql: str) -> str:
        """Run a read-only query and show its rows (at most max_rows)."""
        return ";".join(",".join(str(v) for v in row) for row in self._rows(sql))

    def submit(self, sql: str) -> str:
        """Submit the answer query; it is scored and the episode ends."""
        return "submitted"

    # -- the episode ---------------------------------------------------------------------

    def step(self, action: str) -> Step:
        calls = self.box.run(action) if self.box.has_call(action) else []
        submitted = self._submits(action)
        if not calls or submitted:
            text = submitted[-1] if submitted else action
            reward, reason = self._score(text)
            return Step("", reward, True, {"tool_calls": calls, "finish_reason": "submit" if submitted else "answer", "reason": reason})
        return Step(self.render(calls), 0.0, False, {"tool_calls": calls})

    def answer(self, text: str) -> float | None:
        return self._score(text)[0]

    def _submits(self, action: str) -> list[str]:
        from assay.envs.tools import parse_calls

        out = []
        for name, args, _ in parse_calls(action, self.box.syntax):
            if name == "submit":
                out.append(args if isinstance(args, str) else str(args.get("sql", "")))
        return out

    def _score(self, sql: str) -> tuple[float | None, str]:
        assert self.sample is not None
        traj = Trajectory(self.sample, sql, [], [], [], True)
        result = self.verifier([traj])[0]
        return result.score, str(result.info.get("reason", result.error or ""))

    def _query(self, sql: str) -> dict[str, Any]:
        assert self.sample is not None
        job = {"db": os.path.abspath(self.sample.fields["db"]), "sql": sql, "timeout_s": self.timeout_s, "max_rows": self.max_rows,
               "max_bytes": 1 << 20}
        out = _pool(self.workers, 1024).map([job], [1.5 * self.timeout_s])[0]
        if isinstance(out, WorkerFailure):
            return {"ok": False, "rows": None, "reason": out.reason, "error": out.error}
        return out

    def _rows(self, sql: str) -> list[list[Any]]:
        out = self._query(sql)
        if out["ok"]:
            return out["rows"]
        if out["reason"] == "timeout":
            raise TimeoutError(out["error"])  # the tool-call outcome `timeout`
        raise QueryRefused(f"{out['reason']}: {out['error']}")


class QueryRefused(Exception):
    """A probe the database refused or that failed (the model is shown why)."""
