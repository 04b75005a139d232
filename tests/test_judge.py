"""Judges and rubrics against real HTTP servers: `assay serve model` on the bundled model, and a
small stdlib server (`_judge_servers.py`) that hangs, fails or counts, each its own process.

The bundled model does arithmetic, so the judge templates here end in a sum it completes
with the rating or verdict wanted: "7+0=" answers 7, a rating of 7 on 0..10 is 0.7.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from assay.errors import AssayError
from assay.report.metrics import read_metrics
from assay.rewards.executor import RewardExecutor
from assay.rewards.judge import Judge, parse_ranking, parse_rating, parse_verdict
from assay.rewards.monitors import reward_health
from assay.rewards.spec import build_reward
from assay.types import Sample, Trajectory

TESTS = Path(__file__).parent
SRC = TESTS.parent / "src"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(TESTS)]), "OMP_NUM_THREADS": "1"}


class Proc:
    """A server subprocess whose first stdout line ends in its URL."""

    def __init__(self, argv: list[str], marker: str):
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        line = self.proc.stdout.readline()
        if marker not in line:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()}")
        self.url = line.split(" on ")[-1].strip()

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            self.proc.stderr.close()


def stub(*args: str) -> Proc:
    return Proc([sys.executable, str(TESTS / "_judge_servers.py"), *args], "serving on")


@pytest.fixture(scope="module")
def model_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("chat") / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")  # the user's text as it is: the model sees "7+0="
    server = Proc([sys.executable, "-m", "assay.cli", "serve", "model", "tiny-arith", "--port", "0", "--max-new-tokens", "8",
                   "--chat-template", str(template)], "serving model")
    yield server
    assert server.stop() == 0  # SIGTERM: a clean stop


def traj(completion: str, group: int = 0, answer=None, prompt: str = "q") -> Trajectory:
    return Trajectory(Sample(f"p{group}", prompt, answer), completion, [], [], [], True, group=group)


# ---------------------------------------------------------------- parsing (pure)


def test_parsers():
    assert parse_rating("Rating: [[7]] though 3", 1, 10) == 7.0  # [[N]] wins over an earlier bare number
    assert parse_rating("I give it 4.5", 1, 10) == 4.5 and parse_rating("11", 1, 10) is None and parse_rating("none", 1, 10) is None
    assert parse_rating("score=3/5", 0, 5, pattern=r"score=(\d)") == 3.0
    assert parse_verdict("so [[B]]", ["A", "B", "C"]) == 1 and parse_verdict("A is better", ["A", "B", "C"]) == 0
    assert parse_verdict("Absolutely", ["A", "B", "C"]) is None  # a label only counts standing alone
    assert parse_ranking("[[3, 1, 2]]", 3) == [3, 1, 2] and parse_ranking("312", 3) == [3, 1, 2]
    assert parse_ranking("[[1, 2]]", 3) is None and parse_ranking("[[1, 4, 2]]", 3) is None


def test_bad_config_is_one_line():
    for block, words in [({"name": "judge", "args": {"url": "x"}}, "url must be"),
                         ({"name": "judge", "args": {"url": "http://h", "mode": "listwise"}}, "mode must be one of"),
                         ({"name": "judge", "args": {"url": "http://h", "template": "no fields"}}, "must contain {completion}"),
                         ({"name": "judge", "args": {"url": "http://h", "colour": 1}}, "unknown argument 'colour'"),
                         ({"name": "rubric", "args": {"criteria": [{"name": "a", "check": "grep"}]}}, "criteria[0] (a).check"),
                         ({"name": "rubric", "args": {"criteria": [{"name": "a", "check": "judge", "question": "ok?"}]}}, "need judge:"),
                         ({"name": "rubric", "args": {"criteria": [{"name": "a", "check": "regex", "pattern": "("}]}}, "not a valid regular")]:
        with pytest.raises(AssayError, match=None) as e:
            build_reward(block)
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- `assay serve model`


def test_serve_model_routes(model_server):
    assert model_server.get("/v1/models")["data"][0]["id"] == "tiny-arith"
    status, body = model_server.post("/v1/completions", {"model": "tiny-arith", "prompt": "12+34=", "max_tokens": 5, "temperature": 0, "n": 2})
    assert status == 200 and [c["text"] for c in body["choices"]] == ["46", "46"] and body["choices"][0]["finish_reason"] == "stop"
    a = model_server.post("/v1/completions", {"prompt": "12+34=", "temperature": 1.0, "n": 3, "seed": 5})[1]
    b = model_server.post("/v1/completions", {"prompt": "12+34=", "temperature": 1.0, "n": 3, "seed": 5})[1]
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]  # a seed repeats the sample
    status, body = model_server.post("/v1/completions", {"prompt": [21, 22, 15, 23, 24, 33], "temperature": 0})  # "12+34=" as token ids
    assert body["choices"][0]["text"] == "46" and body["usage"]["prompt_tokens"] == 6
    status, body = model_server.post("/v1/completions", {"prompt": "12+34=", "temperature": 0, "stop": ["6"]})
    assert body["choices"][0]["text"] == "4" and body["choices"][0]["finish_reason"] == "stop"
    status, body = model_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "3+4="}], "temperature": 0})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "7"}
    for bad, code, words in [({"prompt": 5}, 400, "'prompt' must be"), ({"prompt": "1" * 300}, 400, "context of 256"),
                             ({"prompt": "1+1=", "model": "gpt-9"}, 404, "not served"), ({"prompt": "1+1=", "n": 0}, 400, "'n' must be")]:
        status, body = model_server.post("/v1/completions", bad)
        assert status == code and words in body["error"]["message"], body


def test_serve_model_wrong_method_and_path_are_openai_shaped_errors(model_server):
    for method, path, code in [("GET", "/v1/completions", 405), ("PUT", "/v1/chat/completions", 405), ("POST", "/v1/models", 405),
                               ("GET", "/v2/models", 404)]:
        req = urllib.request.Request(model_server.url + path, data=b"{}" if method != "GET" else None, method=method)
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        error = json.loads(e.value.read())["error"]
        assert e.value.code == code and error["code"] == code and error["type"] == "invalid_request_error" and "\n" not in error["message"]


def test_chat_without_a_template_is_a_clear_400():
    from assay.rollout.serve_model import BadRequest, ModelService

    service = ModelService("tiny-arith")
    with pytest.raises(BadRequest, match="has no chat template") as e:
        service.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "1+1="}]})
    assert e.value.status == 400


def test_serve_model_chat_adds_the_generation_prompt(tmp_path):
    """`/v1/chat/completions` renders messages with the template's generation prompt: through a ChatML template that honours
    `add_generation_prompt` (the fixture above ignores it), the prompt is the template's rendering *with* the assistant header."""
    from transformers import AutoTokenizer

    from assay.models import build_tiny_model, quiet_hf
    from assay.models.chat import build_chat_tokenizer, stop_token_ids

    quiet_hf()
    tok = build_chat_tokenizer("chatml")
    build_tiny_model(tok, hidden=32, layers=2, heads=2, intermediate=64, eos_ids=stop_token_ids(tok, "chatml")).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 3 + 4?"}]
    with_header = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    without = tok.apply_chat_template(messages, add_generation_prompt=False, tokenize=True, return_dict=True)["input_ids"]
    assert len(with_header) > len(without)  # the template honours the flag
    server = Proc([sys.executable, "-m", "assay.cli", "serve", "model", str(tmp_path), "--port", "0", "--max-new-tokens", "4"], "serving model")
    try:
        status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(with_header), body
        status, body = server.post("/v1/completions", {"prompt": list(with_header), "max_tokens": 2, "temperature": 0})
        assert status == 200 and body["usage"]["prompt_tokens"] == len(with_header)
    finally:
        assert server.stop() == 0


