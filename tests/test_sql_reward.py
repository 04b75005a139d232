"""The `sql` reward: comparison semantics, the hardened executor, deadlines, and DB integrity."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time

import pytest

from assay.rewards.base import REWARDS
from assay.rewards.sql import SQLReward, compare, extract_sql, has_order_by
from assay.types import Sample, Trajectory

GOLD = "SELECT name, age FROM singer WHERE age > 30"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("sql") / "concerts.sqlite")
    conn = sqlite3.connect(path)
    conn.executescript(
        "CREATE TABLE singer(id INTEGER PRIMARY KEY, name TEXT, country TEXT, age INTEGER);"
        "CREATE TABLE big(x INTEGER);")
    conn.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                     [(1, "Ann", "FR", 25), (2, "Bob", "US", 41), (3, "Cid", "US", 35), (4, "Dee", "FR", 52)])
    conn.executemany("INSERT INTO big VALUES (?)", [(i,) for i in range(3000)])
    conn.commit()
    conn.close()
    return path


@pytest.fixture(scope="module")
def reward() -> SQLReward:
    return SQLReward(timeout_s=1.0, max_rows=1000)


def traj(sql: str | None, db: str, gold: str = GOLD) -> Trajectory:
    text = "I don't know" if sql is None else f"Let me think.\n```sql\n{sql}\n```"
    return Trajectory(Sample("q0", "who is over 30?", None, {"db": db, "gold_sql": gold}), text, [], [], [], True)


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_registered():
    assert REWARDS.get("sql") is SQLReward


def test_extraction():
    assert extract_sql("```sql\nSELECT 1;\n```\n```sql\nSELECT 2;  \n```") == "SELECT 2"
    assert extract_sql("```\nSELECT 3\n```") == "SELECT 3"
    assert extract_sql("no query") is None
    assert extract_sql("SELECT 4;", "raw") == "SELECT 4"


def test_order_by_detection_ignores_strings_and_comments():
    assert has_order_by("select a from t ORDER  BY a")
    assert not has_order_by("select 'order by' from t -- order by a")


# Rows and verdicts derived by hand; they mirror the table in research/verifiers.md §4.2.
G2 = [[1, "a"], [1, "a"], [2, "b"]]


@pytest.mark.parametrize("pred, ncols, ordered, expected", [
    ([[1, "a"], [2, "b"]], 2, False, {"test_suite": "row_count", "bird_set": "match", "spider2_columns": "row_count"}),
    ([["a", 1], ["a", 1], ["b", 2]], 2, False, {"test_suite": "match", "bird_set": "mismatch", "spider2_columns": "match"}),
    ([[1, "a", 0], [1, "a", 0], [2, "b", 0]], 3, False,
     {"test_suite": "column_count", "bird_set": "mismatch", "spider2_columns": "match"}),
    ([[2, "b"], [1, "a"], [1, "a"]], 2, True, {"test_suite": "mismatch", "bird_set": "match", "spider2_columns": "mismatch"}),
    ([[2, "b"], [1, "a"], [1, "a"]], 2, False, {"test_suite": "match", "bird_set": "match", "spider2_columns": "match"}),
    ([[1, "b"], [1, "a"], [2, "a"]], 2, False, {"test_suite": "mismatch", "bird_set": "mismatch", "spider2_columns": "match"}),
    ([[1.0, "a"], [1.0, "a"], [2.0, "b"]], 2, False, {"test_suite": "match", "bird_set": "match", "spider2_columns": "match"}),
    ([[1.004, "a"], [1.004, "a"], [2, "b"]], 2, False,
     {"test_suite": "mismatch", "bird_set": "mismatch", "spider2_columns": "match"}),
])
def test_comparison_modes(pred, ncols, ordered, expected):
    for mode, verdict in expected.items():
        assert compare(G2, pred, 2, ncols, ordered, mode) == verdict, mode


def test_correct_query_with_permuted_columns_matches(reward, db):
    out = reward([traj("SELECT age, name FROM singer WHERE age >= 31", db)])[0]
    assert out.score == 1.0 and out.info["reason"] == "match"


def test_order_matters_only_when_the_gold_orders(reward, db):
    gold = "SELECT name FROM singer WHERE age > 30 ORDER BY age DESC"
    out = reward([traj("SELECT name FROM singer WHERE age > 30 ORDER BY age", db, gold),
                  traj("SELECT name FROM singer WHERE age > 30 ORDER BY age DESC", db, gold),
                  traj("SELECT name FROM singer WHERE age > 30 ORDER BY age", db)])
    assert [r.score for r in out] == [0.0, 1.0, 0.0]
    assert out[2].info["reason"] == "column_count"


def test_reasons_for_zero(reward, db):
    cases = {"no_sql": None, "error": "SELEC name FROM singer", "mismatch": "SELECT name, age + 1 FROM singer WHERE age > 30",
             "too_many_rows": "SELECT * FROM big", "multiple_statements": "SELECT 1; SELECT 2"}
    out = reward([traj(sql, db) for sql in cases.values()])
    assert [r.info["reason"] for r in out] == list(cases)
    assert all(r.score == 0.0 for r in out)


@pytest.mark.parametrize("attack", [
    "DELETE FROM singer", "DROP TABLE singer", "UPDATE singer SET age = 0", "INSERT INTO singer VALUES (9, 'x', 'y', 1)",
    "CREATE TABLE evil(x)", "CREATE TEMP TABLE evil(x)", "ATTACH DATABASE '{dir}/attached.db' AS a",
    "PRAGMA writable_schema = ON", "PRAGMA journal_mode = DELETE", "SELECT load_extension('/tmp/evil.so')",
    "VACUUM INTO '{dir}/copy.db'", "SELECT 1; DELETE FROM singer", "REPLACE INTO singer VALUES (1, 'x', 'y', 1)",
    "BEGIN", "WITH d AS (DELETE FROM singer RETURNING *) SELECT * FROM d",
])
def test_write_attempts_earn_nothing_and_leave_the_db_byte_identical(reward, db, attack):
    before, files = digest(db), sorted(os.listdir(os.path.dirname(db)))
    sql = attack.format(dir=os.path.dirname(db))
    out = reward([traj(sql, db)])[0]
    assert out.score == 0.0 and out.info["reason"] in ("not_authorized", "error", "multiple_statements")
    assert digest(db) == before
    assert sorted(os.listdir(os.path.dirname(db))) == files


@pytest.mark.parametrize("query", [
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c",
    "SELECT count(*) FROM big a, big b, big c",
])
def test_endless_query_is_stopped_within_1_5x_its_deadline(reward, db, query):
    start = time.monotonic()
    out = reward([traj(query, db)])[0]
    assert time.monotonic() - start < 1.5 * reward.timeout_s
    assert out.score == 0.0 and out.info["reason"] == "timeout"


def test_memory_hungry_query_is_refused(reward, db):
    out = reward([traj("SELECT group_concat(hex(zeroblob(100000))) FROM big", db)])[0]
    assert out.score == 0.0 and out.info["reason"] in ("error", "too_large")


def test_failing_gold_cannot_be_scored_and_gold_is_cached(db):
    r = SQLReward()
    bad = r([traj("SELECT 1", db, gold="SELECT nope FROM singer")])[0]
    assert bad.score is None and "gold" in bad.error
    out = r([traj("SELECT name, age FROM singer WHERE age > 30", db)] * 3)
    assert [o.score for o in out] == [1.0] * 3
    assert len(r._gold) == 2  # one entry per (db, gold_sql)


def test_db_path_relative_to_the_current_directory(db, monkeypatch):
    monkeypatch.chdir(os.path.dirname(db))
    out = SQLReward()([traj(GOLD, os.path.basename(db))])[0]
    assert out.score == 1.0
    missing = SQLReward()([traj(GOLD, "nowhere.sqlite")])[0]
    assert missing.score is None and "not found" in missing.error


def test_named_modes_end_to_end(db):
    gold = "SELECT country FROM singer"
    distinct = "SELECT DISTINCT country FROM singer"
    assert SQLReward(compare="bird_set")([traj(distinct, db, gold)])[0].score == 1.0
    assert SQLReward()([traj(distinct, db, gold)])[0].score == 0.0
    extra = "SELECT country, name FROM singer"
    assert SQLReward(compare="spider2_columns")([traj(extra, db, gold)])[0].score == 1.0


def test_pickles_and_runs_under_the_reward_executor(db):
    import pickle

    from assay.rewards.executor import RewardExecutor

    r = pickle.loads(pickle.dumps(SQLReward(timeout_s=1.0)))
    batch = [traj("SELECT age, name FROM singer WHERE age > 30", db)] * 5 + [traj("DELETE FROM singer", db)]
    with RewardExecutor(r, timeout=10.0) as ex:
        out = ex.score(batch)
    assert [o.score for o in out] == [1.0] * 5 + [0.0]


def test_a_job_that_breaks_its_worker_fails_alone(db):
    from assay.rewards import sql
    from assay.sandbox import WorkerFailure

    r = SQLReward(timeout_s=0.4, workers=1)
    out = sql._pool(1, r.memory_mb).map([("not a job",)], [1.5 * r.timeout_s])
    assert isinstance(out[0], WorkerFailure)
    assert r([traj(GOLD, db)])[0].score == 1.0  # the pool goes on
