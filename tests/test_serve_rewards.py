"""`assay serve rewards`: the real server in a subprocess, called over real HTTP in each format."""

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from assay.rewards.serve import BadRequest, openrlhf_rows, verl_rows

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"


class Server:
    """`python -m assay.cli serve rewards --port 0 ...` as a subprocess; `url` from its first line."""

    def __init__(self, *args: str):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "assay.cli", "serve", "rewards", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if "serving reward" not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.split(" on ")[-1].strip()

    def post(self, path: str, payload, raw: bytes | None = None, within: float = 60):
        """`(status, parsed JSON reply)` for a POST answered within `within` seconds."""
        req = urllib.request.Request(self.url + path, data=raw if raw is not None else json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=within) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return r.status, json.loads(r.read())

    def stop(self, sig: int = signal.SIGTERM, within: float = 20) -> int:
        """Send `sig`; the exit code, which must come within `within` seconds."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=within)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            self.proc.stderr.close()


@pytest.fixture(scope="module")
def math_server():
    server = Server("--reward", "math", "--workers", "1", "--max-batch", "8")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hang_server():
    server = Server("--reward", "_reward_helpers:Misbehave", "--workers", "2", "--timeout", "1")
    yield server
    server.stop()


# ---------------------------------------------------------------- the request parsers (pure)


def test_openrlhf_completion_is_query_after_prompt():
    req = openrlhf_rows({"query": ["Q: 1+1?\nA: 2", "other"], "prompts": ["Q: 1+1?\n", "Q"], "labels": ["2", 3]})
    assert [r["completion"] for r in req.rows] == ["A: 2", "other"]
    assert req.unscored == {1: "prompt_not_in_query"}  # a query not starting with its prompt is not scored, never scored whole
    assert [r["prompt"] for r in req.rows] == ["Q: 1+1?\n", "Q"]
    assert [r["answer"] for r in req.rows] == ["2", "3"]  # a number label is its decimal text
    assert openrlhf_rows({"query": ["x"]}).rows == [{"prompt": "", "completion": "x", "answer": None}]
    with pytest.raises(BadRequest, match="'labels' has 1 items but 'query' has 2"):
        openrlhf_rows({"query": ["a", "b"], "labels": ["1"]})


def test_verl_items_single_and_batch():
    req = verl_rows({"data_source": "gsm8k", "solution_str": "4", "ground_truth": "4", "extra_info": {"question": "2+2?", "tests": [1]}})
    assert req.single and req.rows == [{"tests": [1], "question": "2+2?", "prompt": "2+2?", "completion": "4", "answer": "4", "data_source": "gsm8k"}]
    req = verl_rows([{"solution_str": "a"}, {"solution_str": "b", "ground_truth": "b"}])
    assert not req.single and [r["completion"] for r in req.rows] == ["a", "b"]
    with pytest.raises(BadRequest, match="solution_str"):
        verl_rows({"data_source": "x"})


# ---------------------------------------------------------------- the real server, three formats


def test_health(math_server):
    status, body = math_server.get("/health")
    assert status == 200 and body["status"] == "ok" and body["reward"] == "math" and body["max_batch"] == 8


def test_openrlhf_get_reward(math_server):
    status, body = math_server.post("/get_reward", {
        "query": ["What is 2+2? The answer is \\boxed{4}.", "What is 2+2? The answer is \\boxed{5}.", "What is 1/0? \\boxed{1}"],
        "prompts": ["What is 2+2? ", "What is 2+2? ", "What is 1/0? "],
        "labels": ["4", "4", "\\frac{1}{0}???"]})
    assert status == 200
    assert body["rewards"] == [1.0, 0.0, 0.0] and body["scores"] == body["rewards"]
    assert body["unscored"] == [2]  # an unparseable label: the math reward says None, OpenRLHF gets 0.0
    assert body["extra_logs"] == {"unscored": [0.0, 0.0, 1.0]}


def test_verl_compute_score(math_server):
    status, body = math_server.post("/compute_score", {"data_source": "math", "solution_str": "so \\boxed{\\frac{1}{2}}", "ground_truth": "0.5", "extra_info": {"index": 3}})
    assert status == 200 and body == {"score": 1.0, "unscored": False, "reason": ""}
    status, body = math_server.post("/compute_score", [{"data_source": "math", "solution_str": "\\boxed{3}", "ground_truth": "3"},
                                                       {"data_source": "math", "solution_str": "\\boxed{2}", "ground_truth": "3"}])
    assert status == 200 and [b["score"] for b in body] == [1.0, 0.0] and not any(b["unscored"] for b in body)


def test_assay_score(math_server):
    status, body = math_server.post("/score", {"rows": [{"id": "a", "prompt": "2+2?", "completion": "\\boxed{4}", "answer": "4"},
                                                        {"id": "b", "prompt": "2+2?", "completion": "\\boxed{5}", "answer": "4"},
                                                        {"id": "c", "completion": "\\boxed{1}", "answer": "\\frac{1}{0}???"}]})
    assert status == 200
    results = body["results"]
    assert [r["id"] for r in results] == ["a", "b", "c"]
    assert [r["score"] for r in results] == [1.0, 0.0, None]  # None: cannot score, not a silent 0
    assert results[0]["info"]["reason"] == "correct" and results[2]["info"]["reason"] == "unparseable_gold"


def test_bad_requests_are_one_line(math_server):
    status, body = math_server.post("/score", None, raw=b"{not json")
    assert status == 400 and body["error"].startswith("bad JSON:") and "\n" not in body["error"]
    status, body = math_server.post("/get_reward", {"query": "not a list"})
    assert status == 400 and body["error"] == "'query' must be a list, got string"
    status, body = math_server.post("/score", {"rows": [{"prompt": "x"}]})
    assert status == 400 and "row 0" in body["error"]
    status, body = math_server.post("/score", {"rows": [{"completion": "x", "group": "not a number"}]})
    assert status == 400 and body["error"].startswith("row 0: invalid literal for int()")
    status, body = math_server.post("/nowhere", {})
    assert status == 404 and "POST /get_reward" in body["error"]
    status, body = math_server.post("/get_reward", {"query": ["x"] * 9})
    assert status == 413 and body["error"] == "batch of 9 items is over --max-batch 8"
    assert math_server.get("/health")[0] == 200  # and the server goes on


CHAIN = "{name: weighted, args: {components: {a: math, b: {name: math, args: {no_box: zero}}}, weights: {a: 1.0, b: 0.5}}, transforms: [{name: clip, args: {low: 0.0, high: 1.25}}]}"


def test_a_composed_chain_is_served():
    server = Server("--reward", CHAIN, "--workers", "1")
    try:
        # a boxed right answer: 1.0*1 + 0.5*1 = 1.5, clipped to 1.25; "The answer is 4" is
        # right for `a` (anchored) but 0 for `b` (no_box: zero): 1.0; a wrong box: 0.
        status, body = server.post("/get_reward", {"query": ["\\boxed{4}", "The answer is 4", "\\boxed{5}"], "labels": ["4", "4", "4"]})
        assert status == 200 and body["rewards"] == [1.25, 1.0, 0.0] and body["unscored"] == []
        status, body = server.post("/score", {"rows": [{"completion": "The answer is 4", "answer": "4"}]})
        assert body["results"][0]["score"] == 1.0 and body["results"][0]["components"] == {"a": 1.0, "b": 0.0}
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------- failure isolation


def test_hanging_item_times_out_alone(hang_server):
    status, body = hang_server.post("/score", {"rows": [{"completion": "ab"}, {"completion": "hang"}, {"completion": "abcd"}, {"completion": "raise"}]},
                                    within=30)
    assert status == 200
    results = body["results"]
    assert [r["score"] for r in results] == [2.0, None, 4.0, None]  # Misbehave scores the length
    assert results[1]["info"]["reason"] == "timeout" and "timeout" in results[1]["error"]
    assert results[3]["info"]["reason"] == "raised" and "boom" in results[3]["error"]
    status, body = hang_server.post("/get_reward", {"query": ["hang", "abc"]})
    assert status == 200 and body["rewards"] == [0.0, 3.0] and body["unscored"] == [0]
    status, body = hang_server.post("/compute_score", {"solution_str": "hang"})
    assert status == 200 and body["score"] == 0.0 and body["unscored"] and "timeout" in body["reason"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_promptly(sig):
    server = Server("--reward", "math", "--workers", "1")
    assert server.post("/compute_score", {"solution_str": "\\boxed{1}", "ground_truth": "1"})[1]["score"] == 1.0
    code = server.stop(sig, within=10)
    assert code == 0  # the handler stops the server; it does not die of the signal


def test_a_signal_stops_the_server_while_a_worker_hangs():
    server = Server("--reward", "_reward_helpers:Misbehave", "--workers", "1", "--timeout", "60", "--grace", "1")
    replies = []

    def call():
        try:
            replies.append(server.post("/score", {"rows": [{"completion": "hang"}]}))
        except (OSError, http.client.HTTPException) as e:  # the connection closed as the server exits
            replies.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    time.sleep(1.5)  # the item is on a worker now, 58 s from its deadline
    assert server.stop(within=15) == 0  # after the 1 s grace period, long before the hanging item's 60 s deadline
    t.join(10)
    assert len(replies) == 1  # the abandoned batch is refused (503) or its connection closed, never scored
    assert isinstance(replies[0], (OSError, http.client.HTTPException)) or replies[0][0] == 503, replies


def test_the_rm_reward_is_served_and_batches_on_the_model(tmp_path, tiny_model_dir):
    """A real (randomly headed) reward model: the server's scores are its scores of prompt + completion, and
    three requests that arrive together are scored in two forwards' batches (half the items, then the rest)."""
    from assay.rm.model import Encoder, build_rm, save_rm, score_texts

    model, tok = build_rm(str(tiny_model_dir), seed=3)
    save_rm(tmp_path / "rm", model, tok, {"max_length": 64})
    items = [("1+2=", "3"), ("10+20=", "30 and more"), ("7+7=", "14"), ("2+2=", "4"), ("5+6=", "11"), ("9+1=", "10 or 11")]
    expected = score_texts(model, Encoder(tok, 64), items)
    assert len({round(x, 4) for x in expected}) == 6  # six different numbers, so the order is checked too
    server = Server("--reward", f"{{name: rm, args: {{path: {tmp_path / 'rm'}}}}}", "--workers", "0", "--batch-window", "30", "--batch-items", "6")
    try:
        barrier, replies = threading.Barrier(3, timeout=60), {}

        def openrlhf(k):
            barrier.wait()
            pairs = items[2 * k: 2 * k + 2]
            replies[k] = server.post("/get_reward", {"query": [p + c for p, c in pairs], "prompts": [p for p, _ in pairs]})[1]["rewards"]

        def verl():
            barrier.wait()
            body = server.post("/compute_score", [{"solution_str": c, "extra_info": {"prompt": p}} for p, c in items[4:]])[1]
            replies[2] = [b["score"] for b in body]

        threads = [threading.Thread(target=openrlhf, args=(k,)) for k in range(2)] + [threading.Thread(target=verl)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [x for k in range(3) for x in replies[k]] == pytest.approx(expected, abs=1e-5)
        assert server.get("/health")[1]["batches"] == 2
    finally:
        assert server.stop() == 0


def test_startup_errors_are_one_line():
    import socket

    env = {**os.environ, "PYTHONPATH": str(SRC)}
    cmd = [sys.executable, "-m", "assay.cli", "serve", "rewards"]
    p = subprocess.run([*cmd, "--reward", "nonesuch"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("assay: error: reward.name: unknown reward 'nonesuch'") and len(p.stderr.strip().splitlines()) == 1
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([*cmd, "--reward", "math", "--port", str(port), "--workers", "0"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip() == f"assay: error: serve rewards: cannot listen on 127.0.0.1:{port}: Address already in use"


def _descendants(pid: int) -> set[int]:
    """The process ids below `pid` (children, their children, ...), read from /proc."""
    parent = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        out |= kids
        todo += kids
    return out


def test_a_worker_hung_in_a_job_exits_when_its_server_is_killed():
    """SIGKILL gives the server no chance to stop its workers; the one hung in a job must not live on (and spin) for ever."""
    server = Server("--reward", "_reward_helpers:Misbehave", "--workers", "1", "--timeout", "600")
    threading.Thread(target=lambda: _quietly(server.post, "/score", {"rows": [{"completion": "hang"}]}), daemon=True).start()
    deadline = time.monotonic() + 30
    while not (procs := _descendants(server.proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert procs
    time.sleep(1.0)  # the job is on the worker now
    server.stop(signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (alive := {p for p in procs if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text()}) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive


def _quietly(fn, *args):
    try:
        fn(*args)
    except (OSError, http.client.HTTPException):
        pass


def test_the_workers_are_up_before_the_server_says_it_is_serving():
    """The first request does not pay for starting workers, and a stop can never race their start."""
    server = Server("--reward", "math", "--workers", "2")
    try:
        assert len(_descendants(server.proc.pid)) >= 2  # the forkserver and its workers, before any request
    finally:
        assert server.stop() == 0


def test_a_stopped_service_refuses_batches_and_starts_no_workers():
    import asyncio

    from assay.rewards.serve import RewardService

    service = RewardService("math", workers=1)
    service.executor.start()
    row = {"rows": [{"completion": r"\boxed{2}", "answer": "2"}]}
    assert asyncio.run(service.post("/score", row))["results"][0]["score"] == 1.0
    service.stop()
    with pytest.raises(BadRequest, match="stopping") as e:
        asyncio.run(service.post("/score", row))
    assert e.value.status == 503 and service.executor._pool is None