# ---------------------------------------------------------------- modes through the real model


def test_pointwise_scores_in_range_and_unparsable_is_unscored(model_server):
    judge = build_reward({"name": "judge", "args": {"url": model_server.url + "/v1", "model": "tiny-arith", "api": "completions",
                                                    "template": "{completion}+0=", "low": 0, "high": 10, "max_tokens": 4}})
    batch = [traj("7"), traj("3", 1), traj("95", 2), traj("Score: ", 3)]
    with RewardExecutor(judge, workers=2, timeout=30) as ex:  # a "batch" reward is scored whole, in this process
        results = ex.score(batch)
        stats = ex.stats()
    assert [r.score for r in results[:2]] == [0.7, 0.3] and results[0].components == {"rating": 7.0}
    assert [r.score for r in results[2:]] == [None, None]  # 95 is off the 0..10 scale; "" has no rating
    assert [r.info["reason"] for r in results[2:]] == ["unparsable", "unparsable"] and "95" in results[2].error
    assert stats["reward/executor/none"] == 2 and stats["reward/executor/failures"] == 2
    health = reward_health(results, [t.group for t in batch], [1] * 4)
    assert health["reward/reason/unparsable"] == 0.5 and health["reward/mean"] == pytest.approx(0.5)
    chat = Judge(model_server.url, model="tiny-arith", api="chat", template="{completion}+0=", low=0, high=10)
    assert chat([traj("4")])[0].score == 0.4  # the same through /v1/chat/completions and the chat template


