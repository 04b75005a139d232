"""The engine backends without an engine: lazy registration, config, the weight payload, the HTTP client, CI's rule.

These run in the default suite (no vLLM needed); the engine tests themselves are marked
`engine` (tests/test_engines.py, tests/test_sampler_contract.py).
"""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from assay.config import load_config
from assay.errors import AssayError
from assay.models import build_char_tokenizer, build_tiny_model
from assay.rollout.http import JsonClient
from assay.rollout.weight_transfer import decode_chunk, encode_chunks

ROOT = os.path.join(os.path.dirname(__file__), "..")
NO_VLLM = "import sys; sys.modules['vllm'] = None\n"  # `import vllm` raises ImportError from here on


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.path.join(ROOT, "src"), **env})


def test_importing_assay_and_naming_an_engine_backend_imports_no_engine():
    proc = run_python("import sys\nfrom assay.rollout.base import check_backend\nfrom assay.config import load_config\n"
                      "check_backend('vllm'); check_backend('openai'); load_config(None, ['rollout.backend=vllm'])\n"
                      "import assay.training.rl, assay.cli\nassert 'vllm' not in sys.modules, 'vllm was imported'\nprint('ok')")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_without_vllm_the_backend_is_one_line_naming_the_setup():
    code = NO_VLLM + ("from assay.models import build_char_tokenizer, build_tiny_model\nfrom assay.rollout.base import make_sampler\n"
                      "from assay.errors import AssayError\ntok = build_char_tokenizer()\n"
                      "try:\n    make_sampler('vllm', build_tiny_model(tok, hidden=32, layers=1, heads=1, intermediate=32), tok)\n"
                      "except AssayError as e:\n    print(e)\n")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert "\n" not in line and line.startswith("rollout.backend=vllm needs vLLM") and "ASSAY_ENGINE=vllm scripts/setup.sh" in line


@pytest.mark.parametrize("backend, given, expected", [("torch", None, "none"), ("vllm", None, "tis"), ("openai", None, "tis"),
                                                      ("vllm", "none", "none"), ("torch", "mis", "mis")])
def test_mismatch_correction_is_on_by_default_for_engine_backends_only(backend, given, expected):
    overrides = [f"rollout.backend={backend}"] + ([f"algo.mismatch={given}"] if given else [])
    assert load_config(None, overrides).algo.mismatch == expected


def test_bad_engine_settings_are_one_line():
    with pytest.raises(AssayError, match=r"^invalid config value rollout.weight_sync='sometimes'"):
        load_config(None, ["rollout.weight_sync=sometimes"])
    with pytest.raises(AssayError, match=r"^invalid config value rollout.max_concurrency=0"):
        load_config(None, ["rollout.max_concurrency=0"])
    from assay.rollout.base import make_sampler

    tok = build_char_tokenizer()
    with pytest.raises(AssayError, match=r"^rollout.backend=openai needs rollout.server_url"):
        make_sampler("openai", build_tiny_model(tok, hidden=32, layers=1, heads=1, intermediate=32), tok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weight_payload_carries_every_parameter_exactly(dtype):
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, hidden=32, layers=2, heads=1, intermediate=48).to(dtype)
    chunks = list(encode_chunks(model, chunk_bytes=20_000))
    assert len(chunks) > 1
    got = [pair for c in chunks for pair in decode_chunk(**json.loads(json.dumps(c)))]  # through JSON, as over HTTP
    sent = list(model.named_parameters(remove_duplicate=False))
    assert [n for n, _ in got] == [n for n, _ in sent] and "lm_head.weight" in dict(got)  # the tied name too
    for (_, a), (_, b) in zip(got, sent):
        assert a.dtype == b.dtype and torch.equal(a, b.detach())


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers 503 to the first `fail` POSTs, then echoes the JSON body."""

    fail = 0
    seen = 0

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        type(self).seen += 1
        code, out = (503, b"busy") if type(self).seen <= type(self).fail else (200, body)
        self.send_response(code)
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture
def flaky():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_client_retries_a_busy_server_and_gives_up_in_one_line(flaky):
    url = f"http://127.0.0.1:{flaky.server_address[1]}/v1"
    _Flaky.fail, _Flaky.seen = 2, 0
    assert JsonClient(url, retries=2).post("/echo", {"a": 1}) == {"a": 1}
    assert _Flaky.seen == 3
    _Flaky.fail, _Flaky.seen = 5, 0
    with pytest.raises(AssayError, match=r"^server http://127.0.0.1:\d+: POST /echo failed after 2 attempts: HTTP 503: busy$"):
        JsonClient(url, retries=1).post("/echo", {})
    with pytest.raises(AssayError, match=r"^server http://127.0.0.1:1: POST /x failed"):
        JsonClient("http://127.0.0.1:1", retries=0, timeout=5).post("/x", {})


NO_VLLM_PLUGIN = """
import sys
sys.modules["vllm"] = None
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_vllm_ci_fails_the_engine_tests_with_one_line_and_a_local_run_skips(tmp_path, ci):
    (tmp_path / "novllm.py").write_text(NO_VLLM_PLUGIN)
    env = {**os.environ, "CI": ci, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(ROOT, "src")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "novllm", "-p", "no:cacheprovider", "-m", "engine",
                           "tests/test_engines.py::test_a_fixed_server_trains_off_policy_and_logs_the_staleness"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    why = [line for line in proc.stdout.splitlines() if "vLLM is not installed" in line]
    if ci:
        assert proc.returncode != 0 and why, proc.stdout
        assert any("CI is set and the engine tests cannot run" in line for line in why)
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout
