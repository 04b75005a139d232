"""The `sql-agent` environment: deterministic databases, gold accepted, probes read-only, capped, blind to the gold."""

import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from assay.envs import SqlAgent, SqlAgentTask
from assay.envs.sql_agent import QUESTIONS, build_databases
from assay.report.metrics import read_metrics
from assay.types import Sample

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return SqlAgentTask(db_dir=str(tmp_path_factory.mktemp("dbs")))


def digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def sample_of(task, db, i=0, j=0):
    question, gold, choices = QUESTIONS[db][i]
    return Sample("s", question.format(choices[j]), fields={"db": task._paths[db], "gold_sql": gold.format(choices[j])})


def test_databases_are_the_same_bytes_every_build(tmp_path):
    a, b = build_databases(tmp_path / "a"), build_databases(tmp_path / "b")
    assert {k: digest(v) for k, v in a.items()} == {k: digest(v) for k, v in b.items()}


def test_every_gold_query_scores_1_when_submitted(task):
    env = SqlAgent(syntax="bracket")
    for db, questions in QUESTIONS.items():
        for i, (_, gold, choices) in enumerate(questions):
            for j in range(len(choices)):
                s = sample_of(task, db, i, j)
                assert env.reset(s).startswith(f"Q: {s.prompt} tables: ")
                obs, reward, done, info = env.step(f"[submit {s.fields['gold_sql']}]")
                assert (reward, done, info["finish_reason"]) == (1.0, True, "submit"), (s.fields["gold_sql"], info)
    env.reset(sample_of(task, "shop"))
    assert env.step("SELECT COUNT(*) FROM customers").reward == 0.0  # a turn without a call is the answer query
    assert env.step("[submit SELECT nonsense]").reward == 0.0


def test_tools_show_the_schema_and_rows(task):
    env = SqlAgent(syntax="bracket")
    env.reset(sample_of(task, "library"))
    assert env.step("[tables]").observation == "=books,loans"
    assert env.step("[describe loans]").observation == "=id INTEGER PRIMARY KEY,book_id INTEGER,days INTEGER"
    assert env.step("[probe SELECT COUNT(*) FROM loans]").observation == "=50"
    obs, reward, done, info = env.step("[describe nope]")
    assert not done and info["tool_calls"][0].outcome == "tool_error" and "no table 'nope'" in obs


WRITES = ["INSERT INTO books VALUES (99, 'x', 'y', 1, 1)", "UPDATE books SET pages = 0", "DELETE FROM loans", "DROP TABLE loans",
          "CREATE TABLE t (x)", "ATTACH DATABASE '/tmp/assay-probe.db' AS x", "PRAGMA writable_schema = ON", "VACUUM",
          "SELECT 1; DROP TABLE books", "SELECT load_extension('x')", "BEGIN"]


def test_probes_cannot_write(task):
    env = SqlAgent(syntax="bracket")
    env.reset(sample_of(task, "library"))
    before = digest(task._paths["library"])
    for sql in WRITES:
        obs, reward, done, info = env.step(f"[probe {sql}]")
        assert not done and info["tool_calls"][0].outcome == "tool_error" and obs.startswith("error: QueryRefused:"), (sql, obs)
    assert digest(task._paths["library"]) == before
    assert env.step("[probe SELECT COUNT(*) FROM loans]").observation == "=50"


def test_probes_cannot_exceed_their_caps(task):
    env = SqlAgent(syntax="bracket", max_rows=10, timeout_s=0.3)
    env.reset(sample_of(task, "library"))
    obs, _, _, info = env.step("[probe SELECT * FROM loans]")  # 50 rows
    assert info["tool_calls"][0].outcome == "tool_error" and "too_many_rows" in obs
    assert env.step("[probe SELECT id FROM loans LIMIT 10]").observation.count(";") == 9
    start = time.monotonic()
    obs, _, done, info = env.step("[probe WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c]")
    assert info["tool_calls"][0].outcome == "timeout" and not done
    assert time.monotonic() - start < 0.3 * 1.5 + 2.5  # the deadline (or the 1.5x kill) plus slack for a busy machine; unstopped it runs for ever
    assert env.step("[probe SELECT MAX(days) FROM loans]").observation == "=29"  # the worker still answers


def test_probes_cannot_read_the_gold(task):
    env = SqlAgent(syntax="bracket", max_rows=1000)
    s = sample_of(task, "shop", 2, 0)
    gold = s.fields["gold_sql"]
    seen = [env.reset(s)]
    for sql in ["SELECT * FROM sqlite_master", "SELECT * FROM customers", "SELECT * FROM orders", "SELECT * FROM pragma_database_list",
                f"ATTACH DATABASE '{s.fields['db']}' AS g", "SELECT readfile('/proc/self/cmdline')", "SELECT sqlite_source_id()"]:
        seen.append(env.step(f"[probe {sql}]").observation)
    text = " ".join(seen)
    assert gold not in text and "gold" not in text.lower() and "amount > 70" not in text
    assert "customers" in text and "Ada" in text  # the probes did read the database itself


def test_sql_agent_example_runs_end_to_end(tmp_path):
    out = subprocess.run([sys.executable, "-m", "assay.cli", "train", str(ROOT / "examples" / "sql-agent.yaml"), "train.steps=2",
                          f"output_dir={tmp_path}", "train.threads=1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = tmp_path.glob("sql-agent-*")  # named after the file and the time
    rows = [r for r in read_metrics(run / "metrics.jsonl") if "actor/loss" in r]
    assert len(rows) == 2 and all(r["reward/count"] == 16 and r["agent/turns_mean"] >= 1 for r in rows)
    assert (run / "final" / "model.safetensors").is_file()