def test_pairwise_reference_swap_and_group(model_server):
    # the verdict is the sum a+b: 1 = first better, 2 = second better, 3 = tie
    args = {"url": model_server.url, "api": "completions", "mode": "pairwise", "template": "{a}+{b}=", "labels": ["1", "2", "3"]}
    ref = Judge(**args)
    assert [r.score for r in ref([traj("1", answer="0"), traj("1", 1, answer="1"), traj("2", 2, answer="1"), traj("5", 3)])[:3]] == [1.0, 0.0, 0.5]
    assert ref([traj("5")])[0].info["reason"] == "no_reference"
    swapped = Judge(**args, swap=True)  # "1+0=" says A, "0+1=" says A again: the two orders disagree, a tie
    assert swapped([traj("1", answer="0")])[0].score == 0.5
    group = Judge(**args, against="group")  # "1+0=": the first of the pair wins
    out = group([traj("1", 0), traj("0", 0), traj("9", 1)])
    assert [r.score for r in out[:2]] == [1.0, 0.0] and out[2].info["reason"] == "group_of_one"


# ---------------------------------------------------------------- failures, retries, cache, concurrency


def test_groupwise_ranks_each_group_in_one_request():
    server = stub("--reply", "ranking: [[2, 3, 1]]")
    try:
        judge = Judge(server.url, mode="groupwise")
        out = judge([traj("a", 0), traj("b", 0), traj("c", 0), traj("x", 1), traj("y", 1)])
        assert [r.score for r in out[:3]] == [0.0, 1.0, 0.5]  # 2 best, 3 second, 1 last
        assert [r.info["reason"] for r in out[3:]] == ["unparsable", "unparsable"]  # [[2, 3, 1]] is no ranking of two
        assert server.get("/stats")["requests"] == 2
        chained = build_reward({"name": "judge", "args": {"url": server.url, "mode": "groupwise"}, "transforms": [{"name": "scale", "args": {"factor": 2}}]})
        out = chained([traj("a", 0), traj("b", 0), traj("c", 0), traj("x", 1)])  # a chain keeps the batch whole for the judge
        assert [r.score for r in out] == [0.0, 2.0, 1.0, None] and server.get("/stats")["requests"] == 3  # one request for the group
        mixed = build_reward({"name": "weighted", "args": {"components": {"rank": {"name": "judge", "args": {"url": server.url, "mode": "groupwise"}},
                                                                          "short": {"name": "regex", "args": {"pattern": "^.$"}}},
                                                           "weights": {"short": 0.5}}})
        assert mixed.kind == "batch"  # a composition over a batch reward hands it the batch whole
        out = mixed([traj("a", 0), traj("bb", 0), traj("c", 0)])
        assert [r.score for r in out] == [0.5, 1.0, 1.0] and out[1].components == {"rank": 1.0, "short": 0.0}
    finally:
        server.stop()


def test_hanging_server_leaves_samples_unscored_within_the_bound():
    server = stub("--hang-every", "1")
    try:
        judge = Judge(server.url, api="completions", timeout=1.0, concurrency=4)
        deadline = time.monotonic() + 1.0 + 8.0  # one timeout (4 requests, 4 at once) and generous slack
        out = judge([traj(str(i), i) for i in range(4)])
        assert time.monotonic() < deadline
        assert all(r.score is None and r.info["reason"] == "timeout" and r.error for r in out)
        slow = Judge(server.url, api="completions", timeout=30.0, concurrency=1, batch_timeout=1.0)
        deadline = time.monotonic() + 1.0 + 8.0
        out = slow([traj(str(i), i) for i in range(3)])  # one at a time, 30 s each: the batch deadline cuts it at 1 s
        assert time.monotonic() < deadline and {r.info["reason"] for r in out} == {"timeout"}
    finally:
        server.stop()


