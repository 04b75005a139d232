"""The security suite cannot be skipped in CI, and set-up fails without a sandbox (issue 21).

- `scripts/setup.sh` runs in a copy of the repository's `scripts/` whose install-sandbox.sh is
  a stub (failing or succeeding) and whose `.venv/bin/python` answers every pip and torch
  call with success, so only the script's own decisions are exercised.
- pytest runs a sandbox test with bubblewrap made unfindable (a plugin replaces
  `isolation.find_bwrap`): a skip for a local user, one line and a failure when CI is set.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")


def fake_repo(tmp_path, install_rc: int) -> str:
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / ".venv" / "bin").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "scripts", "setup.sh"), repo / "scripts" / "setup.sh")
    stub = repo / "scripts" / "install-sandbox.sh"
    stub.write_text(f"#!/bin/sh\ntouch '{repo}/install-ran'\necho 'install-sandbox: no working bwrap' >&2\nexit {install_rc}\n")
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.write_text("#!/bin/sh\nexit 0\n")
    for f in (stub, venv_python):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    return str(repo)


def setup(repo: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "ASSAY_NO_SANDBOX"}
    return subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, capture_output=True, text=True, timeout=60,
                          env={**clean, "PYTHON": sys.executable, **env})


def test_a_failed_sandbox_install_fails_the_setup_with_one_line(tmp_path):
    proc = setup(fake_repo(tmp_path, install_rc=1))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("setup: the code sandbox (bubblewrap) could not be installed") and "ASSAY_NO_SANDBOX=1" in last


@pytest.mark.parametrize("install_rc, opt_out", [(0, None), (1, "1")])
def test_setup_succeeds_with_a_sandbox_or_an_explicit_opt_out(tmp_path, install_rc, opt_out):
    repo = fake_repo(tmp_path, install_rc)
    proc = setup(repo, **({"ASSAY_NO_SANDBOX": opt_out} if opt_out else {}))
    assert proc.returncode == 0, proc.stderr
    assert os.path.exists(os.path.join(repo, "install-ran")) == (opt_out is None)
    if opt_out:
        assert "ASSAY_NO_SANDBOX=1" in proc.stderr and "refuse to run" in proc.stderr


NO_BWRAP_PLUGIN = """
import assay.sandbox.isolation as isolation

def pytest_configure(config):
    isolation.find_bwrap = lambda: (None, "bwrap not found (simulated)")
"""


@pytest.mark.parametrize("ci", ["", "true"])
def test_without_bubblewrap_ci_fails_with_one_line_and_a_local_run_skips(tmp_path, ci):
    (tmp_path / "nobwrap.py").write_text(NO_BWRAP_PLUGIN)
    env = {**os.environ, "CI": ci, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.path.join(ROOT, "src")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "nobwrap", "-p", "no:cacheprovider",
                           "tests/test_sandbox.py::test_bwrap_is_found_and_works"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    why = [line for line in proc.stdout.splitlines() if "bwrap not found (simulated)" in line]
    if ci:
        assert proc.returncode != 0 and len(why) == 1, proc.stdout
        assert "CI is set and the security suite cannot run" in why[0]
    else:
        assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout
