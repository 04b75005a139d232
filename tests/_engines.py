"""Real engines for the engine tests: skip without one locally, fail with one line in CI.

`require_vllm()` skips a test where vLLM is not installed, or fails it with one line when
the environment variable `CI` is set (CI must run them: `.ci/run` sets up `.venv-engine`).
`VllmServer` starts a real `vllm serve` process (vLLM's OpenAI-compatible server) on a
free local port, with the routes and transfer backend that `rollout.backend=openai` pushes
weights through, and stops it by its process id.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest


def vllm_missing() -> str | None:
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def require_vllm() -> None:
    why = vllm_missing()
    if why is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set and the engine tests cannot run: vLLM is not installed here ({why}); "
                    "run them with .venv-engine/bin/python (ASSAY_ENGINE=vllm scripts/setup.sh)", pytrace=False)
    pytest.skip(f"vLLM is not installed ({why}); ASSAY_ENGINE=vllm scripts/setup.sh sets it up")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """`vllm serve MODEL_DIR` on 127.0.0.1 with weight updates through `assay_http`; `url` once it answers."""

    def __init__(self, model_dir: str, max_model_len: int = 256, start_timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-serve-", suffix=".log", delete=False)
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager",
               "--logprobs-mode", "processed_logprobs", "--weight-transfer-config", json.dumps({"backend": "assay_http"})]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self._wait(start_timeout)

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"vllm serve did not answer within {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        os.unlink(self.log.name)