def test_5xx_is_retried_and_exhausted_retries_are_http_errors():
    server = stub("--fail", "2", "--reply", "[[9]]")
    try:
        once = Judge(server.url, retries=1, backoff=0.05)([traj("a")])[0]
        assert once.score is None and once.info["reason"] == "http_error" and "HTTP 500" in once.error and "after 2 attempts" in once.error
        assert server.get("/stats")["requests"] == 2
        judge = Judge(server.url, retries=2, backoff=0.05)
        ok = judge([traj("a")])[0]  # the third request is answered
        assert ok.score == pytest.approx(8 / 9) and server.get("/stats")["requests"] == 3
        stats = judge.stats()
        assert (stats["reward/judge/requests"], stats["reward/judge/retries"], stats["reward/judge/cache_hits"]) == (1, 0, 0)
        assert stats["reward/judge/request_seconds"] > 0 and judge.stats()["reward/judge/requests"] == 0  # read once
    finally:
        server.stop()
    refused = Judge(server.url, retries=1, backoff=0.05)([traj("a")])[0]  # nothing listens there now
    assert refused.score is None and refused.info["reason"] == "http_error"


def test_cache_avoids_repeated_requests(tmp_path):
    server = stub("--reply", "[[5]]")
    try:
        judge = Judge(server.url, cache_dir=str(tmp_path / "cache"))
        first = judge([traj("same", 0), traj("same", 1), traj("other", 2)])
        assert server.get("/stats")["requests"] == 2  # equal judge prompts are asked once
        assert judge.stats()["reward/judge/requests"] == 2
        again = judge([traj("same", 0), traj("other", 1)])
        assert server.get("/stats")["requests"] == 2 and again[0].info["cached"] and again[0].score == first[0].score
        assert (judge.stats()["reward/judge/cache_hits"], RewardExecutor(judge, workers=0).stats()["reward/judge/cache_hits"]) == (2, 0)
        fresh = Judge(server.url, cache_dir=str(tmp_path / "cache"))  # a new process would find the same files
        assert fresh([traj("other")])[0].score == pytest.approx(4 / 9) and server.get("/stats")["requests"] == 2
        Judge(server.url, cache=False)([traj("same")])
        assert server.get("/stats")["requests"] == 3
        with RewardExecutor(judge, workers=0) as ex:  # the executor reports the judge's counters with its own
            ex.score([traj("same", 0), traj("new", 1)])
            stats = ex.stats()
        assert (stats["reward/judge/cache_hits"], stats["reward/judge/requests"], stats["reward/executor/items"]) == (1, 1, 2)
        assert server.get("/stats")["requests"] == 4
    finally:
        server.stop()


def test_concurrency_limit_is_respected():
    server = stub("--delay", "0.5")
    try:
        out = Judge(server.url, concurrency=2)([traj(str(i), i) for i in range(6)])
        assert all(r.score is not None for r in out)
        stats = server.get("/stats")
        assert stats["requests"] == 6 and stats["max_concurrent"] == 2
    finally:
        server.stop()


# ---------------------------------------------------------------- rubrics


def long_enough(t: Trajectory) -> bool:
    return len(t.completion) >= 3


def test_rubric_weights_gates_and_checks():
    rubric = build_reward({"name": "rubric", "args": {"criteria": [
        {"name": "boxed", "check": "regex", "pattern": r"\\boxed\{", "gate": True},
        {"name": "cites", "check": "contains", "text": ["source:"], "ignore_case": True, "weight": 3},
        {"name": "long", "check": "test_judge:long_enough", "weight": 1},
        {"name": "polite", "check": "contains", "text": "stupid", "negate": True, "weight": 0}]}})
    out = rubric([traj(r"\boxed{4} Source: me"), traj(r"\boxed{4}"), traj("4 Source: me"), traj(r"\boxed{4} stupid")])
    assert [r.score for r in out] == [1.0, 0.4, 0.0, 0.4]  # (1 + 3 + 1 + 0)/5, (1 + 0 + 1)/5, gated, (1 + 0 + 1 + 0·0)/5
    assert out[0].components == {"boxed": 1.0, "cites": 1.0, "long": 1.0, "polite": 1.0}
    assert out[2].info == {"reason": "gate", "gate": ["boxed"]} and out[2].components["cites"] == 1.0


def test_rubric_judge_criteria_and_deterministic_gates_first(model_server):
    server = stub("--hang-every", "1")
    try:
        judge = {"url": model_server.url, "api": "completions", "template": "{criterion}", "max_tokens": 4}
        rubric = build_reward({"name": "rubric", "args": {"judge": judge, "criteria": [
            {"name": "format", "check": "regex", "pattern": "^[0-9]+$", "gate": True, "weight": 0},
            {"name": "sound", "check": "judge", "question": "1+0=", "weight": 1},   # the judge says 1: satisfied
            {"name": "brief", "check": "judge", "question": "0+0=", "weight": 1}]}})  # says 0: not satisfied
        out = rubric([traj("12"), traj("twelve")])
        assert out[0].score == 0.5 and out[0].components == {"format": 1.0, "sound": 1.0, "brief": 0.0}
        assert out[1].score == 0.0 and out[1].info["reason"] == "gate"
        hung = build_reward({"name": "rubric", "args": {"judge": {"url": server.url, "timeout": 0.5, "retries": 0}, "criteria": [
            {"name": "format", "check": "regex", "pattern": "^[0-9]+$", "gate": True},
            {"name": "sound", "check": "judge", "question": "is it right?"}]}})
        out = hung([traj("twelve"), traj("12")])
        assert out[0].score == 0.0 and server.get("/stats")["requests"] == 1  # the failed gate asked nothing
        assert out[1].score is None and out[1].info["reason"] == "timeout" and out[1].components == {"format": 1.0}
    finally:
        server.stop()


# ---------------------------------------------------------------- a training run with a judge that hangs


def test_train_goes_on_when_the_judge_hangs(tmp_path, tiny_model_dir):
    server = stub("--hang-every", "2", "--reply", "[[6]]")  # every second request is never answered
    try:
        reward = f"{{name: judge, args: {{url: '{server.url}', api: completions, timeout: 1.0, concurrency: 4, retries: 0}}}}"
        p = subprocess.run([sys.executable, "-m", "assay.cli", "train", f"model.path={tiny_model_dir}", f"output_dir={tmp_path}",
                            "run_name=judge", "train.steps=2", "train.eval_every=0", "train.eval_n=2", "rollout.prompts_per_step=2",
                            "rollout.group_size=2", "rollout.max_new_tokens=4", "train.threads=1", f"reward={reward}", "--no-progress"],
                           capture_output=True, text=True, env=ENV, timeout=240)
        assert p.returncode == 0, p.stderr[-2000:]
        rows = [r for r in read_metrics(tmp_path / "judge" / "metrics.jsonl") if "reward/count" in r]
        assert len(rows) >= 2
        assert sum(r.get("reward/reason/timeout", 0.0) for r in rows) > 0  # some samples were left unscored ...
        assert all(r["reward/none"] == r["reward/failures"] for r in rows)  # ... as None with a reason, never as 0
        assert any(r["reward/none"] < r["reward/count"] for r in rows)  # ... and the rest were scored
        assert all(r["reward/judge/requests"] + r["reward/judge/cache_hits"] >= 1 for r in rows)  # the judge's counters reach the metrics
    finally:
        server.stop()


def test_docstring_examples():
    import doctest

    import assay.rewards.judge
    import assay.rewards.judge_client
    import assay.rewards.rubric
    import assay.jsonhttp
    import assay.rollout.serve_model

    for mod in (assay.rewards.judge, assay.rewards.judge_client, assay.rewards.rubric, assay.rollout.serve_model, assay.jsonhttp):
        assert doctest.testmod(mod).failed == 0, mod.__name__


def test_example_rubric_scores_with_the_task_verifier():
    import yaml

    block = yaml.safe_load((TESTS.parent / "examples" / "rubric-arithmetic.yaml").read_text())["reward"]
    rubric = build_reward(block)
    out = rubric([traj("46", answer="46"), traj("45", answer="46"), traj("46 ok", answer="46"), traj("123456", answer="123456")])
    assert [r.score for r in out] == [1.0, pytest.approx(0.1 / 1.1), 0.0, pytest.approx(1 / 1.1)]
    assert out[0].components == {"integer": 1.0, "correct": 1.0, "short": 1.0} and out[2].info["reason"] == "gate"
    with pytest.raises(AssayError, match=r"criteria\[0\] \(c\)\.reward: .*unknown"):
        build_reward({"name": "rubric", "args": {"criteria": [{"name": "c", "check": "reward", "reward": "no_such_reward"}]}})
